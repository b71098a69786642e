"""tools/method_time.py times each phase of a method's step and counts the FLOPs of exactly the
timed steps; the arithmetic beside the clock."""
import pytest
import torch

from tools import method_time
from tools.method_costs import DEBUG_METHODS
from tools.method_time import DEBUG_DS, PhaseClock, config_of, markdown, phase_times, with_floors
from train.config.parsing import parse_args
from train.estimate.step_flops import flops_by_step, step_flops


def test_the_clock_adds_each_phase_over_its_calls():
    clock = PhaseClock(torch.device("cpu"))
    for _ in range(3):
        assert clock("forward", lambda: 7) == 7
    clock("after_step", lambda: sum(range(10**5)))
    ms = clock.ms()
    assert set(ms) == set(method_time.TIMED) and ms["backward"] == 0.0 and ms["after_step"] > 0
    assert [m[0] for m in clock.marks] == ["forward"] * 3 + ["after_step"]


def test_flops_by_step_averages_to_step_flops():
    cfg = config_of("mlomae", debug=True)
    each = flops_by_step(cfg, 4, steps=2)
    mean = step_flops(cfg, 4, steps=2)
    assert len(each) == 2 and all(s["after_step"] > 0 for s in each)  # levels II and III every step in this preset
    for phase, value in mean.items():
        assert value == pytest.approx((each[0][phase] + each[1][phase]) / 2)


def test_step_flops_spreads_a_hook_that_works_every_other_step_over_its_period():
    """MLO-MAE's levels II and III run every level1_steps-th step: with 2, the first step's hook counts
    nothing and the second's everything, and the per-step figure is their mean, not the last step."""
    cfg = parse_args(["--ds_config", str(DEBUG_DS), "--data.source", "synthetic", *DEBUG_METHODS["mlomae"],
                      "--mlomae.level1_steps", "2"])
    each = flops_by_step(cfg, 4, steps=2)
    assert each[0]["after_step"] == 0 < each[1]["after_step"]
    assert step_flops(cfg, 4, steps=2)["after_step"] == pytest.approx(each[1]["after_step"] / 2)

def test_phase_times_measure_the_steps_they_count():
    cfg = config_of("mae", debug=True)
    row = phase_times(cfg, micro=4, steps=2, warmup=1, dtype=torch.float32, device=torch.device("cpu"))
    assert row["ms"]["forward"] > 0 and row["ms"]["backward"] > 0 and row["ms"]["optimizer"] > 0
    assert row["step_ms"] == pytest.approx(sum(row["ms"].values()))
    # MAE's step: backward twice the forward, no hook; the count for fp32 equals the bf16 count
    g = row["gflop_per_image"]
    assert g["backward"] == pytest.approx(2 * g["forward"], rel=0.02) and g["after_step"] == 0
    counted = step_flops(cfg, 4, steps=1, dtype=torch.float32)
    assert g == pytest.approx({k: v / 1e9 for k, v in counted.items()})


def test_floors_and_ratios_follow_from_the_rows():
    rows = {"mae": {"ms": {"forward": 10.0, "backward": 20.0, "optimizer": 2.0, "after_step": 0.0}, "step_ms": 32.0,
                    "gflop_per_image": {"forward": 20.0, "backward": 40.0, "after_step": 0.0},
                    "step_gflop_per_image": 60.0, "micro_batch": 64},
            "mlomae": {"ms": {"forward": 10.0, "backward": 20.0, "optimizer": 2.0, "after_step": 448.0},
                       "step_ms": 480.0, "gflop_per_image": {"forward": 20.0, "backward": 40.0, "after_step": 390.0},
                       "step_gflop_per_image": 450.0, "micro_batch": 64}}
    out = with_floors(rows, peak_tflops=1000.0)
    assert out["mae"]["tflops"]["forward"] == pytest.approx(20.0 * 64 / 10.0)  # GFLOP / ms = TFLOP/s
    assert out["mlomae"]["floor_ms"]["after_step"] == pytest.approx(390.0 * 64 / 1000.0)
    assert out["mlomae"]["over_mae_measured"] == pytest.approx(15.0) and out["mlomae"]["over_mae_counted"] == 7.5
    table = markdown(out)
    assert "| mlomae | 10.0 | 20.0 | 2.0 | 448.0 | 480.0 |" in table and "15.00x | 7.50x |" in table


def test_refusals_name_the_fix(capsys):
    for argv, words in ((["--micro", "0"], "--micro must be >= 1"),
                        (["--device", "cpu"], "pass --debug"),
                        (["--warmup", "-1"], "--warmup must be >= 0")):
        with pytest.raises(SystemExit) as e:
            method_time.main(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err


def _stand_in_step(monkeypatch, per_step_flops):
    """phase_times with the model, the step and the FLOP count stood in: each timed phase takes 10 ms
    of a fake clock, and step i (warm-up included) counts `per_step_flops(i)` FLOPs in each phase."""
    import itertools
    import types

    from train.estimate.step_flops import PHASES

    ticks = itertools.count()  # the module's own clock only (not the process's): start/end pairs 10 ms apart
    monkeypatch.setattr(method_time, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 0.010))

    def run_step(objective, batch, phase, optimizer=None):
        for name in method_time.TIMED:
            phase(name, lambda: None)

    monkeypatch.setattr(method_time, "build_step", lambda *a: (torch.nn.Linear(1, 1), {}))
    monkeypatch.setattr(method_time, "run_step", run_step)
    monkeypatch.setattr(method_time, "flops_by_step",
                        lambda cfg, micro, steps, dtype: [dict.fromkeys(PHASES, per_step_flops(i)) for i in range(steps)])


def test_phase_times_report_milliseconds_per_step_not_totals(monkeypatch):
    _stand_in_step(monkeypatch, lambda i: 1e9)
    row = phase_times(None, micro=4, steps=4, warmup=1, dtype=torch.float32, device=torch.device("cpu"))
    assert row["ms"] == pytest.approx(dict.fromkeys(method_time.TIMED, 10.0))  # 4 steps of 10 ms each: 10 ms a step
    assert row["step_ms"] == pytest.approx(40.0)


def test_phase_times_count_the_flops_of_the_timed_steps_not_the_warmup(monkeypatch):
    # step i counts (i + 1) GFLOP: warm-up steps 0, 1 and timed steps 2, 3, 4 average to 4 GFLOP
    _stand_in_step(monkeypatch, lambda i: (i + 1) * 1e9)
    row = phase_times(None, micro=4, steps=3, warmup=2, dtype=torch.float32, device=torch.device("cpu"))
    assert row["gflop_per_image"] == pytest.approx({"forward": 4.0, "backward": 4.0, "after_step": 4.0})
