"""Stand-ins for a CUDA GPU and for the flash-attn package, to test on a CPU-only machine what the
pre-start checks and the attention dispatch decide on the GPUs the ds_configs target.

`with fake_gpu("v100"):` makes torch.cuda's device queries answer for a V100, A100 or H100 as
device 0. Only the lowest layer is replaced (is_available,
device_count, current_device, get_device_properties, get_arch_list, and the bf16 emulation probe),
so torch's own get_device_capability, get_device_name and is_bf16_supported run unchanged over
it; nothing can be launched on the fake device. `fake_flash_attn` installs a `flash_attn` module
whose flash_attn_func refuses what the real one refuses by dtype and otherwise computes with
SDPA, recording every call.
"""
from __future__ import annotations

import contextlib
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels import accelerators

# name (torch.cuda.get_device_name), compute capability, memory GiB
GPUS = {
    "v100": ("Tesla V100-SXM2-32GB", (7, 0), 32),
    "a100": ("NVIDIA A100-SXM4-80GB", (8, 0), 80),
    "h100": ("NVIDIA H100 80GB HBM3", (9, 0), 80),
}
# torch.cuda.get_arch_list() of the torch 2.14 wheels: PyPI's CUDA 13.0 build (what `make install`
# gets; read from the installed one) and the CUDA 12.6 build from download.pytorch.org/whl/cu126
# (torch's own release table, torch.cuda.PYTORCH_RELEASES_CODE_CC["12.6"]["x86_64"]).
CU130_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
CU126_ARCHS = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")


def _clear_accelerator_caches() -> None:
    """kernels/accelerators.py caches what it found (has_flash_attn, ...): forget it."""
    for probe in vars(accelerators).values():
        if callable(getattr(probe, "cache_clear", None)):
            probe.cache_clear()


@contextlib.contextmanager
def fake_gpu(gpu: str, arch_list: tuple[str, ...] = CU130_ARCHS):
    """Inside the block torch.cuda reports `gpu` ("v100" | "a100" | "h100") as device 0 and a torch
    build compiled for `arch_list`. Keep the block to the checks: torch code that sees CUDA
    available may try to initialise it (an optimizer step does)."""
    name, (major, minor), gib = GPUS[gpu]
    props = SimpleNamespace(name=name, major=major, minor=minor, total_memory=gib * 2**30,
                            multi_processor_count={7: 80, 8: 108, 9: 132}[major])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        mp.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        mp.setattr(torch.cuda, "get_arch_list", lambda: list(arch_list))
        # torch's emulation probe (a bf16 tensor on the device) succeeds on a real V100
        mp.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)
        _clear_accelerator_caches()
        try:
            yield
        finally:
            _clear_accelerator_caches()  # answers cached under the fake


def fake_flash_attn(monkeypatch) -> list[torch.dtype]:
    """Install a fake `flash_attn` package; returns the list that records the dtype of every call."""
    calls: list[torch.dtype] = []

    def flash_attn_func(q, k, v, *args, **kwargs):  # (B, N, H, d) like the real one
        calls.append(q.dtype)
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")  # flash_api.cpp's check
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    module = ModuleType("flash_attn")
    module.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    _clear_accelerator_caches()
    return calls
