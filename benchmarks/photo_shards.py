"""ImageNet-like JPEG shards for loader benchmarks, made from any folder of photographs.

    apt-get download mate-backgrounds && dpkg -x mate-backgrounds_*.deb runs/photos   # Debian's wallpapers
    python -m benchmarks.photo_shards runs/photos/usr/share/backgrounds/mate runs/shards/photos --count 2000
    python -m train.bench --loader_only --ds_config ds_configs/cpu_demo.json --data.source shards \\
        --data.train_index runs/shards/photos/train.json --model.name vit_base_patch16 --data.num_workers 2 \\
        --record   # into benchmarks/results/ (without it: runs/bench/)

Each image is a random crop of a source photo, resized to an ImageNet-like size (shorter side
333-500 px, `--short_side` to change, aspect 3:4 to 4:3), with mild Gaussian noise (sigma 5: sensor-like detail, since
wallpapers are smoother than ImageNet's photos) and saved as JPEG quality 95. The defaults give
77 KB per file on average from mate-backgrounds 1.26 (ImageNet-1k train: about 110 KB). Written
as an ImageFolder with 10 classes, then sharded with data/write_shards.py.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import random
from pathlib import Path

import numpy as np
from PIL import Image

from data.write_shards import main as write_shards


PHOTOS_KEPT_DECODED = 64  # at most 64 x 1600 x 1200 x 3 bytes = 369 MB held


def images_folder(out: Path) -> Path:
    """Where the JPEGs go: beside the shards' folder (a shard writer never writes into its input)."""
    return out.with_name(f"{out.name}_images")


def make_images(src: Path, out: Path, count: int, seed: int = 0, noise: float = 5.0, quality: int = 95,
                short_side: tuple[int, int] = (333, 500)) -> list[Path]:
    photos = sorted(p for p in src.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    if not photos:
        raise SystemExit(f"no .jpg/.jpeg/.png photographs under {src}")
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    # a few photos cycled through: each decoded once (decoding a 1600 x 1200 PNG took two thirds of an image's time)
    decoded: dict[Path, Image.Image] = {}
    written = []
    for k in range(count):
        source = photos[k % len(photos)]
        img = decoded.get(source) or Image.open(source).convert("RGB")
        if len(photos) <= PHOTOS_KEPT_DECODED:
            decoded[source] = img
        W, H = img.size
        aspect = rng.uniform(3 / 4, 4 / 3)
        short = rng.randint(*short_side)
        w, h = (round(short * aspect), short) if aspect >= 1 else (short, round(short / aspect))
        # a crop of the output's aspect, between 1:1 pixels and as large as the photo allows
        scale = rng.uniform(min(1.0, max(w / W, h / H)), 1.0)
        cw, ch = min(W, round(w / scale)), min(H, round(h / scale))
        x, y = rng.randint(0, W - cw), rng.randint(0, H - ch)
        pixels = np.asarray(img.crop((x, y, x + cw, y + ch)).resize((w, h), Image.Resampling.BICUBIC), np.float32)
        pixels = (pixels + nrng.normal(0, noise, pixels.shape)).clip(0, 255).astype(np.uint8)
        path = out / f"c{k % 10}" / f"{k:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(path, quality=quality)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="folder of photographs (searched recursively)")
    p.add_argument("out", type=Path, help="output folder: train.json + shards; the JPEGs go beside it, OUT_images/ (ImageFolder)")
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--samples_per_shard", type=int, default=100)
    p.add_argument("--short_side", default="333,500", help="range of the shorter side in px (ImageNet-like default)")
    a = p.parse_args(argv)
    lo, hi = (int(v) for v in a.short_side.split(","))
    files = make_images(a.src, images_folder(a.out), a.count, short_side=(lo, hi))
    sizes = [f.stat().st_size for f in files]
    print(f"{len(files)} JPEGs, mean {np.mean(sizes) / 1024:.0f} KB")
    write_shards(["imagefolder", str(images_folder(a.out)), str(a.out), "--samples_per_shard", str(a.samples_per_shard)])


if __name__ == "__main__":
    main()
