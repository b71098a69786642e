"""Image corruptions of energy-based pretraining (Wang et al. 2023, arXiv:2302.01384, appendix A.2-A.3).

Each takes a batch (B, C, H, W) in the model's normalised pixel space and returns the corrupted
batch, drawing its randomness per sample from `generator` (the global torch RNG when None, which
the training loop seeds per rank and checkpoints). All run on the batch's device. "Blank" means
0 in normalised space, i.e. the dataset mean colour (as MAE's removed patches).

  grid         image cut into cells of `cell` px, a share `ratio` of them blanked per sample
  blank_small  75 rectangles per sample, each U(0.01, 0.025) of the image area
  blank_large  25 rectangles per sample, each U(0.5, 2.0) / 25 of the image area
  sr           bicubic down by `scale`, nearest up (super-resolution s x)
  denoise      sqrt(g) x + sqrt(1 - g) eps, g ~ U(0, 1) per sample, eps ~ N(0, I)
  colorize     the luminance (ITU-R 601) replicated over the channels (needs RGB)
  mixture      each sample from one corruption of `parts`, chosen uniformly per sample

The paper gives the large blanks' "normalized sizes" as U(0.5, 2.0) without the unit; reading
them as fractions of 1/25 of the area **[project interpretation]** makes 25 large blanks cover
about as much (~70% expected) as the 75 small ones. Rectangle aspect ratios are log-uniform in
(1/2, 2) **[project default]**.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from model.constants import IMAGENET_MEAN, IMAGENET_STD, device_constant

Generator = torch.Generator | None


def _rand(shape, like: torch.Tensor, generator: Generator) -> torch.Tensor:
    return torch.rand(shape, generator=generator, device=like.device)


def grid_mask(x: torch.Tensor, cell: int, ratio: float, generator: Generator = None) -> torch.Tensor:
    """Blank round(ratio * cells) whole cells of `cell` px per sample (cells tile the image)."""
    B, C, H, W = x.shape
    if H % cell or W % cell:
        raise ValueError(f"grid cells of {cell} px do not tile a {H}x{W} image; choose a divisor")
    gh, gw = H // cell, W // cell
    n = gh * gw
    blank = round(ratio * n)
    order = _rand((B, n), x, generator).argsort(dim=1)  # a random permutation of the cells per sample
    cells = torch.zeros(B, n, device=x.device, dtype=torch.bool)
    cells.scatter_(1, order[:, :blank], True)  # (B, n): True = blanked
    keep = ~cells.view(B, 1, gh, 1, gw, 1).expand(B, 1, gh, cell, gw, cell).reshape(B, 1, H, W)
    return x * keep


def random_blanks(x: torch.Tensor, count: int, area: tuple[float, float], generator: Generator = None) -> torch.Tensor:
    """Blank `count` axis-aligned rectangles per sample; each covers U(area) of the image with a
    log-uniform aspect ratio in (1/2, 2), placed uniformly (clipped at the border)."""
    B, C, H, W = x.shape
    u = _rand((B, count, 4), x, generator)
    frac = area[0] + (area[1] - area[0]) * u[..., 0]  # (B, count) share of the image
    aspect = torch.exp((2 * u[..., 1] - 1) * math.log(2.0))  # w / h
    h = (frac * H * W / aspect).sqrt().clamp(max=H)  # (B, count) pixels
    w = (frac * H * W * aspect).sqrt().clamp(max=W)
    top = u[..., 2] * (H - h)
    left = u[..., 3] * (W - w)
    rows = torch.arange(H, device=x.device, dtype=h.dtype)[None, None, :]  # (1, 1, H)
    cols = torch.arange(W, device=x.device, dtype=w.dtype)[None, None, :]
    in_rows = (rows >= top[..., None]) & (rows < (top + h)[..., None])  # (B, count, H)
    in_cols = (cols >= left[..., None]) & (cols < (left + w)[..., None])  # (B, count, W)
    covered = torch.zeros(B, H, W, dtype=torch.bool, device=x.device)
    for i in range(count):  # one (B, H, W) map at a time rather than (B, count, H, W)
        covered |= in_rows[:, i, :, None] & in_cols[:, i, None, :]
    return x * ~covered[:, None]


def super_resolution(x: torch.Tensor, scale: int, generator: Generator = None) -> torch.Tensor:
    """Bicubic downsampling by `scale`, nearest-neighbour upsampling back (A.2)."""
    B, C, H, W = x.shape
    if H % scale or W % scale:
        raise ValueError(f"super-resolution x{scale} does not divide a {H}x{W} image; choose a divisor")
    low = F.interpolate(x.float(), size=(H // scale, W // scale), mode="bicubic", align_corners=False)
    return F.interpolate(low, size=(H, W), mode="nearest").to(x.dtype)


def denoise(x: torch.Tensor, generator: Generator = None) -> torch.Tensor:
    """sqrt(g) x + sqrt(1 - g) eps with g ~ U(0, 1) per sample and eps ~ N(0, I) (A.2)."""
    g = _rand((x.shape[0], 1, 1, 1), x, generator).to(x.dtype)
    eps = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return g.sqrt() * x + (1 - g).sqrt() * eps


def colorize(x: torch.Tensor, generator: Generator = None) -> torch.Tensor:
    """Grayscale input: 0.299 R + 0.587 G + 0.114 B of the unnormalised pixels, on every channel."""
    if x.shape[1] != 3:
        raise ValueError(f"colorization needs RGB input, got {x.shape[1]} channels")
    mean = device_constant(IMAGENET_MEAN, x.device, x.dtype)[:, None, None]
    std = device_constant(IMAGENET_STD, x.device, x.dtype)[:, None, None]
    rgb = x * std + mean
    luma = (0.299 * rgb[:, 0] + 0.587 * rgb[:, 1] + 0.114 * rgb[:, 2])[:, None]  # (B, 1, H, W)
    return (luma - mean) / std


def mixture(x: torch.Tensor, parts: dict[str, Callable], generator: Generator = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample corrupted by one of `parts`, chosen uniformly per sample. Every part runs on the
    whole batch (simple, no data-dependent shapes); returns (corrupted, choice index (B,))."""
    names = list(parts)
    choice = (_rand((x.shape[0],), x, generator) * len(names)).long().clamp(max=len(names) - 1)
    out = x
    for i, name in enumerate(names):
        out = torch.where((choice == i)[:, None, None, None], parts[name](x, generator=generator), out)
    return out, choice
