"""The image datasets data/write_shards.py converts, listed as samples with their class indices:
an image folder (SRC/<class>/<files>, classes in sorted order as torchvision's ImageFolder), the
ImageNet layouts (train/<wnid>/; val/<wnid>/ or a flat val/ labelled by Kaggle's
LOC_val_solution.csv) and Fashion-MNIST's idx files. Listing checks the layout and the labels;
the images themselves are read and checked by the worker that writes their shard."""
from __future__ import annotations

import csv
import gzip
import io
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from data.cli import InputError, read_json, regular_file

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ["t-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                         "ankle boot"]
WNID = re.compile(r"n\d{8}")  # a WordNet noun id, ImageNet's class folder names
IMAGENET_1K = 1000
LOC_VAL_SOLUTION = "LOC_val_solution.csv"


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


def folder_classes(src: Path) -> list[str]:
    """Sorted sub-folder names: the class order of torchvision's ImageFolder (and so of timm)."""
    if not src.is_dir():
        raise ShardError(f"source directory {src} does not exist (expected class sub-folders of images)")
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    if not classes:
        raise ShardError(f"{src} has no class sub-folders; expected SRC/<class>/<image files>")
    return classes


def is_image_name(path: Path) -> bool:
    """A file name of a format PIL opens (.jpg, .png, .webp, .tif, ...); README.txt, .DS_Store and
    the like are not images (torchvision's ImageFolder skips them the same way)."""
    return path.suffix.lower() in {ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN}


# why a file under SRC is not written: the writer's "left out" line counts each reason
NOT_AN_IMAGE_NAME = "their names being no image format's"
DANGLING_LINK = "being symbolic links to nothing"
NOT_A_REGULAR_FILE = "being no regular files (FIFOs, sockets, devices)"
OUTSIDE_CLASS_FOLDERS = "lying beside the class folders, in none of them"


def walk_files(folder: Path, left_out: dict[str, list[Path]], ancestors: frozenset[str] = frozenset()) -> list[Path]:
    """Every regular file under `folder`, following symbolic links to folders as torchvision's
    ImageFolder does (os.walk(followlinks=True)); a link back to a folder it lies in is not
    followed again (it would never end). Dangling links and other non-files go to `left_out`."""
    here = os.path.realpath(folder)
    ancestors = ancestors | {here}
    files = []
    try:
        entries = sorted(folder.iterdir())  # by name at every level: the order of the sorted full paths
    except OSError as e:  # pathlib's rglob passed over such a folder without a word
        raise ShardError(f"folder {folder} cannot be listed ({type(e).__name__}: {e.strerror or e}): fix its "
                         f"permissions, or move it out of the image folder") from None
    for entry in entries:
        if entry.is_dir():
            if os.path.realpath(entry) not in ancestors:
                files += walk_files(entry, left_out, ancestors)
        elif entry.is_file():
            files.append(entry)
        elif entry.is_symlink() and not entry.exists():
            left_out.setdefault(DANGLING_LINK, []).append(entry)
        else:
            left_out.setdefault(NOT_A_REGULAR_FILE, []).append(entry)
    return files


def list_imagefolder(src: Path, classes: list[str] | None = None,
                     left_out: dict[str, list[Path]] | None = None) -> tuple[list[str], list[ImageFile]]:
    """Every image file under SRC/<class>/ (symbolic links to folders followed) with its class index;
    `classes` (default: the folder's own, sorted) fixes the indices, and a sub-folder outside it is an
    error. Files that are not written are added to `left_out` by reason (NOT_AN_IMAGE_NAME,
    DANGLING_LINK, NOT_A_REGULAR_FILE, OUTSIDE_CLASS_FOLDERS); images are checked when their shard
    is written."""
    present = folder_classes(src)
    classes = present if classes is None else classes
    unknown = sorted(set(present) - set(classes))
    if unknown:
        raise ShardError(f"{len(unknown)} class folder(s) of {src} are not among the {len(classes)} classes "
                         f"given ({classes[0]} ... {classes[-1]}), e.g. {unknown[:5]}: they have no "
                         f"class index")
    left_out = {} if left_out is None else left_out
    top = sorted(p for p in src.iterdir() if not p.is_dir())
    if top:
        left_out.setdefault(OUTSIDE_CLASS_FOLDERS, []).extend(top)
    listed = {c: walk_files(src / c, left_out) for c in present}
    for c in present:
        left_out.setdefault(NOT_AN_IMAGE_NAME, []).extend(f for f in listed[c] if not is_image_name(f))
    for reason in [r for r, files in left_out.items() if not files]:
        del left_out[reason]
    listed = {c: [f for f in files if is_image_name(f)] for c, files in listed.items()}
    empty = [c for c in present if not listed[c]]
    if empty:
        raise ShardError(f"{len(empty)} class folder(s) of {src} hold no image files: {empty[:10]}; remove them or "
                         f"add images")
    index = {c: i for i, c in enumerate(classes)}
    files = [ImageFile(f, index[c]) for c in present for f in listed[c]]
    return classes, files


def left_out_summary(left_out: dict[str, list[Path]]) -> str:
    """One line: how many files were not written, by reason, with examples; '' when none."""
    return "; ".join(f"{len(files)} file(s) left out, {reason}, e.g. {', '.join(str(f) for f in files[:3])}"
                     for reason, files in left_out.items())


def read_idx(path: Path) -> np.ndarray:
    """An MNIST-style idx file (optionally gzipped) as a uint8 array."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; EOFError: a gzip stream cut short
        raise ShardError(f"{path} cannot be read ({type(e).__name__}: {e}): give the idx file as published") from None
    if len(raw) < 4 or raw[:3] != b"\0\0\x08":
        raise ShardError(f"{path} is not an idx file of unsigned bytes (it holds {len(raw)} bytes)")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise ShardError(f"{path} is truncated in its header: {ndim} dimensions need {4 + 4 * ndim} bytes, it holds "
                         f"{len(raw)}")
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

def index_classes(index_path: Path) -> list[str]:
    """The "classes" of a shard index (--classes_from, e.g. the training split's train.json)."""
    if not index_path.is_file():
        raise ShardError(f"--classes_from {index_path}: no such shard index")
    try:
        index = read_json(index_path, "--classes_from")
    except InputError as e:
        raise ShardError(str(e)) from None
    classes = index.get("classes") if isinstance(index, dict) else None
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        raise ShardError(f"--classes_from {index_path}: the index has no 'classes' list")
    return classes


def class_list_of(src: Path) -> list[str]:
    """imagefolder --classes_from: a shard index's classes, or the sorted class folders of an image folder."""
    return index_classes(src) if src.suffix == ".json" else folder_classes(src)


def imagenet_classes(root: Path, classes_from: Path | None) -> list[str]:
    """Sorted wnids of ROOT/train (or of `classes_from`: a folder of wnid folders, or a shard index
    whose "classes" it takes). Indices are ImageNet-1k's (timm / torchvision) only with all 1000."""
    src = classes_from or root / "train"
    classes = class_list_of(src)
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
    try:
        regular_file(path, "the val labels", f"give Kaggle's {LOC_VAL_SOLUTION} (--val_labels)")
        return _loc_val_rows(path)
    except InputError as e:
        raise ShardError(str(e)) from None
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ShardError(f"the val labels {path} cannot be read as CSV ({type(e).__name__}: {e}): give Kaggle's "
                         f"{LOC_VAL_SOLUTION} (--val_labels)") from None


def _loc_val_rows(path: Path) -> dict[str, str]:
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


def imagenet_val(val: Path, classes: list[str], val_labels: Path | None, root: Path,
                 left_out: dict[str, list[Path]] | None = None) -> list[ImageFile]:
    if not val.is_dir():
        raise ShardError(f"{val} does not exist (pass --split train to write the training split only)")
    if any(p.is_dir() for p in val.iterdir()):  # val/<wnid>/*.JPEG, e.g. after the devkit's valprep.sh
        return list_imagefolder(val, classes, left_out)[1]
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
