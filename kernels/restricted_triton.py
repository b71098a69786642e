"""Fused restricted attention in Triton: homologous TopK and segment-masked, forward and backward.

Same semantics as the references in kernels/masked.py (which the tests compare against):
  TopK:    a non-global query keeps every key whose logit >= its row's K-th largest logit.
  Segment: query i attends key j iff seg[i] == seg[j], or seg[i] == GLOBAL (-1).

One program handles BLOCK_M query rows of one (batch, head) against the whole key row: a ViT
sequence (T <= 1024) fits on chip, so the (BLOCK_M, T) logits never reach global memory.
- K-th largest per row, exactly: logits are mapped to order-preserving uint32 keys and the K-th
  largest key is built bit by bit from the top (radix select: 32 masked row counts). Ties at the
  threshold are all kept, as in the reference.
- Softmax over the kept entries in fp32, O = P V with fp32 accumulation; the row's log-sum-exp and
  threshold key are saved for the backward.
- Backward per query block: recompute the logits with the same code and block shapes (so the kept
  set is bit-identical), dS = P * (dP - rowsum(dO * O)), dQ = dS K (row-local), and the block's
  dK = dS^T Q, dV = P^T dO contributions atomically added into fp32 buffers. Nothing of size
  T x T is stored; the fp32 atomics make dK/dV summation order (not the kept set) nondeterministic.

Not twice differentiable: a backward with create_graph=True raises; use the `math` backend for that.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MODE_TOPK = 0
MODE_SEGMENT = 1
MAX_TOKENS = 1024  # a whole key row must fit on chip
MAX_HEAD_DIM = 256


@triton.jit
def _ordered_key(s):
    """fp32 -> uint32 with the same order (negative floats have their magnitude bits flipped)."""
    bits = s.to(tl.int32, bitcast=True)
    signed = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return signed.to(tl.uint32, bitcast=True) ^ (tl.full(s.shape, 1, tl.uint32) << 31)


@triton.jit
def _scores(Q, K, q_base, k_base, offs_m, offs_n, offs_d, stride_t, T, D, scale):
    """(BLOCK_M, BLOCK_N) fp32 logits of one query block against the whole key row."""
    q = tl.load(Q + q_base + offs_m[:, None] * stride_t + offs_d[None, :],
                mask=(offs_m[:, None] < T) & (offs_d[None, :] < D), other=0.0)
    k = tl.load(K + k_base + offs_n[:, None] * stride_t + offs_d[None, :],
                mask=(offs_n[:, None] < T) & (offs_d[None, :] < D), other=0.0)
    return tl.dot(q, tl.trans(k), input_precision="ieee") * scale, q, k


@triton.jit
def _kept(s, offs_m, offs_n, T, num_global, krow_ptr, seg_ptr, thr, MODE: tl.constexpr, FIND_THRESHOLD: tl.constexpr,
          BLOCK_M: tl.constexpr):
    """Boolean (BLOCK_M, BLOCK_N) kept set and the per-row threshold key (TopK mode)."""
    valid_n = offs_n < T
    if MODE == 0:
        key = tl.where(valid_n[None, :], _ordered_key(s), 0)
        if FIND_THRESHOLD:
            kk = tl.load(krow_ptr + offs_m, mask=offs_m < T, other=1)
            thr = tl.zeros([BLOCK_M], dtype=tl.uint32)
            for bit in tl.static_range(31, -1, -1):
                cand = thr | (tl.full([BLOCK_M], 1, tl.uint32) << bit)
                count = tl.sum(((key >= cand[:, None]) & valid_n[None, :]).to(tl.int32), axis=1)
                thr = tl.where(count >= kk, cand, thr)
        keep = (key >= thr[:, None]) | (offs_m[:, None] < num_global)
    else:
        seg_q = tl.load(seg_ptr + offs_m, mask=offs_m < T, other=-2)
        seg_k = tl.load(seg_ptr + offs_n, mask=valid_n, other=-3)
        keep = (seg_q[:, None] == seg_k[None, :]) | (seg_q[:, None] == -1)
    return keep & valid_n[None, :] & (offs_m[:, None] < T), thr


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, THR, KROW, SEG, STATS, H, T, D, stride_b, stride_h, stride_t, scale, num_global,
                MODE: tl.constexpr, WITH_STATS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    base = b * stride_b + h * stride_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    s, q, k = _scores(Q, K, base, base, offs_m, offs_n, offs_d, stride_t, T, D, scale)
    keep, thr = _kept(s, offs_m, offs_n, T, num_global, KROW + b * T, SEG + b * T,
                      tl.zeros([BLOCK_M], dtype=tl.uint32), MODE, True, BLOCK_M)
    s = tl.where(keep, s, float("-inf"))
    row_max = tl.max(s, axis=1)
    row_max = tl.where(offs_m < T, row_max, 0.0)  # padded rows: keep the arithmetic finite
    p = tl.where(keep, tl.exp(s - row_max[:, None]), 0.0)
    denom = tl.sum(p, axis=1)
    denom = tl.where(offs_m < T, denom, 1.0)
    v = tl.load(V + base + offs_n[:, None] * stride_t + offs_d[None, :],
                mask=(offs_n[:, None] < T) & (offs_d[None, :] < D), other=0.0)
    o = tl.dot(p.to(v.dtype), v, input_precision="ieee") / denom[:, None]
    row_ok = offs_m < T
    tl.store(O + base + offs_m[:, None] * stride_t + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))
    row_index = bh * T + offs_m
    tl.store(LSE + row_index, row_max + tl.log(denom), mask=row_ok)
    if MODE == 0:
        tl.store(THR + row_index, thr.to(tl.int32, bitcast=True), mask=row_ok)
        if WITH_STATS:  # per row: kept keys, and kept keys from the query's own source
            seg_q = tl.load(SEG + b * T + offs_m, mask=row_ok, other=-2)
            seg_k = tl.load(SEG + b * T + offs_n, mask=offs_n < T, other=-3)
            same = keep & (seg_q[:, None] == seg_k[None, :])
            tl.store(STATS + row_index * 2, tl.sum(keep.to(tl.int32), axis=1), mask=row_ok)
            tl.store(STATS + row_index * 2 + 1, tl.sum(same.to(tl.int32), axis=1), mask=row_ok)


@triton.jit
def _bwd_kernel(Q, K, V, O, DO, LSE, THR, SEG, DQ, DK, DV, H, T, D, stride_b, stride_h, stride_t, scale, num_global,
                MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    base = b * stride_b + h * stride_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    row_index = bh * T + offs_m
    s, q, k = _scores(Q, K, base, base, offs_m, offs_n, offs_d, stride_t, T, D, scale)
    thr = tl.zeros([BLOCK_M], dtype=tl.uint32)
    if MODE == 0:
        thr = tl.load(THR + row_index, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
    keep, thr = _kept(s, offs_m, offs_n, T, num_global, THR, SEG + b * T, thr, MODE, False, BLOCK_M)
    lse = tl.load(LSE + row_index, mask=row_ok, other=0.0)
    p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)  # (BLOCK_M, BLOCK_N) fp32
    tile = row_ok[:, None] & (offs_d[None, :] < D)
    do = tl.load(DO + base + offs_m[:, None] * stride_t + offs_d[None, :], mask=tile, other=0.0)
    o = tl.load(O + base + offs_m[:, None] * stride_t + offs_d[None, :], mask=tile, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)  # rowsum(dO * O)
    v = tl.load(V + base + offs_n[:, None] * stride_t + offs_d[None, :],
                mask=(offs_n[:, None] < T) & (offs_d[None, :] < D), other=0.0)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, input_precision="ieee") * scale
    tl.store(DQ + base + offs_m[:, None] * stride_t + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=tile)
    key_tile = (offs_n[:, None] < T) & (offs_d[None, :] < D)
    dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee") * scale  # (BLOCK_N, BLOCK_D)
    dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee")
    tl.atomic_add(DK + base + offs_n[:, None] * stride_t + offs_d[None, :], dk, mask=key_tile)
    tl.atomic_add(DV + base + offs_n[:, None] * stride_t + offs_d[None, :], dv, mask=key_tile)


def _blocks(T: int, d: int) -> tuple[int, int, int, int]:
    block_n = max(16, triton.next_power_of_2(T))
    block_d = max(16, triton.next_power_of_2(d))
    block_m = 64 if block_n * block_d <= 256 * 64 else 32 if block_n <= 512 else 16
    return block_m, block_n, block_d, 8 if block_n >= 256 else 4


def supports(q: torch.Tensor) -> str | None:
    """None when the fused kernel can run these inputs, else the reason it cannot."""
    T, d = q.shape[-2:]
    if T > MAX_TOKENS:
        return f"sequence length {T} > {MAX_TOKENS} (a key row must fit on chip)"
    if d > MAX_HEAD_DIM:
        return f"head dim {d} > {MAX_HEAD_DIM}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype}"
    return None


class _RestrictedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mode: int, k_rows, segments, num_global: int, with_stats: bool):
        B, H, T, d = q.shape
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = torch.empty_like(q)
        lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
        thr = torch.empty(B, H, T, device=q.device, dtype=torch.int32)
        stats = torch.zeros(B, H, T, 2, device=q.device, dtype=torch.int32)
        dummy = torch.zeros(1, device=q.device, dtype=torch.int32)
        k_rows = k_rows.to(torch.int32).contiguous() if k_rows is not None else dummy
        seg = segments.to(torch.int32).contiguous() if segments is not None else dummy
        block_m, block_n, block_d, warps = _blocks(T, d)
        grid = (triton.cdiv(T, block_m), B * H)
        _fwd_kernel[grid](q, k, v, o, lse, thr, k_rows, seg, stats, H, T, d, q.stride(0), q.stride(1), q.stride(2),
                          d**-0.5, num_global, MODE=mode, WITH_STATS=with_stats, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_D=block_d, num_warps=warps)
        ctx.save_for_backward(q, k, v, o, lse, thr, seg)
        ctx.mode, ctx.num_global = mode, num_global
        ctx.mark_non_differentiable(stats)
        return o, stats

    @staticmethod
    def backward(ctx, do, _dstats):
        if torch.is_grad_enabled():  # backward(create_graph=True): a second derivative was asked for
            raise RuntimeError("the fused restricted-attention kernel is not twice differentiable; use "
                               "model.attn_backend math (the reference path) for double backward")
        q, k, v, o, lse, thr, seg = ctx.saved_tensors
        B, H, T, d = q.shape
        do = do.contiguous()
        dq = torch.empty_like(q)
        dk = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        dv = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        block_m, block_n, block_d, warps = _blocks(T, d)
        grid = (triton.cdiv(T, block_m), B * H)
        _bwd_kernel[grid](q, k, v, o, do, lse, thr, seg, dq, dk, dv, H, T, d, q.stride(0), q.stride(1), q.stride(2),
                          d**-0.5, ctx.num_global, MODE=ctx.mode, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                          num_warps=warps)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def topk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor, num_global: int,
                   segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k, v (B, H, T, d); k_rows (B, T) keys kept per query. Returns the output and, when
    segments (B, T) are given, the same-source share of kept keys over non-global queries."""
    out, stats = _RestrictedAttention.apply(q, k, v, MODE_TOPK, k_rows, segments, num_global, segments is not None)
    share = None
    if segments is not None:
        rows = stats[:, :, num_global:].sum(dim=(0, 1, 2)).float()  # (kept, same)
        share = rows[1] / rows[0].clamp_min(1)
    return out, share


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    return _RestrictedAttention.apply(q, k, v, MODE_SEGMENT, None, segments, 0, False)[0]
