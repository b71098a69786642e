"""MLO-MAE's learned masking (mlo_mae.txt Section 3.2, Appendix B.2): the masking network, the hard
top-k mask it induces, and the probability-weighted reconstruction loss that is its only link to
the loss."""
from __future__ import annotations

import torch
from torch import nn

from model.objectives.masking import Masking, masking_from_noise, num_kept


class MaskingNetwork(nn.Module):
    """(B, N, D) patch embeddings -> (B, N) masking probabilities (Appendix B.2)."""

    def __init__(self, num_patches: int, dim: int, hidden: int = 512):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(1), nn.Linear(num_patches * dim, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_patches))
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(tokens))


def top_masking(probs: torch.Tensor, mask_ratio: float) -> Masking:
    """Mask the N*ratio patches with the highest probability (keep the lowest); stable on ties."""
    return masking_from_noise(probs.detach(), num_kept(probs.shape[1], mask_ratio))


def weighted_recon_loss(per_patch: torch.Tensor, mask: torch.Tensor, probs: torch.Tensor,
                        straight_through: bool) -> torch.Tensor:
    """per_patch, mask, probs (B, N) -> sum_j w_j l_j / #masked, w = m * p, or m + p - sg(p)."""
    weights = mask + probs - probs.detach() if straight_through else mask * probs
    return (weights * per_patch).sum() / mask.sum()
