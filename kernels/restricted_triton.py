"""Fused restricted attention in Triton: homologous TopK and segment-masked, forward and backward.

Same semantics as the references in kernels/masked.py (which the tests compare against):
  TopK:    a non-global query keeps every key whose logit >= its row's K-th largest logit.
  Segment: query i attends key j iff seg[i] == seg[j], or seg[i] == GLOBAL (-1).

Four kernels, each with few live tiles so that nothing spills at the ViT-B/L shape (197 tokens,
head dim 64) and every shape up to MAX_TOKENS x MAX_HEAD_DIM fits the shared memory of sm_80 and
sm_90 (docs/KERNELS.md has the compiled table; tests/kernels/test_compile_gate.py keeps it true):
- `_threshold_kernel` (TopK only): BLOCK_M = 16 query rows against the whole key row held in
  registers, the logits accumulated over head-dim chunks (so only a (row, D_CHUNK) slice of K
  sits in shared memory). The K-th largest logit per row, exactly: logits map to order-preserving
  uint32 keys and the K-th largest key is built bit by bit from the top (radix select, 32 masked
  row counts in registers). Ties at the threshold are all kept, as in the reference. Output: one
  uint32 threshold key per row; the logits never reach global memory. (Why not select over
  streamed key blocks: each of the 32 bit-steps, or 8 steps of 4-bit digits with 15 counts each,
  would recompute Q K^T; one whole-row pass costs one Q K^T.)
- `_fwd_kernel`: FlashAttention-style, keys streamed in BLOCK_N blocks with an online softmax;
  the kept set comes from the saved threshold (TopK) or the segment ids. Saves the row's
  log-sum-exp, and in TopK mode with segments the per-row (kept, same-source) counts.
- `_bwd_dkdv_kernel` (one program per key block, streams query blocks) and `_bwd_dq_kernel` (one
  program per query block, streams key blocks): the FlashAttention-2 split. Every gradient is
  written once by one program: no atomics, deterministic gradients.
Every kernel computes a logit tile with the same function (`_logits`: same head-dim chunks, same
accumulation order, query rows on the MMA's M side), so the kept set is bit-identical in all of
them. The threshold kernel uses the whole row, the others BLOCK_N keys: the logit of one (query,
key) pair is one dot product whose rounding does not depend on the tile's width.

Not twice differentiable: a backward with create_graph=True raises; use the `math` backend for that.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MODE_TOPK = 0
MODE_SEGMENT = 1
MAX_TOKENS = 1024  # the threshold kernel holds a whole key row in registers
MAX_HEAD_DIM = 128  # the largest head dim the compile gate proves (ViT-H/14: 80)
MIN_CAPABILITY = (8, 0)  # A100 and newer; V100 (sm_70) takes the PyTorch path
# Opt-in shared memory per block (bytes), by compute capability, for when no device is at hand.
OPT_IN_SHARED = {(8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376, (9, 0): 232_448}
THRESHOLD_SLICE_BYTES = 64 * 1024  # shared memory for the (row, D_CHUNK) slice of K in the threshold kernel
# Triton's interpreter (TRITON_INTERPRET=1, the CPU parity tests) runs tl.dot as np.matmul, whose
# rounding depends on the tile's shape; the logits must be bit-identical across kernels.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _ordered_key(s):
    """fp32 -> uint32 with the same order (negative floats have their magnitude bits flipped)."""
    bits = s.to(tl.int32, bitcast=True)
    signed = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return signed.to(tl.uint32, bitcast=True) ^ (tl.full(s.shape, 1, tl.uint32) << 31)


@triton.jit
def _logits(Q, K, base, offs_m, offs_n, stride_t, T, D, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, D_CHUNK: tl.constexpr):
    """(BLOCK_M, BLOCK_N) fp32 logits, accumulated over head-dim chunks in a fixed order."""
    s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for c in tl.static_range(0, BLOCK_D, D_CHUNK):
        offs_d = c + tl.arange(0, D_CHUNK)
        q = tl.load(Q + base + offs_m[:, None] * stride_t + offs_d[None, :],
                    mask=(offs_m[:, None] < T) & (offs_d[None, :] < D), other=0.0)
        k = tl.load(K + base + offs_n[:, None] * stride_t + offs_d[None, :],
                    mask=(offs_n[:, None] < T) & (offs_d[None, :] < D), other=0.0)
        if _INTERPRETED:  # np.matmul rounds differently per tile shape; a broadcast sum does not
            s += tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        else:  # MMA / FMA: the same k-ordered chain of instructions for every tile shape
            s = tl.dot(q, tl.trans(k), s, input_precision="ieee")
    return s * scale


@triton.jit
def _kept(s, offs_m, offs_n, T, num_global, thr, seg_q, SEG, MODE: tl.constexpr):
    """Boolean (BLOCK_M, BLOCK_N) kept set from the row's threshold key (TopK) or the segments."""
    valid = (offs_m[:, None] < T) & (offs_n[None, :] < T)
    if MODE == 0:
        keep = (_ordered_key(s) >= thr[:, None]) | (offs_m[:, None] < num_global)
    else:
        seg_k = tl.load(SEG + offs_n, mask=offs_n < T, other=-3)
        keep = (seg_q[:, None] == seg_k[None, :]) | (seg_q[:, None] == -1)
    return keep & valid


