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

