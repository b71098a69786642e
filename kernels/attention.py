"""One attention dispatch for every attention layer in model/.

All backends take and return tensors laid out as (B, H, N, d) and compute
softmax(q @ k^T * d^-0.5) @ v. `math` is the plain PyTorch reference every other backend is
tested against; `sdpa` (PyTorch's fused scaled_dot_product_attention, which itself picks the
flash / memory-efficient / math kernel for the device and dtype) is the default.

A per-call `mask` (kernels.masked: SegmentMask, TopKMask) restricts which keys each query sees.
Restricted attention runs the fused Triton kernels (kernels/restricted_triton.py) on sm80+ GPUs
and the PyTorch paths elsewhere (CPU, V100, sequences over 1024 tokens); backend `math` always
takes the plain references, which are the twice-differentiable path. `describe_paths` says
which implementation each kind of call gets; the entry points log it once at start.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kernels.accelerators import has_flash_attn, has_triton_gpu
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


# The backend for methods that differentiate through an input gradient (energy-based pretraining):
# SDPA's flash / memory-efficient kernels and flash-attn have no double backward.
TWICE_DIFFERENTIABLE = "math"

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


def biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                     backend: str = "sdpa") -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v with an additive score bias broadcastable to (B, H, N, N)
    (e.g. relative positions). math: the reference; otherwise SDPA with a float mask (flash
    kernels take no bias, so the flash_attn backend also lands here)."""
    if backend == "math":
        compute = torch.promote_types(q.dtype, torch.float32)
        logits = (q.to(compute) @ k.to(compute).transpose(-2, -1)) * q.shape[-1] ** -0.5 + bias.to(compute)
        return (logits.softmax(dim=-1) @ v.to(compute)).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa",
              mask: AttentionMask | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: q, k, v (B, H, N, d) -> (B, H, N, d); optional restriction `mask` or additive `bias`."""
    if bias is not None:
        if mask is not None:
            raise ValueError("an additive score bias (relative positions) cannot be combined with a restricted "
                             "attention mask (TopK / segment); use one or the other")
        return biased_attention(q, k, v, bias, backend)
    if mask is None:
        return BACKENDS[backend](q, k, v)
    if not isinstance(mask, (SegmentMask, TopKMask)):
        raise TypeError(f"unknown attention mask {type(mask).__name__}; expected SegmentMask or TopKMask")
    fused = backend != "math" and _fused_reason(q) is None
    if isinstance(mask, SegmentMask):
        if fused:
            from kernels.restricted_triton import segment_attention

            return segment_attention(q, k, v, mask.segments)
        # flash kernels take no mask: SDPA's masked (memory-efficient) path, or the reference for math
        fn = segment_attention_reference if backend == "math" else segment_attention_sdpa
        return fn(q, k, v, mask.segments)
    if fused:
        from kernels.restricted_triton import topk_attention

        B, _, T, _ = q.shape
        k_rows = torch.full((B, T), mask.k, device=q.device) if isinstance(mask.k, int) else mask.k
        out, share = topk_attention(q, k, v, k_rows.clamp(1, T), mask.num_global, mask.segments)
        if share is not None:
            mask.same_source_share = share
        return out
    return topk_attention_reference(q, k, v, mask)


def _fused_reason(q: torch.Tensor) -> str | None:
    """None when the fused restricted-attention kernels run these inputs, else why not."""
    if not q.is_cuda:
        return "not on a GPU"
    if not has_triton_gpu():
        return "needs Triton on an sm80+ GPU"
    from kernels.restricted_triton import supports

    return supports(q)


def describe_paths(backend: str, device: torch.device, dtype: torch.dtype, tokens: int, head_dim: int) -> dict[str, str]:
    """Which implementation dense, segment-masked and TopK attention calls get on this setup."""
    dense = {"sdpa": "torch SDPA (flash / memory-efficient / math, chosen by PyTorch)", "math": "math reference",
             "flash_attn": "flash-attn package"}[backend]
    probe = torch.empty(1, 1, tokens, head_dim, dtype=dtype, device=device)
    reason = "backend math" if backend == "math" else _fused_reason(probe)
    if reason is None:
        return {"dense": dense, "segment": "triton fused kernel", "topk": "triton fused kernel"}
    segment = "math reference" if backend == "math" else "torch SDPA with a boolean mask"
    return {"dense": dense, "segment": f"{segment} ({reason})", "topk": f"PyTorch reference composition ({reason})"}