@triton.jit
def _threshold_kernel(Q, K, KROW, THR, MASK, SEG, STATS, H, T, D, stride_b, stride_h, stride_t, scale, num_global,
                      WRITE_MASK: tl.constexpr, WITH_STATS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_ROW: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNK: tl.constexpr):
    """THR (B*H*T,) int32 bits of the uint32 key of each row's K-th largest logit. WRITE_MASK: also
    the kept set itself, MASK (B, H, T, T) uint8, from the row already in registers; WITH_STATS:
    STATS (B, H, T, 2) per row (kept keys, kept keys from the query's own source)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_ROW)
    s = _logits(Q, K, b * stride_b + h * stride_h, offs_m, offs_n, stride_t, T, D, scale, BLOCK_M, BLOCK_ROW,
                BLOCK_D, D_CHUNK)
    key = tl.where((offs_n < T)[None, :], _ordered_key(s), 0)  # padded keys 0: below every candidate
    kk = tl.load(KROW + b * T + offs_m, mask=offs_m < T, other=1)
    thr = tl.zeros([BLOCK_M], dtype=tl.uint32)
    for bit in tl.static_range(31, -1, -1):
        cand = thr | (tl.full([BLOCK_M], 1, tl.uint32) << bit)
        count = tl.sum((key >= cand[:, None]).to(tl.int32), axis=1)
        thr = tl.where(count >= kk, cand, thr)
    tl.store(THR + bh * T + offs_m, thr.to(tl.int32, bitcast=True), mask=offs_m < T)
    if WRITE_MASK:  # _kept's TopK rule on the keys already made (calling _kept remakes them from the
        # logits: 18-22 more registers at 197/64 and a spill at 577/64, by the compile sweep)
        row_ok = offs_m < T
        valid = row_ok[:, None] & (offs_n < T)[None, :]
        keep = ((key >= thr[:, None]) | (offs_m[:, None] < num_global)) & valid
        tl.store(MASK + (bh * T + offs_m[:, None]) * T + offs_n[None, :], keep.to(tl.uint8), mask=valid)
        if WITH_STATS:
            seg_q = tl.load(SEG + b * T + offs_m, mask=row_ok, other=-2)
            seg_k = tl.load(SEG + b * T + offs_n, mask=offs_n < T, other=-3)
            row_index = bh * T + offs_m
            tl.store(STATS + row_index * 2, tl.sum(keep.to(tl.int32), axis=1), mask=row_ok)
            tl.store(STATS + row_index * 2 + 1, tl.sum((keep & (seg_q[:, None] == seg_k[None, :])).to(tl.int32),
                                                       axis=1), mask=row_ok)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, THR, SEG, STATS, H, T, D, stride_b, stride_h, stride_t, scale, num_global,
                MODE: tl.constexpr, WITH_STATS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, D_CHUNK: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    base = b * stride_b + h * stride_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    row_index = bh * T + offs_m
    thr = tl.zeros([BLOCK_M], dtype=tl.uint32)
    if MODE == 0:
        thr = tl.load(THR + row_index, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
    seg_q = tl.full([BLOCK_M], -2, dtype=tl.int32)
    if MODE == 1 or WITH_STATS:  # SEG is a 1-element dummy otherwise
        seg_q = tl.load(SEG + b * T + offs_m, mask=row_ok, other=-2)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kept = tl.zeros([BLOCK_M], dtype=tl.int32)
    same = tl.zeros([BLOCK_M], dtype=tl.int32)
    for start_n in range(0, T, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = _logits(Q, K, base, offs_m, offs_n, stride_t, T, D, scale, BLOCK_M, BLOCK_N, BLOCK_D, D_CHUNK)
        keep = _kept(s, offs_m, offs_n, T, num_global, thr, seg_q, SEG + b * T, MODE)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing kept yet stay finite
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])  # (BLOCK_M, BLOCK_N); dropped entries exp(-inf) = 0
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + base + offs_n[:, None] * stride_t + offs_d[None, :],
                    mask=(offs_n[:, None] < T) & (offs_d[None, :] < D), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
        if WITH_STATS:  # per row: kept keys, and kept keys from the query's own source
            seg_k = tl.load(SEG + b * T + offs_n, mask=offs_n < T, other=-3)
            kept += tl.sum(keep.to(tl.int32), axis=1)
            same += tl.sum((keep & (seg_q[:, None] == seg_k[None, :])).to(tl.int32), axis=1)
    l_i = tl.where(row_ok, l_i, 1.0)  # padded rows: keep the arithmetic finite
    m_i = tl.where(row_ok, m_i, 0.0)
    o = acc / l_i[:, None]
    tl.store(O + base + offs_m[:, None] * stride_t + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))
    tl.store(LSE + row_index, m_i + tl.log(l_i), mask=row_ok)
    if WITH_STATS:
        tl.store(STATS + row_index * 2, kept, mask=row_ok)
        tl.store(STATS + row_index * 2 + 1, same, mask=row_ok)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, THR, SEG, DK, DV, H, T, D, stride_b, stride_h, stride_t, scale,
                     num_global, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, D_CHUNK: tl.constexpr):
    """dK, dV of one key block: dV = sum_i P^T dO, dK = scale * sum_i dS^T Q over query blocks i."""
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    base = b * stride_b + h * stride_h
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    key_tile = (offs_n[:, None] < T) & (offs_d[None, :] < D)
    v = tl.load(V + base + offs_n[:, None] * stride_t + offs_d[None, :], mask=key_tile, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for start_m in range(0, T, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < T
        row_index = bh * T + offs_m
        s = _logits(Q, K, base, offs_m, offs_n, stride_t, T, D, scale, BLOCK_M, BLOCK_N, BLOCK_D, D_CHUNK)
        thr = tl.zeros([BLOCK_M], dtype=tl.uint32)
        if MODE == 0:
            thr = tl.load(THR + row_index, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
        seg_q = tl.full([BLOCK_M], -2, dtype=tl.int32)
        if MODE == 1:
            seg_q = tl.load(SEG + b * T + offs_m, mask=row_ok, other=-2)
        keep = _kept(s, offs_m, offs_n, T, num_global, thr, seg_q, SEG + b * T, MODE)
        lse = tl.load(LSE + row_index, mask=row_ok, other=0.0)
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)  # (BLOCK_M, BLOCK_N) fp32
        row_tile = row_ok[:, None] & (offs_d[None, :] < D)
        do = tl.load(DO + base + offs_m[:, None] * stride_t + offs_d[None, :], mask=row_tile, other=0.0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee")
        delta = tl.load(DELTA + row_index, mask=row_ok, other=0.0)  # rowsum(dO * O)
        ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])
        q = tl.load(Q + base + offs_m[:, None] * stride_t + offs_d[None, :], mask=row_tile, other=0.0)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee")
    tl.store(DK + base + offs_n[:, None] * stride_t + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=key_tile)
    tl.store(DV + base + offs_n[:, None] * stride_t + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=key_tile)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, THR, SEG, DQ, H, T, D, stride_b, stride_h, stride_t, scale, num_global,
                   MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   D_CHUNK: tl.constexpr):
    """dQ of one query block: dQ = scale * sum_j dS K over key blocks j."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    base = b * stride_b + h * stride_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    row_index = bh * T + offs_m
    row_tile = row_ok[:, None] & (offs_d[None, :] < D)
    thr = tl.zeros([BLOCK_M], dtype=tl.uint32)
    if MODE == 0:
        thr = tl.load(THR + row_index, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
    seg_q = tl.full([BLOCK_M], -2, dtype=tl.int32)
    if MODE == 1:
        seg_q = tl.load(SEG + b * T + offs_m, mask=row_ok, other=-2)
    lse = tl.load(LSE + row_index, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row_index, mask=row_ok, other=0.0)
    do = tl.load(DO + base + offs_m[:, None] * stride_t + offs_d[None, :], mask=row_tile, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, T, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = _logits(Q, K, base, offs_m, offs_n, stride_t, T, D, scale, BLOCK_M, BLOCK_N, BLOCK_D, D_CHUNK)
        keep = _kept(s, offs_m, offs_n, T, num_global, thr, seg_q, SEG + b * T, MODE)
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        key_tile = (offs_n[:, None] < T) & (offs_d[None, :] < D)
        v = tl.load(V + base + offs_n[:, None] * stride_t + offs_d[None, :], mask=key_tile, other=0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])
        k = tl.load(K + base + offs_n[:, None] * stride_t + offs_d[None, :], mask=key_tile, other=0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
    tl.store(DQ + base + offs_m[:, None] * stride_t + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=row_tile)


@dataclass(frozen=True)
class LaunchPlan:
    """Tile sizes, warps and pipeline stages of the four kernels for one (tokens, head dim, dtype).
    The launcher and the compile gate (kernels/compile_check.py) both read it, so the gate
    compiles exactly what runs."""
    block_d: int  # head dim padded to a power of two
    d_chunk: int  # head-dim slice per logit dot (the same in every kernel: bit-identical logits)
    threshold: tuple[int, int, int]  # (BLOCK_M, BLOCK_ROW, num_warps)
    forward: tuple[int, int, int]  # (BLOCK_M, BLOCK_N, num_warps)
    dkdv: tuple[int, int, int]  # (BLOCK_M streamed query rows, BLOCK_N keys per program, num_warps)
    dq: tuple[int, int, int]  # (BLOCK_M, BLOCK_N streamed keys, num_warps)
    num_stages: int = 1  # no multi-buffered loads: shared memory stays one tile per dot operand

    def shared_bound(self, element_bytes: int) -> int:
        """Upper bound on the shared memory (bytes) of any of the kernels: every dot operand tile
        at once, fp32 staging for the others, plus a row-reduction scratch. The compile gate
        asserts compiled <= bound; supports() compares the bound to the device's limit."""
        e, bd, dc = element_bytes, self.block_d, self.d_chunk
        m, row, _ = self.threshold
        threshold = (m + row) * dc * e + 4 * m * 32
        fm, fn, _ = self.forward
        forward = (fm + fn) * dc * e + fm * fn * e + fn * bd * e + 4 * fm * 32
        bm, bn, _ = self.dkdv
        dkdv = (bm + bn) * dc * e + 2 * bm * bn * e + 3 * bm * bd * e + bn * bd * e
        qm, qn, _ = self.dq
        dq = (qm + qn) * dc * e + qm * qn * e + qm * bd * e + 2 * qn * bd * e
        return max(threshold, forward, dkdv, dq)


@functools.lru_cache(maxsize=None)  # asked by every restricted-attention call (dispatch, launch): no per-call work
def plan(tokens: int, head_dim: int, dtype: torch.dtype) -> LaunchPlan:
    """The launch plan for (B, H, tokens, head_dim) inputs of `dtype` (tile sizes chosen by the
    compiled registers, spills and shared memory in docs/KERNELS.md)."""
    element_bytes = dtype.itemsize
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_row = max(16, triton.next_power_of_2(tokens))
    # fp32 logit dots run on FMA units, which hold their operand slices in registers: a quarter of
    # the slice (head-dim chunks of 16) keeps the threshold kernel from spilling at <= 256 tokens.
    slice_bytes = THRESHOLD_SLICE_BYTES // (4 if element_bytes == 4 else 1)
    d_chunk = block_d
    while d_chunk > 16 and block_row * d_chunk * element_bytes > slice_bytes:
        d_chunk //= 2
    threshold = (16, block_row, 4 if block_row <= 256 and element_bytes < 4 else 8)
    if element_bytes == 4:  # fp32 dots run on FMA units: more registers per tile, so more warps
        fp32 = (32 if block_d <= 64 else 16, 32, 8)
        return LaunchPlan(block_d, d_chunk, threshold, forward=fp32, dkdv=fp32, dq=fp32)
    if block_d <= 64:  # fp16/bf16 on tensor cores. (32, 64, 4) spills 8 B in the fp16 segment forward on
        # sm_90 and dK/dV sits at 255 registers on sm_80: 8 warps there, 32-key blocks for dK/dV.
        return LaunchPlan(block_d, d_chunk, threshold, forward=(32, 64, 8), dkdv=(32, 32, 4), dq=(32, 64, 8))
    return LaunchPlan(block_d, d_chunk, threshold, forward=(32, 32, 4), dkdv=(32, 32, 4), dq=(32, 32, 4))


def shared_limit(capability: tuple[int, int], device: torch.device | None = None) -> int:
    """Opt-in shared memory per block: from the device when there is one, else by capability."""
    if device is not None and device.type == "cuda":
        optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
        if optin:
            return int(optin)
    return OPT_IN_SHARED.get(tuple(capability), min(OPT_IN_SHARED.values()))


def supports(q: torch.Tensor, capability: tuple[int, int] | None = None) -> str | None:
    """None when the fused kernels can run these inputs on a GPU of this compute capability (the
    device of q when not given), else the reason they cannot."""
    T, d = q.shape[-2:]
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} (the kernels take float16, bfloat16, float32)"
    if T > MAX_TOKENS:
        return f"sequence length {T} > {MAX_TOKENS} (the TopK threshold holds a key row on chip)"
    if d > MAX_HEAD_DIM:
        return f"head dim {d} > {MAX_HEAD_DIM}"
    if capability is None:
        if not q.is_cuda:
            return "not on a GPU"
        capability = torch.cuda.get_device_capability(q.device)
    capability = tuple(capability)
    if capability < MIN_CAPABILITY:
        return (f"compute capability sm_{capability[0]}{capability[1]} < sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]} "
                "(the kernels are built and proven for A100/H100)")
    need = plan(T, d, q.dtype).shared_bound(q.element_size())
    limit = shared_limit(capability, q.device if q.is_cuda else None)
    if need > limit:
        return (f"{T} tokens, head dim {d}, {q.dtype} need up to {need} B of shared memory per block; "
                f"sm_{capability[0]}{capability[1]} allows {limit} B")
    return None


def _launch_args(q: torch.Tensor) -> tuple:
    B, H, T, d = q.shape
    return (H, T, d, q.stride(0), q.stride(1), q.stride(2), d**-0.5)


class _RestrictedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mode: int, k_rows, segments, num_global: int, with_stats: bool):
        B, H, T, d = q.shape
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        cfg = plan(T, d, q.dtype)
        o = torch.empty_like(q)
        lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
        thr = torch.zeros(B, H, T, device=q.device, dtype=torch.int32)
        stats = torch.zeros(B, H, T, 2, device=q.device, dtype=torch.int32)
        dummy = torch.zeros(1, device=q.device, dtype=torch.int32)
        seg = segments.to(torch.int32).contiguous() if segments is not None else dummy
        if mode == MODE_TOPK:
            bm, row, warps = cfg.threshold
            _threshold_kernel[(triton.cdiv(T, bm), B * H)](
                q, k, k_rows.to(torch.int32).contiguous(), thr, dummy, dummy, dummy, *_launch_args(q), num_global,
                WRITE_MASK=False, WITH_STATS=False, BLOCK_M=bm, BLOCK_ROW=row, BLOCK_D=cfg.block_d,
                D_CHUNK=cfg.d_chunk, num_warps=warps, num_stages=cfg.num_stages)
        bm, bn, warps = cfg.forward
        _fwd_kernel[(triton.cdiv(T, bm), B * H)](
            q, k, v, o, lse, thr, seg, stats, *_launch_args(q), num_global, MODE=mode, WITH_STATS=with_stats,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=cfg.block_d, D_CHUNK=cfg.d_chunk, num_warps=warps,
            num_stages=cfg.num_stages)
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
        cfg = plan(T, d, q.dtype)
        do = do.contiguous()
        delta = (do.float() * o.float()).sum(-1)  # (B, H, T): rowsum(dO * O)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bm, bn, warps = cfg.dkdv
        _bwd_dkdv_kernel[(triton.cdiv(T, bn), B * H)](
            q, k, v, do, lse, delta, thr, seg, dk, dv, *_launch_args(q), ctx.num_global, MODE=ctx.mode,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=cfg.block_d, D_CHUNK=cfg.d_chunk, num_warps=warps,
            num_stages=cfg.num_stages)
        bm, bn, warps = cfg.dq
        _bwd_dq_kernel[(triton.cdiv(T, bm), B * H)](
            q, k, v, do, lse, delta, thr, seg, dq, *_launch_args(q), ctx.num_global, MODE=ctx.mode,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=cfg.block_d, D_CHUNK=cfg.d_chunk, num_warps=warps,
            num_stages=cfg.num_stages)
        return dq, dk, dv, None, None, None, None, None


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


