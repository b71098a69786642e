"""Write webdataset .tar shards with an index, with N worker processes.

    python -m data.write_shards imagefolder SRC_DIR OUT_DIR --name train [--samples_per_shard 1000]
    python -m data.write_shards imagefolder VAL_DIR OUT_DIR --name val --classes_from OUT_DIR/train.json
    python -m data.write_shards imagenet ROOT OUT_DIR [--split train|val|both] [--val_labels LOC_val_solution.csv]
    python -m data.write_shards fashion-mnist OUT_DIR [--src IDX_DIR]

Each sample is `<key>.jpg` or `<key>.png` (the original encoded bytes; other decodable formats
are re-encoded to PNG) plus `<key>.cls` (the class index as text). Samples are shuffled with a
fixed seed before sharding, so every shard mixes classes. Shards are named
`<name>-000000.tar ...` and described by `<name>.json`:
    {"name", "pattern": "<name>-{000000..000009}.tar", "shards": [{"file", "samples"}],
     "num_samples", "classes": [...], "rejected": {"count", "examples"}}

`--workers N` processes (default: every core of this process's CPU affinity) each read, check and
write whole shards, given the already shuffled order; tar members carry a fixed mtime, user and
mode, so the shards and the index are byte-identical for the same input and seed whatever N.
Shards are written under temporary names (`.<name>-000000.tar.tmp<pid>`, the writer's process id)
and renamed when all are complete; the index comes last, also under a temporary name. A write of
`<name>` first removes, and counts, the temporary files of `<name>` that writers no longer running
(killed) left behind. Refused before anything is read or written: an output folder that is,
lies inside or holds the input folder (symbolic links resolved), an index that would replace an
input file (--classes_from; Fashion-MNIST's idx files have names no output has), and without
--overwrite an output folder that holds the index or shards of a name the command writes (with
it they are replaced, and the shards of an earlier, larger set of that name removed).

The datasets are listed (layouts and labels checked) by data/image_datasets.py.
Fashion-MNIST (`fashion-mnist OUT_DIR`): the four idx files in --src, or without it in the folder
data/fashion_mnist.py finds (Debian's package, else runs/fashion-mnist), downloaded and checked
there when missing.
ImageNet (`imagenet ROOT`): `ROOT/train/<wnid>/*.JPEG`, and `ROOT/val/<wnid>/*.JPEG` or a flat
`ROOT/val/*.JPEG` labelled by the Kaggle release's LOC_val_solution.csv (ImageId, PredictionString
starting with the wnid; found in ROOT or up to three folders above, or given by --val_labels).
Labels index the sorted wnids of ROOT/train (or of --classes_from), which for all 1000 classes is
the order timm and torchvision use (ImageFolder sorts folder names), so labels are their
ImageNet-1k class indices.

Bad input is never silently dropped: a missing directory or an empty class folder is an error,
files that are not written (names of no image format, dangling links, files beside the class
folders) are counted by reason in the "left out" line (links to folders are followed, as
torchvision's ImageFolder follows them), and files that cannot be read or decoded as images are
counted and listed; the writer halts
unless `--skip_bad` is given, in which case the index records them.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import io
import json
import os
import random
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image, UnidentifiedImageError

from data.cli import Parser
from data.fashion_mnist import CACHE, find_or_download
from data.faults import Tally
from data.folders import unwritable
from data.image_modes import conversion_kind
from data.outputs import clashing_input, temporary_name, written_whole
from data.progress import mapped
from data.image_datasets import (
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_DIR,
    LOC_VAL_SOLUTION,
    ImageFile,
    Sample,
    ShardError,
    class_list_of,
    fashion_mnist_samples,
    imagenet_classes,
    imagenet_val,
    left_out_summary,
    list_imagefolder,
)

SHARD_NAME = re.compile(r".+-\d{6}\.tar")  # <name>-000000.tar
TAR_MTIME = 0  # webdataset's TarWriter stamps members with time.time() unless told: fixed for identical shards


# the modes a PNG stores; an image of another mode (CMYK, YCbCr, LAB, HSV: colour; F and the like:
# one band) is converted as the reader converts it (to RGB, or to one band), then stored
PNG_MODES = {"1", "L", "LA", "I;16", "P", "RGB", "RGBA"}


def encode_image_file(path: Path) -> tuple[bytes, str]:
    """Read a file and check that it decodes; JPEG/PNG bytes are kept as they are, other formats
    (TIFF, BMP, WebP, ...) stored as PNG."""
    data = path.read_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", Image.DecompressionBombWarning)
        try:
            opened = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:  # its message would name the in-memory buffer, not the file
            raise UnidentifiedImageError("not an image: no format PIL reads recognises its bytes") from None
    for w in caught:
        if issubclass(w.category, Image.DecompressionBombWarning):
            warn_big_image(path, opened.size)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    with opened as img:
        img.load()  # full decode: truncated files fail here, not at training time
        fmt = img.format
        if fmt == "JPEG":
            return data, "jpg"
        if fmt == "PNG":
            return data, "png"
        if conversion_kind(img.mode) == "16bit" and img.mode != "I;16":
            # I;16B, I;16L, I (32-bit): the values as a 16-bit grey PNG, which the readers shift >> 8 as they
            # would the original (convert("L") clipped every value above 255 to white)
            img = Image.fromarray(np.clip(np.asarray(img), 0, 65535).astype("<u2"))
        elif img.mode not in PNG_MODES:
            img = img.convert("RGB" if len(img.getbands()) >= 3 else "L")
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue(), "png"


def warn_big_image(path: Path, size: tuple[int, int]) -> None:
    """PIL's DecompressionBombWarning names neither the file nor what to do: an image over
    Image.MAX_IMAGE_PIXELS (and under twice it, which is refused) is written, and training skips it
    as a decompression_bomb unless data.max_image_pixels is raised."""
    pixels = size[0] * size[1]
    print(f"warning: {path} is {size[0]} x {size[1]} = {pixels} pixels, over the limit of "
          f"{Image.MAX_IMAGE_PIXELS} pixels (data.max_image_pixels' default): it is written, but training skips it "
          f"as a decompression_bomb unless you pass --data.max_image_pixels {pixels} or more (and python -m "
          f"data.verify --max_image_pixels {pixels}); if it is not a valid image, remove it", file=sys.stderr)


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
                # PIL raises OSError subclasses for undecodable data too, and DecompressionBombError (no
                # OSError) for a header claiming over twice Image.MAX_IMAGE_PIXELS, before any decoding
                try:
                    data, ext = encode_image_file(smp.path)
                except (OSError, Image.DecompressionBombError) as e:
                    rejected.add(smp.path, f"{type(e).__name__}: {e}")  # named by its path
                    continue
            else:
                data, ext = smp.data, smp.ext
            sink.write({"__key__": key, ext: data, "cls": str(smp.label).encode()})
            written += 1
    return written, rejected


def check_output_folder(out: Path) -> None:
    """Before any file is read or written: the output folder can be written."""
    problem = unwritable(out)
    if problem:
        raise ShardError(f"output folder {out} {problem}")


def check_input_folder(folder: Path | None, what: str, expected: str) -> None:
    """An input folder that exists but is a file (or a FIFO, a device) is refused as such: the readers
    would call it missing, or look for files inside it."""
    if folder is not None and folder.exists() and not folder.is_dir():
        kind = "a file, not a folder" if folder.is_file() else "not a folder"
        raise ShardError(f"{what} {folder} is {kind}: give {expected}")


def check_outputs(out: Path, names: list[str], folders: list[Path], files: list[Path], overwrite: bool,
                  other_name: bool = False) -> None:
    """Before any file is read or written: the output folder is not an input folder, does not lie
    inside one (the shards would join the images: a class folder of their own next time) and holds
    none (symbolic links resolved); no index written is an input file (e.g. --classes_from); shards
    or an index of the same names are replaced only with `overwrite`. `other_name`: the subcommand
    takes --name (imagefolder), which the refusal then offers too."""
    for folder in folders:
        if (clash := clashing_input(out, [folder])) is not None:
            raise ShardError(f"output folder {out} {clash[1]} the input folder {folder}: the shards would be written "
                             f"among the images (--overwrite never writes into an input); give another output folder")
        if clashing_input(folder, [out]) is not None:
            raise ShardError(f"the input folder {folder} lies inside the output folder {out}, which would hold its "
                             f"own input (--overwrite does not change this); give an output folder outside it")
    for index in (out / f"{name}.json" for name in names):
        if (clash := clashing_input(index, files)) is not None:
            raise ShardError(f"the index {index} would replace the input {clash[0]} (--overwrite never replaces an "
                             f"input); give another output folder")
    held = sorted(p.name for name in names for p in written_by(out, name))
    if held and not overwrite:
        raise ShardError(f"output folder {out} holds {', '.join(held[:3])}{' ...' if len(held) > 3 else ''} already: "
                         f"pass --overwrite to replace them, or give another output folder"
                         f"{' or --name' if other_name else ''}")


def planned_inputs(args: argparse.Namespace) -> tuple[list[str], list[Path], list[Path]]:
    """(the names of the shard sets the command writes, its input folders, its input files)."""
    if args.kind == "imagefolder":
        return [args.name], [args.src], [args.classes_from] if args.classes_from is not None else []
    if args.kind == "imagenet":
        names = [n for n in ("train", "val") if args.split in (n, "both")]
        return names, [args.root], [f for f in (args.val_labels, args.classes_from) if f is not None]
    return ["train", "test"], [], []  # the idx files, read by their names: no index or shard is named so


def written_by(out: Path, name: str) -> list[Path]:
    """The files of shard set `name` in `out`: its index and its shards."""
    if not out.is_dir():
        return []
    return [p for p in out.iterdir() if p.name == f"{name}.json" or SHARD_NAME.fullmatch(p.name) and
            p.name.rsplit("-", 1)[0] == name]


def orphan_temporaries(out: Path, name: str) -> list[Path]:
    """Temporary files of shard set `name` (`.<name>-000000.tar.tmp<pid>`, `.<name>.json.tmp<pid>`) whose
    writer no longer runs: a killed write leaves them, and no later write of other shards would."""
    pattern = re.compile(rf"\.{re.escape(name)}(-\d{{6}}\.tar|\.json)\.tmp(\d*)")
    found = [(p, m) for p in out.iterdir() if (m := pattern.fullmatch(p.name))] if out.is_dir() else []
    return sorted(p for p, m in found if not m[2] or not process_alive(int(m[2])))  # no pid: an older writer's


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, run by another user
        return True
    return True


def remove_orphan_temporaries(out: Path, name: str) -> None:
    """Before writing `name`: the temporary files killed writers of `name` left in `out` are removed, and counted."""
    orphans = orphan_temporaries(out, name)
    for p in orphans:
        p.unlink(missing_ok=True)
    if orphans:
        print(f"removed {len(orphans)} temporary file(s) of {name!r} left in {out} by writers that no longer run "
              f"(interrupted writes), e.g. {orphans[0].name}", file=sys.stderr)


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
    remove_orphan_temporaries(out_dir, name)
    jobs = [ShardJob(temporary_name(out_dir / f"{name}-{s:06d}.tar"), [(f"{name}_{i:08d}", samples[i]) for i in ids])
            for s, ids in enumerate(chunks)]
    workers = min(workers, len(jobs))
    try:
        results = mapped(write_one_shard, jobs, workers, f"writing {name} shards")
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
        (out_dir / f"{name}.json").unlink(missing_ok=True)  # an earlier index (--overwrite) must not list new shards
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
    with written_whole(out_dir / f"{name}.json") as tmp:
        tmp.write_text(json.dumps(index, indent=1))
    for stale in set(written_by(out_dir, name)) - {out_dir / s["file"] for s in shards} - {out_dir / f"{name}.json"}:
        stale.unlink()  # shards of an earlier, larger set of this name (replaced with --overwrite)
    return index


def main(argv: list[str] | None = None) -> list[dict]:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    folder = sub.add_parser("imagefolder", help="class sub-folders of JPEG/PNG files")
    folder.add_argument("src", type=Path, help="the image folder: one sub-folder per class")
    folder.add_argument("out", type=Path, help="output folder of the shards and their <name>.json index")
    folder.add_argument("--name", default="train", help="shard and index name (default %(default)s)")
    folder.add_argument("--classes_from", type=Path, default=None,
                        help="the class list, so labels mean what they mean there: a shard index (e.g. the training "
                             "split's train.json) or an image folder (its sorted sub-folders); every class folder of "
                             "SRC must be in it (default: SRC's sorted sub-folders)")
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
    fm = sub.add_parser("fashion-mnist",
                        help="Fashion-MNIST's four idx files (found or downloaded: data/fashion_mnist.py)")
    fm.add_argument("out", type=Path, help="output folder of train.json / test.json and their shards")
    fm.add_argument("--src", type=Path, default=None,
                    help=f"the folder of the idx files (default: {FASHION_MNIST_DIR}, Debian's dataset-fashion-mnist, "
                         f"else {CACHE}, downloaded there and checked when missing)")
    for p in (folder, imagenet):
        p.add_argument("--skip_bad", action="store_true", help="write the readable files, record the rest")
    for p in (folder, imagenet, fm):
        p.add_argument("--samples_per_shard", type=int, default=1000, help="samples per .tar (default %(default)s)")
        p.add_argument("--seed", type=int, default=0, help="seed of the sample order (default %(default)s)")
        p.add_argument("--overwrite", action="store_true",
                       help="replace the index and shards of the same name in the output folder")
        p.add_argument("--workers", type=int, default=None,
                       help="writer processes; the output does not depend on it (default: the cores of this "
                            "process's CPU affinity)")
    args = parser.parse_args(argv)
    if args.kind == "imagefolder" and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", args.name):
        parser.error(f"--name {args.name!r}: the shards' and index's file name in the output folder, so letters, "
                     f"digits, '_' and '-', starting with a letter or digit, and no '.' (a sample's key ends at its "
                     f"first dot: webdataset would merge a shard into one sample) (e.g. train)")
    workers = args.workers if args.workers is not None else default_workers()
    opts = {"samples_per_shard": args.samples_per_shard, "seed": args.seed, "workers": workers}
    indexes = []
    try:
        start = time.perf_counter()
        if args.kind == "imagefolder":
            check_input_folder(args.src, "source folder", "the image folder (one sub-folder per class)")
        elif args.kind == "imagenet":
            check_input_folder(args.root, "ImageNet root", "the folder holding train/ and val/")
        else:
            check_input_folder(args.src, "--src", "the folder of the four idx files")
        check_output_folder(args.out)
        check_outputs(args.out, *planned_inputs(args), args.overwrite, other_name=args.kind == "imagefolder")
        left_out: dict[str, list[Path]] = {}
        if args.kind == "imagefolder":
            given = class_list_of(args.classes_from) if args.classes_from is not None else None
            classes, files = list_imagefolder(args.src, given, left_out)
            indexes.append(write_shards(files, args.out, args.name, classes, skip_bad=args.skip_bad, **opts))
        elif args.kind == "imagenet":
            classes = imagenet_classes(args.root, args.classes_from)
            # val is listed (its labels checked) first: a val/ that cannot be labelled fails before train is written
            val = imagenet_val(args.root / "val", classes, args.val_labels, args.root, left_out) \
                if args.split != "train" else []
            if args.split != "val":
                train = list_imagefolder(args.root / "train", classes, left_out)[1]
                indexes.append(write_shards(train, args.out, "train", classes, skip_bad=args.skip_bad, **opts))
            if val:
                indexes.append(write_shards(val, args.out, "val", classes, skip_bad=args.skip_bad, **opts))
        else:
            src = args.src if args.src is not None else find_or_download()
            indexes = [write_shards(fashion_mnist_samples(src, split), args.out, split, FASHION_MNIST_CLASSES,
                                    **opts) for split in ("train", "test")]
        seconds = time.perf_counter() - start
    except ShardError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for idx in indexes:
        print(f"{idx['name']}: {idx['num_samples']} samples in {len(idx['shards'])} shards ({idx['pattern']}), "
              f"{idx['rejected']['count']} rejected")
    if left_out:
        print(left_out_summary(left_out))
    total = sum(idx["num_samples"] + idx["rejected"]["count"] for idx in indexes)
    print(f"{total} samples read and written in {seconds:.1f} s ({total / seconds:.0f}/s, {workers} worker(s))")
    return indexes


if __name__ == "__main__":
    main()
