"""Pixel <-> patch layout shared by reconstruction objectives (MAE's order: channel last)."""
from __future__ import annotations

import torch


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, p*p*C), patches row-major, each patch flattened as (p, p, C)."""
    B, C, H, W = images.shape
    p = patch_size
    h, w = H // p, W // p
    x = images.reshape(B, C, h, p, w, p)
    return torch.einsum("nchpwq->nhwpqc", x).reshape(B, h * w, p * p * C)


def unpatchify(patches: torch.Tensor, patch_size: int, grid_size: tuple[int, int], chans: int) -> torch.Tensor:
    """(B, N, p*p*C) -> (B, C, H, W); inverse of `patchify`."""
    B = patches.shape[0]
    p, (h, w) = patch_size, grid_size
    x = patches.reshape(B, h, w, p, p, chans)
    return torch.einsum("nhwpqc->nchpwq", x).reshape(B, chans, h * p, w * p)


def normalized_pixels(target: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-patch normalisation (t - mean) / sqrt(unbiased var + eps) over the last axis."""
    mean = target.mean(dim=-1, keepdim=True)
    var = target.var(dim=-1, keepdim=True, unbiased=True)
    return (target - mean) / (var + eps) ** 0.5
