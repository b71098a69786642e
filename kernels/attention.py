"""One attention dispatch for every attention layer in model/.

All backends take and return tensors laid out as (B, H, N, d) and compute
softmax(q @ k^T * d^-0.5) @ v. `math` is the plain PyTorch reference every other backend is
tested against; `sdpa` (PyTorch's fused scaled_dot_product_attention, which itself picks the
flash / memory-efficient / math kernel for the device and dtype) is the default.

A per-call `mask` (kernels.masked: SegmentMask, TopKMask) restricts which keys each query sees;
the backend then names the family of implementation (math = the plain reference).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kernels.accelerators import has_flash_attn
from kernels.masked import (
    SegmentMask,
    TopKMask,
    segment_attention_reference,
    segment_attention_sdpa,
    topk_attention_reference,
)

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference: materialises the (B, H, N, N) attention matrix; at least fp32 inside.

    Twice differentiable, so it is also the path for methods that need double backward.
    """
    compute = torch.promote_types(q.dtype, torch.float32)  # fp16/bf16 -> fp32, fp64 stays
    scale = q.shape[-1] ** -0.5
    logits = (q.to(compute) @ k.to(compute).transpose(-2, -1)) * scale  # (B, H, N, N)
    return (logits.softmax(dim=-1) @ v.to(compute)).to(q.dtype)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def flash_attn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The flash-attn package (fp16/bf16 on sm80+); it wants (B, N, H, d)."""
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


BACKENDS: dict[str, AttentionFn] = {
    "math": math_attention,
    "sdpa": sdpa_attention,
    "flash_attn": flash_attn_attention,
}


def resolve_backend(name: str) -> str:
    """Validate a backend name; `auto` picks sdpa (flash-attn only when asked for by name)."""
    if name == "auto":
        return "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {['auto', *BACKENDS]}")
    if name == "flash_attn" and not has_flash_attn():
        raise ValueError(
            "attention backend 'flash_attn' needs the flash-attn package and a GPU with compute "
            "capability >= 8.0; use 'sdpa' (PyTorch's own flash kernels) instead"
        )
    return name


AttentionMask = SegmentMask | TopKMask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa",
              mask: AttentionMask | None = None) -> torch.Tensor:
    """Dispatch: q, k, v (B, H, N, d) -> (B, H, N, d)."""
    if mask is None:
        return BACKENDS[backend](q, k, v)
    if isinstance(mask, SegmentMask):
        # flash kernels take no mask: sdpa and flash_attn both go to SDPA's masked (memory-efficient) path
        fn = segment_attention_reference if backend == "math" else segment_attention_sdpa
        return fn(q, k, v, mask.segments)
    if isinstance(mask, TopKMask):
        return topk_attention_reference(q, k, v, mask)
    raise TypeError(f"unknown attention mask {type(mask).__name__}; expected SegmentMask or TopKMask")
