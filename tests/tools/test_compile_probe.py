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


def test_float8_curves_compare_float8_with_bf16s_own_noise():
    """On CPU with the debug model (eager): three curves, two gaps over the last quarter, and the
    verdict that compares them; the seed changes the curve, float8 changes it too."""
    pytest.importorskip("torchao")
    out = compile_probe.float8_curves("", 4, 4, "eager", torch.device("cpu"), DEBUG)
    curves = out["losses"]
    assert set(curves) == {"bf16_seed0", "bf16_seed1", "float8_seed0"} and all(len(c) == 4 for c in curves.values())
    assert curves["bf16_seed1"] != curves["bf16_seed0"] != curves["float8_seed0"]
    assert out["float8_gap"] == pytest.approx(abs(curves["float8_seed0"][-1] - curves["bf16_seed0"][-1]))
    assert out["seed_gap"] == pytest.approx(abs(curves["bf16_seed1"][-1] - curves["bf16_seed0"][-1]))
    assert out["within_bf16_noise"] == (out["float8_gap"] <= out["seed_gap"])
