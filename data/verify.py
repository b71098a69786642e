"""Check shards before training, from headers only: every tar member header (a member cut short
by the end of the file, a file that is not a tar) and every sample's image header (format, size;
pixels are not decoded) and label, then the sample count against the index. Shards are checked in
parallel by a pool of processes (--workers, default: the cores available).

    python -m data.verify shards/train.json [--workers N] [--max_image_pixels N]
    python -m data.verify shards/test.json --train_index shards/train.json

Prints one line per bad shard with the reason and exits 1 when any is bad, 0 when all are good,
2 when the index itself cannot be read. In a labeled index a label past the index's classes
(label >= the number of names in "classes") makes its shard bad (`label_out_of_range`); an
unlabeled index is checked without labels, and says so. `--train_index` checks the index as an
evaluation set of that training index first, from the two indexes alone: the same class names
for the same labels (data/shard_index.py check_scored_against) and no shard of the training index
(check_held_out); when they differ it exits 2 naming the first difference, before any shard is
read. `--data.verify_shards true` runs the same check on the training (and evaluation) index
before a run starts, refusing it with exit status 2.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import io
import os
import re
import sys
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
from webdataset.tariterators import group_by_keys

from data.cli import Parser
from data.faults import SampleError
from data.loader import cores_per_rank
from data.progress import mapped
from data.labels import LabelKey
from data.shard_index import PipeShard, ShardSet, check_held_out, check_scored_against
from data.shards import (
    CLS,
    DECODE_ERRORS,
    DEFAULT_MAX_IMAGE_PIXELS,
    IMAGE_KEYS,
    TAR_READ_ERRORS,
    UnreadMember,
    _is_sample_member,
    member_limit,
    open_sample,
)

PIL_OBJECT = re.compile(r" <_io\.BytesIO object at 0x[0-9a-f]+>")  # in PIL's messages: no help to a reader
HEADER_BYTES = 64 * 1024  # read of each image member: holds the header of any PNG and nearly any JPEG


@dataclass
class ShardReport:
    """What one shard holds: usable samples, problems by kind (data/faults.py's ERROR_KINDS, plus
    not_a_tar, count_mismatch and label_out_of_range) and the first example of each."""

    file: str
    expected: int  # the index's count
    samples: int = 0  # samples found (usable or not)
    problems: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    skipped: str = ""  # why the shard was not read (pipe: shards)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, kind: str, example: str) -> None:
        self.problems[kind] += 1
        self.examples.setdefault(kind, example)

    def reason(self) -> str:
        return "; ".join(f"{kind} x{n} ({self.examples[kind]})" if n > 1 else f"{kind} ({self.examples[kind]})"
                         for kind, n in self.problems.items())


def _header_parses(data: bytes) -> bool:
    try:
        Image.open(io.BytesIO(data))
        return True
    except Exception:  # any failure: read the whole member before judging it
        return False


def _members(path: Path, tar: tarfile.TarFile, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """Sample members of one tar, as data/shards.py reads them, with image members cut to their
    header (the whole member when the first HEADER_BYTES do not parse) and labels in full; a
    member over its `member_limit` is not read at all (an UnreadMember, as training skips it); then
    the end-of-archive marker (two zero blocks), whose absence means the file was cut short at a
    member boundary or has garbage after its last member (tarfile ends there without a word)."""
    size = os.path.getsize(path)
    for m in tar:
        if not _is_sample_member(m):
            continue
        if m.offset_data + m.size > size:
            raise tarfile.ReadError(f"member {m.name} is cut short ({max(0, size - m.offset_data)} of {m.size} bytes)")
        if m.size > member_limit(m.name, max_image_pixels):
            yield {"fname": m.name, "data": UnreadMember(m.size), "__url__": str(path)}
            continue
        f = tar.extractfile(m)
        is_image = m.name.rsplit(".", 1)[-1].lower() in IMAGE_KEYS
        data = f.read(HEADER_BYTES if is_image else None)
        if is_image and len(data) < m.size and not _header_parses(data):
            data += f.read()
        yield {"fname": m.name, "data": data, "__url__": str(path)}
    tar.fileobj.seek(tar.offset)
    end = tar.fileobj.read(2 * tarfile.BLOCKSIZE)
    if len(end) < 2 * tarfile.BLOCKSIZE or end.strip(b"\0"):
        raise tarfile.ReadError(f"no end-of-archive marker after the last member (at byte {tar.offset} of {size}): "
                                f"the file is cut short or has garbage after it")


def verify_shard(path: Path | PipeShard, expected: int, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 labels: LabelKey | None = CLS, num_classes: int | None = None) -> ShardReport:
    """labels: the index's label key (ShardSet.labels); None for an unlabeled index (no label checked).
    num_classes: the index's class count, which every label must stay below (None: not checked)."""
    report = ShardReport(str(path), expected)
    if isinstance(path, PipeShard):
        report.skipped = "a pipe: shard (read by running its command, not checked)"
        return report
    try:
        tar = tarfile.open(path, mode="r:")  # reads the first member's header
    except TAR_READ_ERRORS as e:
        report.add("not_a_tar", str(e) or type(e).__name__)
        return report
    with tar:
        try:
            for sample in group_by_keys(_members(path, tar, max_image_pixels)):
                report.samples += 1
                try:
                    label = open_sample(sample, max_image_pixels, labels)[1]
                except SampleError as e:
                    report.add(e.kind, f"{sample['__key__']}: {PIL_OBJECT.sub('', str(e))}")
                    continue
                except DECODE_ERRORS as e:  # open_sample maps these; kept for what PIL may add
                    report.add("undecodable_image", f"{sample['__key__']}: {e}")
                    continue
                if num_classes is not None and label is not None and label >= num_classes:
                    report.add("label_out_of_range", f"{sample['__key__']}: label {label}, the index names "
                                                      f"{num_classes} classes")
        except TAR_READ_ERRORS as e:
            report.add("truncated_shard", f"cut short or damaged after {report.samples} whole samples: "
                                          f"{str(e) or type(e).__name__}")
    if report.samples != expected:
        report.add("count_mismatch", f"the index says {expected} samples, {report.samples} were read")
    return report


