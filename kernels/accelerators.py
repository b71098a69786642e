"""Detection of optional accelerator packages.

apex and flash-attn are never required. Both are checked by what they must provide, not by
the import name alone: the PyPI package called ``apex`` is an unrelated project, and
flash-attn builds only against CUDA and needs compute capability >= 8.0 (A100/H100).
"""
from __future__ import annotations

import functools
import importlib

import torch


@functools.cache
def has_nvidia_apex() -> bool:
    """True when NVIDIA apex with its fused optimizers is importable."""
    try:
        importlib.import_module("apex.optimizers")
    except Exception:  # unrelated `apex`, missing CUDA extension, or not installed
        return False
    return True


def _imports_on_sm80(module: str, provides: str | None = None) -> bool:
    """True when `module` imports (with the attribute `provides`, if given) and the current GPU has
    compute capability >= 8.0."""
    if not torch.cuda.is_available():
        return False
    try:
        imported = importlib.import_module(module)
    except Exception:
        return False
    if provides is not None and not hasattr(imported, provides):
        return False
    major, _ = torch.cuda.get_device_capability()
    return major >= 8


@functools.cache
def has_flash_attn() -> bool:
    """True when flash-attn 2.x imports and the current GPU can run it (FlashAttention-2 has no
    kernels for V100, sm70). Checked by its `flash_attn_func`, not the import alone: flash-attn-4
    installs only `flash_attn/cute`, which leaves `flash_attn` an empty namespace package that imports."""
    return _imports_on_sm80("flash_attn", provides="flash_attn_func")


@functools.cache
def has_triton_gpu() -> bool:
    """True when Triton imports and the current GPU is sm80+ (our fused kernels' target; V100
    falls back to the PyTorch paths)."""
    return _imports_on_sm80("triton")


def describe() -> dict[str, bool]:
    """Summary logged once at start-up."""
    return {"cuda": torch.cuda.is_available(), "nvidia_apex": has_nvidia_apex(), "flash_attn": has_flash_attn(),
            "triton_gpu": has_triton_gpu()}
