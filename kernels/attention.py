"""One attention dispatch for every attention layer in model/.

All backends take and return tensors laid out as (B, H, N, d) and compute
softmax(q @ k^T * d^-0.5) @ v. `math` is the plain PyTorch reference every other backend is
tested against; `sdpa` (PyTorch's fused scaled_dot_product_attention) is the default: on the
kernel measured fastest for the shape on this GPU where kernels/attention_choices.json lists it
(kernels/attention_choice.py), else on the flash / cuDNN / memory-efficient / math kernel PyTorch
picks for the device and dtype.

A per-call `mask` (kernels.masked: SegmentMask, TopKMask) restricts which keys each query sees.
TopK attention runs the fused Triton kernels (kernels/restricted_triton.py) on sm80+ GPUs, or their
threshold kernel and SDPA under the kept set as a mask where the table measured that faster for
the shape (kernels/attention_choice.py), and the PyTorch composition elsewhere (CPU, V100,
sequences over 1024 tokens, head dims over 128; on a GPU with one warning per reason).
Segment-masked attention runs SDPA with a boolean mask: on an H100 its memory-efficient kernel
took 0.80 ms forward+backward at ViT-B shapes in bf16 against 1.57 ms for the fused segment kernel
(docs/KERNELS.md), which stays callable for benchmarks. Backend `math` always takes the plain
references, which are the twice-differentiable path. `describe_paths` says which implementation
each kind of call gets; the entry points log it once at start.
"""
from __future__ import annotations

