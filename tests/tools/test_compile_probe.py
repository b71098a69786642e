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
