"""flash-attn-4 (FlashAttention's CuTe DSL kernels, the `flash_attn.cute` package of PyPI's
flash-attn-4) as one more dense-attention kernel the table can choose per shape
(kernels/attention_choice.py): it runs where `python -m tools.choose_attention` measured it
faster than PyTorch's pick for the shape on this GPU, and nowhere else.

Its kernels are compiled from Python at the first call of each shape (no CUDA build, so the
package installs from a wheel), for Hopper (sm90) and Blackwell (sm100); its backward needs
sm90+. Forward and backward are wrapped as torch custom ops, with shape rules for fake tensors,
so compiled blocks trace the call as one opaque op without a graph break; the backward op is
registered as the forward's autograd formula. It has no double backward: energy-based
pretraining runs the `math` backend, which never reads the table.

The wrapper calls flash-attn-4's `_flash_attn_fwd` / `_flash_attn_bwd` (its own autograd
Function calls the same two; they are what a custom op can hold), checked by name at the first
use: a version without them is refused with what to install.
"""
from __future__ import annotations

import functools
import importlib

import torch

NAME = "flash_attn4"  # the table's name for this kernel
DTYPES = (torch.float16, torch.bfloat16)
# Head dims its forward and backward take (flash_attn/cute/interface.py, _validate_head_dims):
# multiples of 8 (16-byte rows in fp16/bf16), up to 256 on sm90 and 128 on sm100.
MAX_HEAD_DIM = {9: 256, 10: 128}
TESTED_VERSION = "4.0.0b36"


@functools.cache
def _interface():
    """flash-attn-4's interface module, or the reason it cannot serve."""
    try:
        module = importlib.import_module("flash_attn.cute.interface")
    except Exception as e:  # absent, or its CUTLASS DSL missing
        return f"flash-attn-4 does not import ({type(e).__name__}: {e})"
    missing = [n for n in ("_flash_attn_fwd", "_flash_attn_bwd") if not hasattr(module, n)]
    if missing:
        return (f"this flash-attn-4 has no {' or '.join(missing)} (tested with {TESTED_VERSION}: "
                f"pip install 'flash-attn-4=={TESTED_VERSION}')")
    return module


def unavailable(capability: tuple[int, int] | None) -> str | None:
    """None when flash-attn-4 imports and runs forward and backward on a GPU of `capability`
    (None: no GPU), else why not."""
    if capability is None:
        return "not on a GPU"
    if capability[0] not in MAX_HEAD_DIM:
        return f"compute capability {capability[0]}.{capability[1]} (flash-attn-4 trains on sm90 and sm100)"
    found = _interface()
    return found if isinstance(found, str) else None


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, capability: tuple[int, int] | None) -> str | None:
    """None when flash-attn-4 takes these (B, H, N, d) inputs on a GPU of `capability`, else why not."""
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"{q.dtype}/{k.dtype}/{v.dtype} inputs (flash-attn-4 takes fp16 or bf16)"
    d = q.shape[-1]
    if capability is not None and capability[0] in MAX_HEAD_DIM:
        top = MAX_HEAD_DIM[capability[0]]
        if v.shape[-1] != d:
            return f"value head dim {v.shape[-1]} for query head dim {d} (flash-attn-4 takes one head dim for both)"
        if d % 8 or not 8 <= d <= top:
            return f"head dim {d} (flash-attn-4 takes multiples of 8 from 8 to {top} here)"
    return unavailable(capability)


def _contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the fake rules promise: fresh row-major tensors (no copy when already so)."""
    return tuple(t.contiguous() for t in tensors)


def run_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v (B, N, H, d) -> out (B, N, H, d), logsumexp (B, H, N) fp32 (kept for the backward)."""
    out, lse, *_ = _interface()._flash_attn_fwd(q, k, v, return_lse=True)
    return _contiguous(out, lse)


def run_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v (B, N, H, d) each, from the forward's out and logsumexp."""
    dq, dk, dv = _interface()._flash_attn_bwd(q, k, v, out, grad_out, lse)
    return _contiguous(dq, dk, dv)


@torch.library.custom_op("vitpretrain::flash_attn4_forward", mutates_args=())
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """run_forward as one op for autograd and compile."""
    return run_forward(q, k, v)


@forward.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, N, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, N), dtype=torch.float32)


@torch.library.custom_op("vitpretrain::flash_attn4_backward", mutates_args=())
def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
             lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """run_backward as one op."""
    return run_backward(q, k, v, out, grad_out, lse)


@backward.register_fake
def _(q, k, v, out, grad_out, lse):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, *output)


def _grad(ctx, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    return backward(q, k, v, out, grad_out.contiguous(), lse)


forward.register_autograd(_grad, setup_context=_save)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v through flash-attn-4: (B, H, N, d) in and out, as every backend;
    it works in (B, N, H, d), the projection's own layout, so the transposes are views."""
    out, _ = forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)
