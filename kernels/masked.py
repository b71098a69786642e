"""Restricted attention for mixed inputs (MixedAE, Chen et al. 2023, arXiv:2303.17152, section 3):
plain PyTorch references.

Two ways to restrict which keys a query attends to, both on (B, H, T, d) tensors and passed to
`kernels.attention(..., mask=...)` as a per-call spec:

- `SegmentMask`: query i attends key j only if both come from the same source image
  (segments[i] == segments[j]). A query whose segment is `GLOBAL` (-1, the cls token) attends
  every key; a patch query never sees the cls key, so no information crosses images at all.
- `TopKMask`: each non-global query keeps the keys holding its K largest logits (over all T keys,
  cls included) and sets the rest to -inf before the softmax. The kept set is defined by a
  threshold, logit >= (K-th largest logit of the row), so ties at the threshold are all kept: the
  set is deterministic and a fused kernel that finds the K-th value reproduces it exactly.
  The first `num_global` queries (cls) attend every key. K is an int or one value per query (B, T).

The references materialise the (B, H, T, T) logits in at least fp32 and are twice
differentiable. The fused kernels (kernels/restricted_triton.py) must match them forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GLOBAL = -1  # segment id of queries that attend every key (the cls token)


@dataclass
class SegmentMask:
    segments: torch.Tensor  # (B, T) long: source index per token, GLOBAL for cls


@dataclass
class TopKMask:
    k: int | torch.Tensor  # keys kept per query: an int, or (B, T) long per query row
    num_global: int = 1  # leading query rows (cls) that attend globally
    segments: torch.Tensor | None = None  # (B, T) long; when given, the sampling accuracy is recorded
    # Written by the attention call: share of the kept keys (non-global queries, all heads) that
    # come from the query's own source; a 0-dim fp32 tensor, no gradient.
    same_source_share: torch.Tensor | None = None


def _logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    compute = torch.promote_types(q.dtype, torch.float32)  # fp16/bf16 -> fp32, fp64 stays
    return (q.to(compute) @ k.to(compute).transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, T, T)


def _softmax_av(logits: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    weights = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return (weights @ v.to(logits.dtype)).to(v.dtype)


def segment_allowed(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, 1, T, T) bool: query i may attend key j."""
    same = segments[:, :, None] == segments[:, None, :]
    return (same | (segments == GLOBAL)[:, :, None])[:, None]


def segment_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    return _softmax_av(_logits(q, k), segment_allowed(segments), v)


def segment_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """PyTorch SDPA with a boolean mask (its memory-efficient kernel on GPU; no flash kernel takes a mask)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=segment_allowed(segments))


def per_row_k(k: int | torch.Tensor, B: int, T: int, device: torch.device) -> torch.Tensor:
    """K as a (B, 1, T, 1) long tensor clamped to [1, T]."""
    rows = torch.full((B, T), k, device=device, dtype=torch.long) if isinstance(k, int) else k.to(device).long()
    if rows.shape != (B, T):
        raise ValueError(f"per-query K must have shape (B, T) = {(B, T)}, got {tuple(rows.shape)}")
    return rows.clamp(1, T)[:, None, :, None]


def topk_allowed(logits: torch.Tensor, k: int | torch.Tensor, num_global: int) -> torch.Tensor:
    """logits (B, H, T, T) -> bool (B, H, T, T): logit >= its row's K-th largest; global rows all True."""
    B, _, T, _ = logits.shape
    ks = per_row_k(k, B, T, logits.device)  # (B, 1, T, 1)
    # One K: topk(K). Per-row K: a full sort, so K's maximum need not be read on the host.
    ranked = logits.detach()
    top = ranked.topk(min(max(k, 1), T), dim=-1).values if isinstance(k, int) else ranked.sort(-1, descending=True).values
    threshold = top.gather(-1, (ks - 1).expand(-1, logits.shape[1], -1, -1))  # (B, H, T, 1)
    allowed = logits.detach() >= threshold
    allowed[:, :, :num_global] = True
    return allowed


def same_source_share(allowed: torch.Tensor, segments: torch.Tensor, num_global: int) -> torch.Tensor:
    """Share of kept (query, key) pairs over non-global queries whose key has the query's segment."""
    same = (segments[:, :, None] == segments[:, None, :])[:, None]  # (B, 1, T, T)
    kept = allowed[:, :, num_global:]
    return (kept & same[:, :, num_global:]).sum().float() / kept.sum().clamp_min(1).float()


def topk_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TopKMask) -> torch.Tensor:
    logits = _logits(q, k)
    allowed = topk_allowed(logits, mask.k, mask.num_global)
    if mask.segments is not None:
        with torch.no_grad():
            mask.same_source_share = same_source_share(allowed, mask.segments, mask.num_global)
    return _softmax_av(logits, allowed, v)
