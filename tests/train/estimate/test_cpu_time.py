"""train/estimate/cpu_time.py: a benchmark says how long it takes on this CPU, and one sized for a GPU is
refused unless asked for."""
import pytest

from train.config.errors import ConfigError
from train.estimate import cpu_time


def test_the_estimate_is_said_first_and_a_gpu_sized_run_is_refused_unless_allowed(monkeypatch, capsys):
    monkeypatch.setattr(cpu_time, "matmul_flops_per_s", lambda: 1e11)  # 100 GFLOP/s
    assert cpu_time.check_cpu_time(3e12, "mae vit_mini", allow=False, smaller="a smaller model") == 30.0
    assert capsys.readouterr().out.strip() == ("mae vit_mini: 3 TFLOP of matmuls; this CPU multiplies at 100 GFLOP/s, "
                                               "so at least 30 s")
    with pytest.raises(ConfigError, match=r"at least 16.7 min: it is sized for a GPU; run it on one, a smaller "
                                          r"model, or pass --allow_cpu"):
        cpu_time.check_cpu_time(1e14, "mae vit_base", allow=False, smaller="a smaller model")
    assert cpu_time.check_cpu_time(1e14, "mae vit_base", allow=True, smaller="") == 1000.0


def test_the_measured_rate_is_a_plausible_cpu_rate():
    rate = cpu_time.matmul_flops_per_s(size=256, repeats=2)
    assert 1e8 < rate < 1e14  # between a slow core and far more than any CPU


def test_the_rate_is_two_flops_per_multiply_add_over_the_fastest_repeat(monkeypatch):
    """A product of two n x n matrices is n^3 multiply-adds, 2 n^3 FLOPs; the rate takes the best of
    the repeats (the others were slowed by something else). A fake clock: the products take 0.5, 0.25
    and 0.4 s."""
    import itertools
    import types

    durations, now, calls = iter([0.5, 0.25, 0.4]), [0.0], itertools.count()

    def perf_counter():  # start, end, start, end, ...: each end one product later
        if next(calls) % 2 == 1:
            now[0] += next(durations)
        return now[0]

    monkeypatch.setattr(cpu_time, "time", types.SimpleNamespace(perf_counter=perf_counter))
    assert cpu_time.matmul_flops_per_s(size=64, repeats=3) == pytest.approx(2 * 64**3 / 0.25)
