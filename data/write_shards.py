"""Write webdataset .tar shards with an index, with N worker processes.

    python -m data.write_shards imagefolder SRC_DIR OUT_DIR --name train [--samples_per_shard 1000]
    python -m data.write_shards imagenet ROOT OUT_DIR [--split train|val|both] [--val_labels LOC_val_solution.csv]
    python -m data.write_shards fashion-mnist OUT_DIR [--src /usr/share/datasets/fashion-mnist]

Each sample is `<key>.jpg` or `<key>.png` (the original encoded bytes; other decodable formats
are re-encoded to PNG) plus `<key>.cls` (the class index as text). Samples are shuffled with a
fixed seed before sharding, so every shard mixes classes. Shards are named
`<name>-000000.tar ...` and described by `<name>.json`:
    {"name", "pattern": "<name>-{000000..000009}.tar", "shards": [{"file", "samples"}],
     "num_samples", "classes": [...], "rejected": {"count", "examples"}}

`--workers N` processes (default: every core of this process's CPU affinity) each read, check and
write whole shards, given the already shuffled order; tar members carry a fixed mtime, user and
mode, so the shards and the index are byte-identical for the same input and seed whatever N.
Shards are written under temporary names and renamed when all are complete; the index comes last.

ImageNet (`imagenet ROOT`): `ROOT/train/<wnid>/*.JPEG`, and `ROOT/val/<wnid>/*.JPEG` or a flat
`ROOT/val/*.JPEG` labelled by the Kaggle release's LOC_val_solution.csv (ImageId, PredictionString
starting with the wnid; found in ROOT or up to three folders above, or given by --val_labels).
Labels index the sorted wnids of ROOT/train (or of --classes_from), which for all 1000 classes is
the order timm and torchvision use (ImageFolder sorts folder names), so labels are their
ImageNet-1k class indices.

Bad input is never silently dropped: a missing directory or an empty class folder is an error,
and files that cannot be read or decoded as images are counted and listed; the writer stops
unless `--skip_bad` is given, in which case the index records them.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import os
import random
import re
import struct
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from data.faults import Tally

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ["t-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                         "ankle boot"]
WNID = re.compile(r"n\d{8}")  # a WordNet noun id, ImageNet's class folder names
IMAGENET_1K = 1000
LOC_VAL_SOLUTION = "LOC_val_solution.csv"
TAR_MTIME = 0  # webdataset's TarWriter stamps members with time.time() unless told: fixed for identical shards


class ShardError(ValueError):
    """Input that cannot be turned into a complete shard set."""


@dataclass
class Sample:
    """An encoded image held in memory (Fashion-MNIST, tests): written as it is, unchecked."""
    data: bytes
    ext: str  # "jpg" | "png"
    label: int


@dataclass(frozen=True)
class ImageFile:
    """An image on disk: read and checked by the worker that writes its shard."""
    path: Path
    label: int




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


def folder_classes(src: Path) -> list[str]:
    """Sorted sub-folder names: the class order of torchvision's ImageFolder (and so of timm)."""
    if not src.is_dir():
        raise ShardError(f"source directory {src} does not exist (expected class sub-folders of images)")
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    if not classes:
        raise ShardError(f"{src} has no class sub-folders; expected SRC/<class>/<image files>")
    return classes


def list_imagefolder(src: Path, classes: list[str] | None = None) -> tuple[list[str], list[ImageFile]]:
    """Every file under SRC/<class>/ with its class index; `classes` (default: the folder's own,
    sorted) fixes the indices, and a sub-folder outside it is an error. Files are checked when
    their shard is written."""
    present = folder_classes(src)
    classes = present if classes is None else classes
    unknown = sorted(set(present) - set(classes))
    if unknown:
        raise ShardError(f"{len(unknown)} class folder(s) of {src} are not among the {len(classes)} classes "
                         f"given ({classes[0]} ... {classes[-1]}), e.g. {unknown[:5]}: they have no "
                         f"class index")
    empty = [c for c in present if not any(f.is_file() for f in (src / c).rglob("*"))]
    if empty:
        raise ShardError(f"{len(empty)} empty class folder(s) in {src}: {empty[:10]}; remove them or add images")
    index = {c: i for i, c in enumerate(classes)}
    files = [ImageFile(f, index[c]) for c in present for f in sorted(p for p in (src / c).rglob("*") if p.is_file())]
    return classes, files


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


