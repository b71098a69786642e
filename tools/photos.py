"""Procedural stand-ins for photographs, for benchmarks/photo_shards.py on a machine with no
photographs and no network (the GPU machine): smooth colour fields with a few sharp-edged shapes
and fine texture, so JPEG sizes and decode cost resemble camera pictures rather than flat
images (which decode far faster) or pure noise (far slower, far larger).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    # low-frequency colour field: 6x8 random colours upsampled bicubically
    coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    img = Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(6, 14))):  # objects: ellipses and polygons with hard edges
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        r = int(rng.integers(width // 20, width // 5))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse((x - r, y - r, x + r, y + r), fill=colour)
        else:
            pts = [(x + int(rng.integers(-r, r)), y + int(rng.integers(-r, r))) for _ in range(5)]
            draw.polygon(pts, fill=colour)
    img = img.filter(ImageFilter.GaussianBlur(1.0))
    # texture at a few scales (grass, fabric, foliage-like detail), then JPEG-friendly clipping
    pixels = np.asarray(img, np.float32)
    for scale, amp in ((4, 18.0), (1, 8.0)):
        small = rng.normal(0, amp, (height // scale + 1, width // scale + 1, 1)).astype(np.float32)
        pixels += np.repeat(np.repeat(small, scale, 0), scale, 1)[:height, :width]
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def write_photos(out: Path, count: int, size: tuple[int, int] = (1600, 1200), seed: int = 0) -> list[Path]:
    """`count` PNG files of `size` (width, height) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for k in range(count):
        path = out / f"photo_{k:03d}.png"
        photo(rng, *size).save(path, compress_level=1)
        paths.append(path)
    return paths
