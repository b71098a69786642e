"""Fixed 2-D sine-cosine position embeddings (MAE, Sec. 3 / facebookresearch/mae).

Layout of the D channels, kept identical to the official MAE tables so that released
checkpoints and ours agree: the first D/2 channels encode the column (x) coordinate, the last
D/2 the row (y) coordinate; each half is [sin(pos * w_k), cos(pos * w_k)] with
w_k = 10000^(-k / (D/4)), k = 0..D/4-1. The cls position is all zeros.
"""
from __future__ import annotations

import torch


def sincos_1d(dim: int, pos: torch.Tensor) -> torch.Tensor:
    """pos (M,) float -> (M, dim) = [sin(pos w), cos(pos w)]."""
    if dim % 2:
        raise ValueError(f"1-D sin-cos embedding needs an even dimension, got {dim}")
    omega = torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0)
    omega = 1.0 / 10000**omega  # (dim/2,)
    angles = pos.double()[:, None] * omega[None, :]  # (M, dim/2)
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def sincos_2d_at(dim: int, coords: torch.Tensor) -> torch.Tensor:
    """(..., 2) float (row, col), possibly fractional -> (..., dim) in the layout of `sincos_2d`
    (first half: column, second half: row); differentiable in coords (AdPE's coordinate mode)."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos embedding needs a dimension divisible by 4, got {dim}")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=coords.dtype, device=coords.device) / (dim / 4.0))
    def half(pos: torch.Tensor) -> torch.Tensor:
        angles = pos[..., None] * omega  # (..., dim/4)
        return torch.cat([angles.sin(), angles.cos()], dim=-1)
    return torch.cat([half(coords[..., 1]), half(coords[..., 0])], dim=-1)


def sincos_2d(dim: int, grid_size: tuple[int, int], cls_token: bool = False) -> torch.Tensor:
    """(gh*gw [+1], dim) table for a gh x gw patch grid, row-major over patches."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos embedding needs a dimension divisible by 4, got {dim}")
    gh, gw = grid_size
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")  # (gh, gw)
    emb = torch.cat([sincos_1d(dim // 2, cols.flatten()), sincos_1d(dim // 2, rows.flatten())], dim=1)
    if cls_token:
        emb = torch.cat([torch.zeros(1, dim, dtype=emb.dtype), emb], dim=0)
    return emb.float()


def sincos_segments(dim: int, num_segments: int) -> torch.Tensor:
    """(num_segments, dim) 1-D sin-cos encodings of the source index 0..num_segments-1 (MixedAE)."""
    return sincos_1d(dim, torch.arange(num_segments)).float()