# ---- ImageNet layouts ----

def imagenet_classes(root: Path, classes_from: Path | None) -> list[str]:
    """Sorted wnids of ROOT/train (or of `classes_from`: a folder of wnid folders, or a shard index
    whose "classes" it takes). Indices are ImageNet-1k's (timm / torchvision) only with all 1000."""
    src = classes_from or root / "train"
    if src.suffix == ".json":
        if not src.is_file():
            raise ShardError(f"--classes_from {src}: no such shard index")
        classes = json.loads(src.read_text()).get("classes")
        if not isinstance(classes, list) or not classes:
            raise ShardError(f"--classes_from {src}: the index has no 'classes' list")
    else:
        classes = folder_classes(src)
    not_wnids = [c for c in classes if not WNID.fullmatch(c)]
    if not_wnids:
        raise ShardError(f"{len(not_wnids)} of the {len(classes)} classes of {src} are not WordNet ids (n + 8 "
                         f"digits), e.g. {not_wnids[:5]}; for other class names use the imagefolder subcommand")
    if len(classes) != IMAGENET_1K:
        print(f"warning: {src} gives {len(classes)} classes, not ImageNet-1k's {IMAGENET_1K}: labels index these "
              f"{len(classes)} sorted wnids and do not match timm / torchvision's ImageNet-1k class indices",
              file=sys.stderr)
    return classes


def find_val_labels(root: Path) -> Path | None:
    """LOC_val_solution.csv in ROOT or up to three folders above (the Kaggle release keeps it
    beside ILSVRC/, and ROOT is then ILSVRC/Data/CLS-LOC)."""
    for folder in [root, *list(root.resolve().parents)[:3]]:
        if (folder / LOC_VAL_SOLUTION).is_file():
            return folder / LOC_VAL_SOLUTION
    return None


