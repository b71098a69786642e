"""Write webdataset .tar shards with an index.

    python -m data.write_shards imagefolder SRC_DIR OUT_DIR --name train [--samples_per_shard 1000]
    python -m data.write_shards fashion-mnist OUT_DIR [--src /usr/share/datasets/fashion-mnist]

Each sample is `<key>.jpg` or `<key>.png` (the original encoded bytes; other decodable formats
are re-encoded to PNG) plus `<key>.cls` (the class index as text). Samples are shuffled with a
fixed seed before sharding, so every shard mixes classes. Shards are named
`<name>-000000.tar ...` and described by `<name>.json`:
    {"name", "pattern": "<name>-{000000..000009}.tar", "shards": [{"file", "samples"}],
     "num_samples", "classes": [...], "rejected": {"count", "examples"}}
Each shard is written under a temporary name and renamed when complete; the index is written last.

Bad input is never silently dropped: a missing directory or an empty class folder is an error,
and files that cannot be read or decoded as images are counted and listed; the writer stops
unless `--skip_bad` is given, in which case the index records them.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ["t-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                         "ankle boot"]


class ShardError(ValueError):
    """Input that cannot be turned into a complete shard set."""


@dataclass
class Sample:
    data: bytes
    ext: str  # "jpg" | "png"
    label: int


@dataclass
class Rejected:
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, path: Path, why: str) -> None:
        self.count += 1
        if len(self.examples) < 20:
            self.examples.append(f"{path}: {why}")


def encode_image_file(path: Path) -> tuple[bytes, str]:
    """Read a file and check that it decodes; JPEG/PNG bytes are kept as they are."""
    data = path.read_bytes()
    with Image.open(io.BytesIO(data)) as img:
        img.load()  # full decode: truncated files fail here, not at training time
        fmt = img.format
        if fmt == "JPEG":
            return data, "jpg"
        if fmt == "PNG":
            return data, "png"
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue(), "png"


def scan_imagefolder(src: Path) -> tuple[list[str], list[Sample], Rejected]:
    if not src.is_dir():
        raise ShardError(f"source directory {src} does not exist (expected class sub-folders of images)")
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    if not classes:
        raise ShardError(f"{src} has no class sub-folders; expected SRC/<class>/<image files>")
    empty = [c for c in classes if not any(f.is_file() for f in (src / c).rglob("*"))]
    if empty:
        raise ShardError(f"{len(empty)} empty class folder(s) in {src}: {empty[:10]}; remove them or add images")
    samples, rejected = [], Rejected()
    for label, c in enumerate(classes):
        for f in sorted(p for p in (src / c).rglob("*") if p.is_file()):
            try:
                data, ext = encode_image_file(f)
            except OSError as e:  # PIL raises OSError subclasses for undecodable data too
                rejected.add(f, f"{type(e).__name__}: {e}")
                continue
            samples.append(Sample(data, ext, label))
    return classes, samples, rejected


def read_idx(path: Path) -> np.ndarray:
    """An MNIST-style idx file (optionally gzipped) as a uint8 array."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != 0x08:
        raise ShardError(f"{path} is not an idx file of unsigned bytes")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ShardError(f"{path} is truncated: expected {int(np.prod(shape))} values, found {body.size}")
    return body.reshape(shape)


def _find(src: Path, stem: str) -> Path:
    for name in (stem, f"{stem}.gz"):
        if (src / name).is_file():
            return src / name
    raise ShardError(
        f"{src / stem}(.gz) not found. Install the Debian package: apt-get install dataset-fashion-mnist "
        f"(puts the idx files in {FASHION_MNIST_DIR})"
    )


def fashion_mnist_samples(src: Path, split: str) -> list[Sample]:
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(_find(src, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(_find(src, f"{prefix}-labels-idx1-ubyte"))
    if len(images) != len(labels):
        raise ShardError(f"{split}: {len(images)} images but {len(labels)} labels")
    out = []
    for img, label in zip(images, labels, strict=True):
        buf = io.BytesIO()
        Image.fromarray(img, mode="L").save(buf, format="PNG")
        out.append(Sample(buf.getvalue(), "png", int(label)))
    return out


def write_shards(samples: list[Sample], out_dir: Path, name: str, classes: list[str], samples_per_shard: int,
                 seed: int = 0, rejected: Rejected | None = None) -> dict:
    if not samples:
        raise ShardError(f"no samples to write for {name!r}")
    if samples_per_shard < 1:
        raise ShardError("samples_per_shard must be >= 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    num_shards = (len(order) + samples_per_shard - 1) // samples_per_shard
    shards = []
    for s in range(num_shards):
        file = f"{name}-{s:06d}.tar"
        tmp = out_dir / f".{file}.tmp"
        ids = order[s * samples_per_shard : (s + 1) * samples_per_shard]
        with wds.TarWriter(str(tmp)) as sink:
            for i in ids:
                smp = samples[i]
                sink.write({"__key__": f"{name}_{i:08d}", smp.ext: smp.data, "cls": str(smp.label).encode()})
        os.replace(tmp, out_dir / file)
        shards.append({"file": file, "samples": len(ids)})
    rejected = rejected or Rejected()
    index = {
        "name": name,
        "pattern": f"{name}-{{000000..{num_shards - 1:06d}}}.tar",
        "shards": shards,
        "num_samples": len(samples),
        "classes": classes,
        "rejected": {"count": rejected.count, "examples": rejected.examples},
    }
    (out_dir / f"{name}.json").write_text(json.dumps(index, indent=1))
    return index


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    folder = sub.add_parser("imagefolder", help="class sub-folders of JPEG/PNG files")
    folder.add_argument("src", type=Path, help="the image folder: one sub-folder per class")
    folder.add_argument("out", type=Path, help="output folder of the shards and their <name>.json index")
    folder.add_argument("--name", default="train", help="shard and index name (default %(default)s)")
    folder.add_argument("--skip_bad", action="store_true", help="write the readable files, record the rest")
    fm = sub.add_parser("fashion-mnist", help="the idx files of the Debian package dataset-fashion-mnist")
    fm.add_argument("out", type=Path, help="output folder of train.json / test.json and their shards")
    fm.add_argument("--src", type=Path, default=FASHION_MNIST_DIR, help="the idx files (default %(default)s)")
    for p in (folder, fm):
        p.add_argument("--samples_per_shard", type=int, default=1000, help="samples per .tar (default %(default)s)")
        p.add_argument("--seed", type=int, default=0, help="seed of the sample order (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.kind == "imagefolder":
            classes, samples, rejected = scan_imagefolder(args.src)
            if rejected.count and not args.skip_bad:
                raise ShardError(
                    f"{rejected.count} of {rejected.count + len(samples)} files are unreadable or not images, e.g. "
                    f"{rejected.examples[:5]}; fix or remove them, or pass --skip_bad to write the other "
                    f"{len(samples)} and record these in the index"
                )
            indexes = [write_shards(samples, args.out, args.name, classes, args.samples_per_shard, args.seed, rejected)]
        else:
            indexes = [write_shards(fashion_mnist_samples(args.src, split), args.out, split, FASHION_MNIST_CLASSES,
                                    args.samples_per_shard, args.seed) for split in ("train", "test")]
    except ShardError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for idx in indexes:
        print(f"{idx['name']}: {idx['num_samples']} samples in {len(idx['shards'])} shards ({idx['pattern']}), "
              f"{idx['rejected']['count']} rejected")
    return indexes


if __name__ == "__main__":
    main()
