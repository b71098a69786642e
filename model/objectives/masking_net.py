"""MLO-MAE's learned masking (Guo et al. 2024, arXiv:2402.18128, section 3.2, appendix B.2): the masking network, the hard
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


SATURATED = 0.01  # p below this or above 1 - this: the sigmoid's slope p(1-p) is under 1% of its peak


@torch.no_grad()
def mask_statistics(probs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """What T has learned, from its probabilities and the top-k mask, both (B, N); logged every step.

    mask_prob_mean     mean p
    mask_prob_masked   mean p over the masked patches (their weight in the level-I loss)
    mask_prob_saturated  share of p within SATURATED of 0 or 1: a saturated T passes almost no
                       hypergradient, and a masked patch with p ~ 0 adds nothing to the level-I loss
    mask_prob_spread   std over the batch of each patch's p, averaged over patches: 0 when T gives
                       every image the same probabilities (an image-independent mask)
    """
    probs = probs.float()
    saturated = (probs < SATURATED) | (probs > 1 - SATURATED)
    spread = probs.std(0, correction=0).mean() if probs.shape[0] > 1 else probs.new_zeros(())
    return {"mask_prob_mean": probs.mean(), "mask_prob_masked": (probs * mask).sum() / mask.sum(),
            "mask_prob_saturated": saturated.float().mean(), "mask_prob_spread": spread}


def weighted_recon_loss(per_patch: torch.Tensor, mask: torch.Tensor, probs: torch.Tensor,
                        straight_through: bool) -> torch.Tensor:
    """per_patch, mask, probs (B, N) -> sum_j w_j l_j / #masked, w = m * p, or m + p - sg(p)."""
    weights = mask + probs - probs.detach() if straight_through else mask * probs
    return (weights * per_patch).sum() / mask.sum()
