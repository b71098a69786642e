"""tools/compile_probe.py measures a GPU's step: on a machine without CUDA it is refused in one
line."""
import pytest
import torch

from tools import compile_probe


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU to measure")
def test_without_cuda_it_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as refused:
        compile_probe.main(["compiled"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and "has no CUDA device" in err



DEBUG = ["--config", "train/configs/mae/debug.json"]


def test_the_loss_curve_is_the_same_whatever_else_the_process_did():
    """`equality` compares two variants' curves: each must come from the same weights, images and
    masks, so two eager curves are identical even after other random draws in between; with
    accumulation each step averages its micro-batches."""
    cpu = torch.device("cpu")
    first = compile_probe.loss_curve("eager", "", 4, 3, "fp32", 2, cpu, DEBUG)
    torch.rand(1000)  # the process's generator moves on
    second = compile_probe.loss_curve("eager", "", 4, 3, "fp32", 2, cpu, DEBUG)
    assert first == second and len(first) == 3 and all(x > 0 for x in first)
    assert first[0] != first[1]  # the steps train: the curve is not one value repeated
    single = compile_probe.loss_curve("eager", "", 4, 1, "fp32", 1, cpu, DEBUG)
    assert single[0] != first[0]  # one micro-batch is not the average of two


def test_bad_counts_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as refused:
        compile_probe.main(["equality", "--accum", "0"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and "--accum and --steps must be >= 1" in err


def test_float8_curves_compare_float8_with_bf16s_own_noise(monkeypatch):
    """On CPU with the debug model (eager): three curves, two gaps over the last quarter, and the
    verdict that compares them; the seed changes the curve, float8 changes it too. float8's run is
    configured with bf16's first seed, so its gap is float8's alone, not seed noise on top."""
    pytest.importorskip("torchao")
    configured, real = [], compile_probe.engine_for

    def spy(*a, **k):
        engine, cfg = real(*a, **k)
        configured.append((cfg.seed, cfg.run.float8))
        return engine, cfg

    monkeypatch.setattr(compile_probe, "engine_for", spy)
    out = compile_probe.float8_curves("", 4, 4, "eager", torch.device("cpu"), DEBUG)
    assert configured == [(0, False), (1, False), (0, True)]  # bf16_seed0, bf16_seed1, float8_seed0
    curves = out["losses"]
    assert set(curves) == {"bf16_seed0", "bf16_seed1", "float8_seed0"} and all(len(c) == 4 for c in curves.values())
    assert curves["bf16_seed1"] != curves["bf16_seed0"] != curves["float8_seed0"]
    assert out["float8_gap"] == pytest.approx(abs(curves["float8_seed0"][-1] - curves["bf16_seed0"][-1]))
    assert out["seed_gap"] == pytest.approx(abs(curves["bf16_seed1"][-1] - curves["bf16_seed0"][-1]))
    assert out["within_bf16_noise"] == (out["float8_gap"] <= out["seed_gap"])


def test_with_accumulation_each_step_s_loss_is_the_mean_of_its_micro_batches(monkeypatch):
    """The engine is wrapped to record each micro-batch's loss as it comes out; a step's value is
    their mean, not their sum."""
    seen = []

    class Recording:
        def __init__(self, engine):
            self.engine = engine

        def __getattr__(self, name):
            return getattr(self.engine, name)

        def __call__(self, batch):
            out = self.engine(batch)
            seen.append(out["loss"].item())
            return out

    real = compile_probe.engine_for

    def recording_engine_for(*a, **k):
        engine, cfg = real(*a, **k)
        return Recording(engine), cfg

    monkeypatch.setattr(compile_probe, "engine_for", recording_engine_for)
    curve = compile_probe.loss_curve("eager", "", 4, 2, "fp32", 2, torch.device("cpu"), DEBUG)
    assert len(seen) == 4 and seen[0] != seen[1]
    assert curve == pytest.approx([(seen[0] + seen[1]) / 2, (seen[2] + seen[3]) / 2], rel=1e-6)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_engine_runs_in_the_precision_asked(precision, dtype):
    engine, _ = compile_probe.engine_for("eager", "", 4, precision, 1, torch.device("cpu"), DEBUG)
    assert engine.dtype == dtype


@pytest.mark.parametrize("precision, tolerance, equal", [("fp32", 1e-3, False), ("bf16", 2e-2, True)])
def test_equality_judges_the_worst_step_against_the_precision_s_tolerance(monkeypatch, precision, tolerance, equal):
    curves = {"eager": [1.0, 1.0, 1.0], "compiled": [1.0, 1.001, 1.015]}  # the worst step is 1.5 % off
    monkeypatch.setattr(compile_probe, "loss_curve", lambda variant, *a: curves[variant])
    out = compile_probe.equality("m", 4, 3, precision, 1)
    assert out["max_relative_difference"] == pytest.approx(0.015)
    assert out["tolerance"] == tolerance and out["equal"] is equal
