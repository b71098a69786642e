"""The GPUs the ds_configs target: memory, precision support, dense peak, for the dry run and MFU.

Peaks are the dense (no sparsity) tensor-core figures of the SXM parts at fp16/bf16, from the
vendors' data sheets; V100 has no bf16 and FlashAttention-2 needs sm80+.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bf16: bool
    sm80: bool  # FlashAttention-2, the fused Triton restricted-attention kernels
    peak_tflops: float  # dense fp16 / bf16 tensor-core peak
    capability: str  # compute capability, the key of kernels/attention_choices.json


GPUS = {
    "v100": GPU("V100 SXM2 32GB", 32, bf16=False, sm80=False, peak_tflops=125, capability="7.0"),
    "v100-16gb": GPU("V100 SXM2 16GB", 16, bf16=False, sm80=False, peak_tflops=125, capability="7.0"),
    "a100": GPU("A100 SXM4 80GB", 80, bf16=True, sm80=True, peak_tflops=312, capability="8.0"),
    "a100-40gb": GPU("A100 SXM4 40GB", 40, bf16=True, sm80=True, peak_tflops=312, capability="8.0"),
    "h100": GPU("H100 SXM5 80GB", 80, bf16=True, sm80=True, peak_tflops=989, capability="9.0"),
    "h200": GPU("H200 SXM 141GB", 141, bf16=True, sm80=True, peak_tflops=989, capability="9.0"),
}


def gpu_named(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; choose one of {sorted(GPUS)}")
    return GPUS[name]


def current_gpu() -> GPU | None:
    """The entry of this machine's first CUDA device, matched by name and memory (None on CPU or unknown)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0).lower()
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    for key in ("h200", "h100", "a100", "v100"):
        if key in name:
            candidates = [g for k, g in GPUS.items() if k.startswith(key)]
            return min(candidates, key=lambda g: abs(g.memory_gib - gib))
    return None


def gpu_in_filename(path: str) -> str | None:
    """The GPU a shipped ds_config names (`..._8xa100_...` -> a100)."""
    for key in ("v100", "a100", "h100", "h200"):
        if f"x{key}_" in path:
            return key
    return None
