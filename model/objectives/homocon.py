"""Homologous contrastive loss of MixedAE (Chen et al. 2023, arXiv:2303.17152, section 3).

Patch tokens go through a projection head (2-layer MLP, l2-normalised output). For each anchor
token, positives are the other tokens with the same label (same source image in the same mixed
image); every other token of the local batch is a negative. Supervised-contrastive form (Khosla
et al. 2020, "L_out"), averaged over positives then over anchors:

    L = mean_i  -1/|P(i)| sum_{p in P(i)} log( exp(z_i.z_p / tau) / sum_{a != i} exp(z_i.z_a / tau) )

Memory: the similarity matrix is M x M for M tokens of the local batch (M = mixed images x N),
computed in at least fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ProjectionHead(nn.Module):
    """(..., D) -> (..., out_dim), l2-normalised: Linear -> GELU -> Linear."""

    def __init__(self, dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(self.act(self.fc1(x)))
        return F.normalize(out.to(torch.promote_types(out.dtype, torch.float32)), dim=-1)  # fp16/bf16 -> fp32


def homologous_contrastive_loss(z: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """z (M, d) l2-normalised; labels (M,) long. Anchors without a positive are skipped.
    Leading dimensions are independent sets: z (G, M, d), labels (G, M) contrast each set's tokens
    among themselves only, and the mean is over the anchors of all sets."""
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    M = z.shape[-2]
    self_pair = torch.eye(M, dtype=torch.bool, device=z.device)
    logits = (z @ z.transpose(-1, -2) / temperature).masked_fill(self_pair, float("-inf"))  # (..., M, M)
    log_prob = logits - logits.logsumexp(dim=-1, keepdim=True)
    positive = (labels[..., :, None] == labels[..., None, :]) & ~self_pair
    num_pos = positive.sum(dim=-1)
    per_anchor = -log_prob.masked_fill(~positive, 0.0).sum(dim=-1) / num_pos.clamp_min(1)
    has_pos = (num_pos > 0).to(per_anchor.dtype)
    # a weighted mean, not per_anchor[has_pos]: boolean indexing would wait for the GPU (data-dependent size)
    return (per_anchor * has_pos).sum() / has_pos.sum()
