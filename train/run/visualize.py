"""PNG figures for the run folder: the objective's own image rows (e.g. MAE reconstructions) and
attention maps of the last encoder block's cls query. Written by rank 0 every `run.vis_every`
steps on a fixed set of images, to <run>/vis/<name>_step<N>.png."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from data.transforms import IMAGENET_MEAN, IMAGENET_STD
from model.objectives.base import Objective
from model.vit import VisionTransformer

PAD = 2  # pixels between tiles
MIN_TILE = 96  # small images are enlarged (nearest) to at least this many pixels


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, C, H, W) ImageNet-normalised -> (B, H, W, 3) uint8 (1-channel images are replicated)."""
    x = images.detach().float().cpu()
    if x.shape[1] == 3:
        x = x * torch.tensor(IMAGENET_STD)[:, None, None] + torch.tensor(IMAGENET_MEAN)[:, None, None]
    else:
        x = (x - x.amin()) / (x.amax() - x.amin() + 1e-6)
        x = x.expand(-1, 3, -1, -1)
    return (x.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).numpy()


def grid(rows: list[np.ndarray]) -> Image.Image:
    """rows of (B, H, W, 3) uint8 -> one image with a tile per (row, column)."""
    n_rows, (B, H, W, _) = len(rows), rows[0].shape
    scale = max(1, -(-MIN_TILE // H))
    h, w = H * scale, W * scale
    canvas = np.full((PAD + n_rows * (h + PAD), PAD + B * (w + PAD), 3), 255, dtype=np.uint8)
    for r, row in enumerate(rows):
        for b in range(B):
            tile = row[b].repeat(scale, axis=0).repeat(scale, axis=1)
            y, x = PAD + r * (h + PAD), PAD + b * (w + PAD)
            canvas[y : y + h, x : x + w] = tile
    return Image.fromarray(canvas)


@torch.no_grad()
def cls_attention(encoder, images: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, gh, gw): the last block's cls-query attention over patches, mean over heads."""
    x = encoder.add_cls_token(encoder.embed_patches(images))
    for block in encoder.blocks[:-1]:
        x = block(x)
    attn = encoder.blocks[-1].attn
    B, T, D = x.shape
    qkv = attn.qkv(encoder.blocks[-1].norm1(x)).reshape(B, T, 3, attn.num_heads, D // attn.num_heads)
    q, k = qkv[:, :1, 0].transpose(1, 2).float(), qkv[:, :, 1].transpose(1, 2).float()  # (B, H, 1, d), (B, H, T, d)
    weights = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1)  # (B, H, 1, T)
    return weights[:, :, 0, 1:].mean(1).reshape(B, *encoder.patch_embed.grid_size)


def heat_overlay(images: np.ndarray, heat: torch.Tensor) -> np.ndarray:
    """Blend a per-patch heat map (B, gh, gw), scaled to [0, 1] per image, over (B, H, W, 3) images."""
    B, H, W, _ = images.shape
    h = heat.float().cpu()
    h = (h - h.amin((1, 2), keepdim=True)) / (h.amax((1, 2), keepdim=True) - h.amin((1, 2), keepdim=True) + 1e-8)
    h = torch.nn.functional.interpolate(h[:, None], size=(H, W), mode="nearest")[:, 0].numpy()[..., None]
    color = np.concatenate([np.clip(2 * h, 0, 1), np.clip(2 * h - 1, 0, 1), 0.2 * (1 - h)], axis=-1) * 255
    return (0.5 * images + 0.5 * color).astype(np.uint8)


def write_figures(objective: Objective, images: torch.Tensor, noise: torch.Tensor, out_dir: Path, step: int) -> list[Path]:
    """Every figure for one step; returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figures: dict[str, list[np.ndarray]] = {}
    for name, rows in objective.visualizations(images, noise).items():
        figures[name] = [to_uint8(r) for r in rows]
    if isinstance(objective.encoder, VisionTransformer):  # our ViT (a timm ViT has blocks too, but not our cls API)
        pictures = to_uint8(images)
        figures["cls_attention"] = [pictures, heat_overlay(pictures, cls_attention(objective.encoder, images))]
    paths = []
    for name, rows in figures.items():
        path = out_dir / f"{name}_step{step:08d}.png"
        grid(rows).save(path)
        paths.append(path)
    return paths
