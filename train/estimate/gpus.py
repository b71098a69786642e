"""The GPUs the ds_configs target: memory, precision support, dense peak, for the dry run and MFU.

Peaks are the dense (no sparsity) tensor-core figures at fp16/bf16, from the vendors' data sheets:
the SXM parts, and the H100's PCIe and NVL cards, whose lower clocks and power give lower peaks
than the SXM part's. V100 has no bf16 and FlashAttention-2 needs sm80+.
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
    "h100-pcie": GPU("H100 PCIe 80GB", 80, bf16=True, sm80=True, peak_tflops=756, capability="9.0"),
    "h100-nvl": GPU("H100 NVL 94GB", 94, bf16=True, sm80=True, peak_tflops=835, capability="9.0"),
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
    return gpu_of(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory / 2**30)


# What torch.cuda.get_device_name() holds, most specific first, and the entries it may be. The
# H100 PCIe holds the SXM part's 80 GB at a lower peak, so the form factor is read from the name
# ("NVIDIA H100 PCIe", "NVIDIA H100 NVL"; the SXM part is "NVIDIA H100 80GB HBM3"); memory then
# tells apart the sizes of one part (A100 40 / 80 GB).
BY_DEVICE_NAME = (
    ("h100 pcie", ("h100-pcie",)),
    ("h100 nvl", ("h100-nvl",)),
    ("h200", ("h200",)),
    ("h100", ("h100",)),
    ("a100", ("a100", "a100-40gb")),
    ("v100", ("v100", "v100-16gb")),
)


def gpu_of(device_name: str, memory_gib: float) -> GPU | None:
    """The entry of a device torch names `device_name` holding `memory_gib` (None when unknown)."""
    name = device_name.lower()
    for fragment, keys in BY_DEVICE_NAME:
        if fragment in name:
            return min((GPUS[k] for k in keys), key=lambda g: abs(g.memory_gib - memory_gib))
    return None


def gpu_in_filename(path: str) -> str | None:
    """The GPU a shipped ds_config names (`..._8xa100_...` -> a100)."""
    for key in ("v100", "a100", "h100", "h200"):
        if f"x{key}_" in path:
            return key
    return None