def topk_mask(q: torch.Tensor, k: torch.Tensor, k_rows: torch.Tensor, num_global: int,
              segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The TopK kept set as a (B, H, T, T) boolean mask, from the threshold kernel (the logits never
    reach memory), and, with segments, the same-source share of kept keys over non-global queries."""
    B, H, T, d = q.shape
    q, k = q.detach().contiguous(), k.detach().contiguous()
    cfg = plan(T, d, q.dtype)
    thr = torch.empty(B, H, T, device=q.device, dtype=torch.int32)
    mask = torch.empty(B, H, T, T, device=q.device, dtype=torch.uint8)
    stats = torch.empty(B, H, T, 2, device=q.device, dtype=torch.int32)
    seg = segments.to(torch.int32).contiguous() if segments is not None else torch.zeros(1, device=q.device,
                                                                                        dtype=torch.int32)
    bm, row, warps = cfg.threshold
    _threshold_kernel[(triton.cdiv(T, bm), B * H)](
        q, k, k_rows.to(torch.int32).contiguous(), thr, mask, seg, stats, *_launch_args(q), num_global,
        WRITE_MASK=True, WITH_STATS=segments is not None, BLOCK_M=bm, BLOCK_ROW=row, BLOCK_D=cfg.block_d,
        D_CHUNK=cfg.d_chunk, num_warps=warps, num_stages=cfg.num_stages)
    share = None
    if segments is not None:
        rows = stats[:, :, num_global:].sum(dim=(0, 1, 2)).float()  # (kept, same)
        share = rows[1] / rows[0].clamp_min(1)
    return mask.view(torch.bool), share


def topk_attention_masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor,
                               num_global: int, segments: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TopK attention in two parts: the kept set as a mask (`topk_mask`, one pass of the logits), then
    PyTorch's SDPA with that boolean mask (its memory-efficient kernel on a GPU), whose backward is
    PyTorch's. The same kept set as `topk_attention`, so the same results; which is faster for a
    shape is measured (tools/choose_attention.py, kernels/bench.py)."""
    mask, share = topk_mask(q, k, k_rows, num_global, segments)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask), share