def read_loc_val_solution(path: Path) -> dict[str, str]:
    """ImageId -> wnid, the first word of PredictionString ("n01751748 33 90 466 324 ...")."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not {"ImageId", "PredictionString"} <= set(reader.fieldnames or []):
            raise ShardError(f"{path}: expected the columns ImageId,PredictionString (Kaggle's {LOC_VAL_SOLUTION}), "
                             f"found {reader.fieldnames}")
        labels = {}
        for row in reader:
            words = (row["PredictionString"] or "").split()
            if not words:
                raise ShardError(f"{path}: line {reader.line_num} has no wnid: {row}")
            labels[row["ImageId"]] = words[0]
    return labels


def imagenet_val(val: Path, classes: list[str], val_labels: Path | None, root: Path) -> list[ImageFile]:
    if not val.is_dir():
        raise ShardError(f"{val} does not exist (pass --split train to write the training split only)")
    if any(p.is_dir() for p in val.iterdir()):  # val/<wnid>/*.JPEG, e.g. after the devkit's valprep.sh
        return list_imagefolder(val, classes)[1]
    val_labels = val_labels or find_val_labels(root)
    if val_labels is None:
        raise ShardError(f"{val} holds images but no <wnid> folders, and no {LOC_VAL_SOLUTION} was found in {root} "
                         f"or the three folders above it; pass --val_labels PATH/{LOC_VAL_SOLUTION} (Kaggle's "
                         f"ImageNet release) or move the images into val/<wnid>/ folders (the devkit's "
                         f"ILSVRC2012_validation_ground_truth.txt numbers classes in its own order, not read here)")
    labels = read_loc_val_solution(val_labels)
    index = {c: i for i, c in enumerate(classes)}
    files, unlabelled, unknown = [], [], []
    for f in sorted(p for p in val.iterdir() if p.is_file()):
        wnid = labels.get(f.stem)
        if wnid is None:
            unlabelled.append(f.name)
        elif wnid not in index:
            unknown.append(f"{f.name}: {wnid}")
        else:
            files.append(ImageFile(f, index[wnid]))
    if unlabelled:
        raise ShardError(f"{len(unlabelled)} file(s) in {val} have no row in {val_labels}, e.g. {unlabelled[:5]}")
    if unknown:
        raise ShardError(f"{len(unknown)} image(s) in {val} are labelled (by {val_labels}) with wnids that are not "
                         f"among the {len(classes)} training classes, e.g. {unknown[:5]}; write val with the class "
                         f"list of the training split that has them (--classes_from)")
    if not files:
        raise ShardError(f"{val} holds no images")
    if len(files) < len(labels):
        print(f"note: {len(labels) - len(files)} of the {len(labels)} images that {val_labels} lists are not in {val}",
              file=sys.stderr)
    return files


# ---- writing ----

@dataclass
class ShardJob:
    path: Path  # the temporary file
    samples: list[tuple[str, Sample | ImageFile]]  # (key, sample) in the shuffled order


def write_one_shard(job: ShardJob) -> tuple[int, Tally]:
    """One shard, in whichever process runs it: returns (samples written, files rejected)."""
    written, rejected = 0, Tally()
    with wds.TarWriter(str(job.path), mtime=TAR_MTIME) as sink:  # user/group/mode: TarWriter's fixed defaults
        for key, smp in job.samples:
            if isinstance(smp, ImageFile):
                try:
                    data, ext = encode_image_file(smp.path)
                except OSError as e:  # PIL raises OSError subclasses for undecodable data too
                    rejected.add(smp.path, f"{type(e).__name__}: {e}")
                    continue
            else:
                data, ext = smp.data, smp.ext
            sink.write({"__key__": key, ext: data, "cls": str(smp.label).encode()})
            written += 1
    return written, rejected


def default_workers() -> int:
    return len(os.sched_getaffinity(0))


def write_shards(samples: list[Sample | ImageFile], out_dir: Path, name: str, classes: list[str],
                 samples_per_shard: int, seed: int = 0, workers: int = 1, skip_bad: bool = False) -> dict:
    """Shuffle with `seed`, cut into shards of `samples_per_shard`, write them with `workers`
    processes. Rejected files (ImageFile only) stop the writer unless `skip_bad`; then the shards
    they leave empty are dropped and the rest numbered in order."""
    if not samples:
        raise ShardError(f"no samples to write for {name!r}")
    if samples_per_shard < 1:
        raise ShardError("samples_per_shard must be >= 1")
    if workers < 1:
        raise ShardError("workers must be >= 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    # the shards' contents are fixed here, before any worker starts: the output cannot depend on their number
    chunks = [order[k : k + samples_per_shard] for k in range(0, len(order), samples_per_shard)]
    jobs = [ShardJob(out_dir / f".{name}-{s:06d}.tar.tmp", [(f"{name}_{i:08d}", samples[i]) for i in ids])
            for s, ids in enumerate(chunks)]
    workers = min(workers, len(jobs))
    try:
        if workers == 1:
            results = [write_one_shard(job) for job in jobs]
        else:
            with ProcessPoolExecutor(workers) as pool:
                results = list(pool.map(write_one_shard, jobs))
        rejected = Tally()
        for _, r in results:  # merged in shard order: the same examples whatever the number of workers
            rejected.merge(r)
        num_samples = sum(n for n, _ in results)
        if rejected.count and not skip_bad:
            raise ShardError(
                f"{rejected.count} of {len(samples)} files are unreadable or not images, e.g. "
                f"{rejected.examples[:5]}; fix or remove them, or pass --skip_bad to write the other "
                f"{num_samples} and record these in the index"
            )
        if not num_samples:
            raise ShardError(f"no samples to write for {name!r}: all {len(samples)} files were rejected")
        shards = []
        for job, (n, _) in zip(jobs, results, strict=True):
            if n:
                file = f"{name}-{len(shards):06d}.tar"
                os.replace(job.path, out_dir / file)
                shards.append({"file": file, "samples": n})
    finally:
        for job in jobs:
            job.path.unlink(missing_ok=True)
    index = {
        "name": name,
        "pattern": f"{name}-{{000000..{len(shards) - 1:06d}}}.tar",
        "shards": shards,
        "num_samples": num_samples,
        "classes": classes,
        "rejected": rejected.as_json(),
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
    imagenet = sub.add_parser("imagenet", help="ImageNet: train/<wnid>/, val/<wnid>/ or val/ + LOC_val_solution.csv")
    imagenet.add_argument("root", type=Path, help="the folder holding train/ and val/ (Kaggle: ILSVRC/Data/CLS-LOC)")
    imagenet.add_argument("out", type=Path, help="output folder of train.json / val.json and their shards")
    imagenet.add_argument("--split", choices=("train", "val", "both"), default="both",
                          help="which split(s) to write (default %(default)s)")
    imagenet.add_argument("--val_labels", type=Path, default=None,
                          help=f"{LOC_VAL_SOLUTION} for a flat val/ (default: looked for in ROOT and up to three "
                               f"folders above)")
    imagenet.add_argument("--classes_from", type=Path, default=None,
                          help="the class list: a folder of <wnid> folders or a shard index (e.g. an earlier "
                               "train.json) (default: ROOT/train)")
    fm = sub.add_parser("fashion-mnist", help="the idx files of the Debian package dataset-fashion-mnist")
    fm.add_argument("out", type=Path, help="output folder of train.json / test.json and their shards")
    fm.add_argument("--src", type=Path, default=FASHION_MNIST_DIR, help="the idx files (default %(default)s)")
    for p in (folder, imagenet):
        p.add_argument("--skip_bad", action="store_true", help="write the readable files, record the rest")
    for p in (folder, imagenet, fm):
        p.add_argument("--samples_per_shard", type=int, default=1000, help="samples per .tar (default %(default)s)")
        p.add_argument("--seed", type=int, default=0, help="seed of the sample order (default %(default)s)")
        p.add_argument("--workers", type=int, default=None,
                       help="writer processes; the output does not depend on it (default: the cores of this "
                            "process's CPU affinity)")
    args = parser.parse_args(argv)
    workers = args.workers if args.workers is not None else default_workers()
    opts = {"samples_per_shard": args.samples_per_shard, "seed": args.seed, "workers": workers}
    indexes = []
    try:
        start = time.perf_counter()
        if args.kind == "imagefolder":
            classes, files = list_imagefolder(args.src)
            indexes.append(write_shards(files, args.out, args.name, classes, skip_bad=args.skip_bad, **opts))
        elif args.kind == "imagenet":
            classes = imagenet_classes(args.root, args.classes_from)
            # val is listed (its labels checked) first: a val/ that cannot be labelled fails before train is written
            val = imagenet_val(args.root / "val", classes, args.val_labels, args.root) if args.split != "train" else []
            if args.split != "val":
                train = list_imagefolder(args.root / "train", classes)[1]
                indexes.append(write_shards(train, args.out, "train", classes, skip_bad=args.skip_bad, **opts))
            if val:
                indexes.append(write_shards(val, args.out, "val", classes, skip_bad=args.skip_bad, **opts))
        else:
            indexes = [write_shards(fashion_mnist_samples(args.src, split), args.out, split, FASHION_MNIST_CLASSES,
                                    **opts) for split in ("train", "test")]
        seconds = time.perf_counter() - start
    except ShardError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for idx in indexes:
        print(f"{idx['name']}: {idx['num_samples']} samples in {len(idx['shards'])} shards ({idx['pattern']}), "
              f"{idx['rejected']['count']} rejected")
    total = sum(idx["num_samples"] + idx["rejected"]["count"] for idx in indexes)
    print(f"{total} samples read and written in {seconds:.1f} s ({total / seconds:.0f}/s, {workers} worker(s))")
    return indexes


if __name__ == "__main__":
    main()