import importlib.util
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from kernels.accelerators import has_flash_attn
from kernels.attention_choice import kernel_for, topk_kernel_for, topk_masked_shapes
from kernels.flash_attn4 import NAME as FLASH_ATTN_4
from kernels.flash_attn4 import attention as flash_attn4_attention
from kernels.masked import (
    SegmentMask,
    TopKMask,
    per_row_k,
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
    """PyTorch's SDPA, on the kernel measured fastest for this shape where the active table lists
    it (kernels/attention_choice.py; flash-attn-4 where that was the fastest), else on PyTorch's pick."""
    kernel = kernel_for(q)
    if kernel is None:
        return F.scaled_dot_product_attention(q, k, v)
    if kernel == FLASH_ATTN_4:  # activate() kept it only where the package trains on this GPU
        return flash_attn4_attention(q, k, v)
    with sdpa_kernel(kernel):
        return F.scaled_dot_product_attention(q, k, v)


# What flash-attn 2.x's flash_attn_func takes (its checks in csrc/flash_attn/flash_api.cpp, mha_fwd and
# mha_bwd; the Python wrapper pads the head dim to a multiple of 8 itself): CUDA tensors of one dtype,
# fp16 or bf16, head dim <= 256, on a GPU of compute capability >= 8.0. It has no double backward.
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
FLASH_ATTN_MAX_HEAD_DIM = 256


def _gpu_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """(major, minor) compute capability of the GPU holding `t`; None off the GPU."""
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def flash_attn_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when flash-attn takes these (B, H, N, d) inputs, else why not."""
    if q.dtype not in FLASH_ATTN_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"{q.dtype}/{k.dtype}/{v.dtype} inputs (flash-attn takes fp16 or bf16)"
    if q.shape[-1] > FLASH_ATTN_MAX_HEAD_DIM or v.shape[-1] > FLASH_ATTN_MAX_HEAD_DIM:
        return f"head dim {max(q.shape[-1], v.shape[-1])} > {FLASH_ATTN_MAX_HEAD_DIM}"
    capability = _gpu_capability(q)
    if capability is None:
        return "not on a GPU"
    if capability < (8, 0):
        return f"compute capability {capability[0]}.{capability[1]} < 8.0"
    return None


def flash_attn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The flash-attn package where it takes the inputs, SDPA for the rest: the backend is one
    setting for the whole model, but some calls of an fp16/bf16 run are fp32 (MLO-MAE's level III
    hypergradient runs on fp32 copies of the weights)."""
    if flash_attn_refusal(q, k, v) is not None:
        return sdpa_attention(q, k, v)
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # it wants (B, N, H, d)
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
        if not torch.cuda.is_available():
            here = "there is no CUDA GPU here"
        elif (capability := torch.cuda.get_device_capability()) < (8, 0):
            here = f"this GPU is {torch.cuda.get_device_name()}, compute capability {capability[0]}.{capability[1]}"
        elif importlib.util.find_spec("flash_attn") is not None:  # flash-attn-4's flash_attn.cute alone
            here = ("flash_attn imports without flash-attn 2's flash_attn_func (flash-attn-4 installs only "
                    "flash_attn.cute, which this backend does not call; pip install -e '.[flash]')")
        else:
            here = "flash_attn does not import (pip install -e '.[flash]')"
        raise ValueError(
            f"attention backend 'flash_attn' needs the flash-attn package and a GPU with compute "
            f"capability >= 8.0, but {here}; use 'sdpa' (PyTorch's own flash kernels) instead"
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
    if isinstance(mask, SegmentMask):
        # flash kernels take no mask: SDPA's masked (memory-efficient) path, or the reference for math
        fn = segment_attention_reference if backend == "math" else segment_attention_sdpa
        return fn(q, k, v, mask.segments)
    if backend != "math" and _fused_or_warn(q):
        from kernels.restricted_triton import topk_attention, topk_attention_masked_sdpa

        B, _, T, _ = q.shape
        k_rows = per_row_k(mask.k, B, T, q.device)[:, 0, :, 0]  # (B, T) in [1, T]; another shape is refused
        path = topk_attention_masked_sdpa if topk_kernel_for(q) == "masked_sdpa" else topk_attention
        out, share = path(q, k, v, k_rows, mask.num_global, mask.segments)
        if share is not None:
            mask.same_source_share = share
        return out
    return topk_attention_reference(q, k, v, mask)


def _fused_reason(q: torch.Tensor, capability: tuple[int, int] | None = None) -> str | None:
    """None when the fused restricted-attention kernels run these inputs, else why not: device,
    compute capability (sm80+), dtype, tokens, head dim and the plan's shared memory against the
    device's limit (kernels.restricted_triton.supports). `capability` stands in for the GPU's
    (tests fake sm_70 / sm_80 / sm_90 on CPU); without it q's own device decides."""
    if capability is None:
        if not q.is_cuda:
            return "not on a GPU"
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed"
        capability = torch.cuda.get_device_capability(q.device)
    from kernels.restricted_triton import supports

    return supports(q, capability)


_FALLBACKS_WARNED: set[str] = set()


def _warn_once(reason: str) -> None:
    """One warning per distinct reason the fused kernels were skipped on a GPU (not per call)."""
    if reason not in _FALLBACKS_WARNED:
        _FALLBACKS_WARNED.add(reason)
        warnings.warn(f"restricted attention falls back to the PyTorch path on this GPU: {reason}", stacklevel=3)


def _fused_or_warn(q: torch.Tensor) -> bool:
    reason = _fused_reason(q)
    if reason is not None and q.is_cuda:
        _warn_once(reason)
    return reason is None


def describe_paths(backend: str, device: torch.device, dtype: torch.dtype, tokens: int, head_dim: int,
                   capability: tuple[int, int] | None = None) -> dict[str, str]:
    """Which implementation dense, segment-masked, TopK and biased (relative positions) attention
    calls get on this setup (`capability`: a GPU's compute capability to decide for, without one at
    hand)."""
    dense = {"sdpa": "torch SDPA (the measured kernel where kernels/attention_choices.json lists the shape, "
                     "else PyTorch's pick)", "math": "math reference",
             "flash_attn": "flash-attn package"}[backend]
    probe = torch.empty(1, 1, tokens, head_dim, dtype=dtype, device="meta" if capability else device)
    reason = "backend math" if backend == "math" else _fused_reason(probe, capability)
    segment = "math reference" if backend == "math" else "torch SDPA with a boolean mask"
    topk = "triton fused kernel" if reason is None else f"PyTorch reference composition ({reason})"
    masked = topk_masked_shapes(dtype, tokens, head_dim) if reason is None else []
    if masked:
        topk = ("triton threshold kernel + SDPA under the kept set as a mask (measured faster for "
                f"{', '.join(f'{h} heads' for h in masked)}), else the triton fused kernel")
    biased = "math reference" if backend == "math" else "torch SDPA with the bias as a float mask (PyTorch's pick)"
    return {"dense": dense, "segment": segment, "topk": topk, "biased": biased}
