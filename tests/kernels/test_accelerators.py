"""Optional accelerator packages are detected by what they must provide (kernels/accelerators.py)."""
import sys
from types import ModuleType

import pytest
import torch

from kernels import accelerators


@pytest.fixture
def fresh_apex_check(monkeypatch):
    """has_nvidia_apex is cached per process: cleared around the test, sys.modules restored after."""
    for name in ("apex", "apex.optimizers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    accelerators.has_nvidia_apex.cache_clear()
    yield monkeypatch
    accelerators.has_nvidia_apex.cache_clear()


def test_an_apex_without_fused_optimizers_is_not_nvidia_apex(fresh_apex_check):
    """PyPI's `apex` is an unrelated project: it imports, but has no apex.optimizers."""
    fresh_apex_check.setitem(sys.modules, "apex", ModuleType("apex"))
    assert not accelerators.has_nvidia_apex()


def test_an_apex_with_fused_optimizers_is_nvidia_apex(fresh_apex_check):
    apex, optimizers = ModuleType("apex"), ModuleType("apex.optimizers")
    apex.optimizers = optimizers
    fresh_apex_check.setitem(sys.modules, "apex", apex)
    fresh_apex_check.setitem(sys.modules, "apex.optimizers", optimizers)
    assert accelerators.has_nvidia_apex()


def test_without_a_cuda_gpu_the_gpu_packages_are_reported_absent(monkeypatch):
    """flash-attn and Triton import on a machine without a CUDA GPU (CPU nodes, login nodes): the
    start-up summary says they cannot run there instead of failing on the GPU query."""
    flash_attn, triton = ModuleType("flash_attn"), ModuleType("triton")
    flash_attn.flash_attn_func = lambda *args: None
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    probes = (accelerators.has_flash_attn, accelerators.has_triton_gpu)
    for probe in probes:  # cached per process: cleared so this machine's answer is computed here
        probe.cache_clear()
    try:
        said = accelerators.describe()
        assert said["cuda"] is False and said["flash_attn"] is False and said["triton_gpu"] is False
        assert accelerators.has_triton_gpu() is False
    finally:
        for probe in probes:
            probe.cache_clear()