def _verify_one(args: tuple) -> ShardReport:
    return verify_shard(*args)


def verify_shards(shards: ShardSet, workers: int = 0,
                  max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> list[ShardReport]:
    """One report per shard, in index order; `workers` processes (0 = this process's cores)."""
    num_classes = len(shards.classes) if shards.labeled else None
    jobs = [(f, n, max_image_pixels, shards.labels, num_classes) for f, n in zip(shards.files, shards.counts,
                                                                                   strict=True)]
    workers = min(workers or cores_per_rank(), len(jobs))
    return mapped(_verify_one, jobs, workers, "verifying", chunksize=max(1, len(jobs) // (8 * max(1, workers))))


def bad_shards_message(name: str, reports: list[ShardReport], limit: int = 10) -> str:
    """'' when every shard is good, else a few lines naming the bad shards and why."""
    bad = [r for r in reports if not r.ok]
    if not bad:
        return ""
    lines = [f"{len(bad)} of {len(reports)} shards of {name} are bad:"]
    lines += [f"  {r.file}: {r.reason()}" for r in bad[:limit]]
    if len(bad) > limit:
        lines.append(f"  ... and {len(bad) - limit} more (python -m data.verify {name} lists them all)")
    lines.append("rewrite them (data/write_shards.py) or remove them from the index")
    return "\n".join(lines)


def check_index(index: str | Path, allow_pipe_urls: bool = False, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                workers: int = 0) -> None:
    """Raise ValueError naming every bad shard of an index (the pre-start check)."""
    message = bad_shards_message(str(index), verify_shards(ShardSet.from_index(index, allow_pipe_urls), workers,
                                                           max_image_pixels))
    if message:
        raise ValueError(f"data.verify_shards: {message}")


def verify_before_start(data_cfg) -> None:
    """data.verify_shards: check the training index (source shards) and the evaluation index, if
    any; raise ValueError naming the bad shards. Nothing when the option is off."""
    if not data_cfg.verify_shards:
        return
    train = data_cfg.train_index if data_cfg.source == "shards" else ""
    for index in filter(None, (train, data_cfg.eval_index)):
        check_index(index, data_cfg.allow_pipe_urls, data_cfg.max_image_pixels)


def check_evaluation_set(shards: ShardSet, train: ShardSet) -> None:
    """--train_index: `shards` can be scored against what is fitted on `train`, and holds none of its
    shards (ShardIndexError otherwise)."""
    train.require_labels("--train_index: its labels are what an evaluation set is scored with")
    shards.require_labels("--train_index: an evaluation set is scored against its labels")
    check_scored_against(shards, train, "the index", "--train_index")
    check_held_out(shards, train, "the index", "--train_index")


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("index", help="shard index (<name>.json written by data/write_shards.py)")
    p.add_argument("--workers", type=int, default=0, help="processes checking shards (default 0: the cores available)")
    p.add_argument("--max_image_pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="images with more pixels count as bad, as data.max_image_pixels skips them (default %(default)s)")
    p.add_argument("--allow_pipe_urls", action="store_true", help="accept pipe: entries (they are listed, not checked)")
    p.add_argument("--train_index", help="check INDEX as an evaluation set of this training index: the same class "
                                         "names for the same labels, and none of its shards")
    a = p.parse_args(argv)
    if a.workers < 0:
        p.error("--workers must be >= 0")
    if a.max_image_pixels < 1:
        p.error(f"--max_image_pixels must be >= 1 (got {a.max_image_pixels}, which counts every image as a "
                f"decompression bomb); the default is {DEFAULT_MAX_IMAGE_PIXELS}")
    try:
        shards = ShardSet.from_index(a.index, a.allow_pipe_urls)
        if a.train_index is not None:
            check_evaluation_set(shards, ShardSet.from_index(a.train_index, a.allow_pipe_urls))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not shards.labeled:
        print(f"warning: {a.index} is unlabeled (\"labeled\": false): no label is checked; it feeds pretraining "
              f"objectives that read none, not fine-tuning, probes or evaluation", file=sys.stderr)
    reports = verify_shards(shards, a.workers, a.max_image_pixels)
    for r in reports:
        if r.skipped:
            print(f"SKIP {r.file}: {r.skipped}")
        elif not r.ok:
            print(f"BAD  {r.file}: {r.reason()}")
    bad = sum(not r.ok for r in reports)
    samples = sum(r.samples for r in reports)
    print(f"{len(reports) - bad} of {len(reports)} shards good, {bad} bad ({samples} samples found, "
          f"{sum(r.problems.total() for r in reports)} problems)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
