"""Reading webdataset shards: deterministic, split by rank and worker, resumable.

The stream of one (rank, worker) is a pure function of (index, seed, world, num_workers):
for epoch e = 0, 1, ...: the shards are permuted with (seed, e); shard k of that order goes to
the (rank, worker) pair number k mod (world x num_workers) (its "reader"), so every sample is
read exactly once per epoch across all ranks and workers; samples pass through a shuffle buffer
seeded with (seed, e, rank, worker) and are decoded and augmented with a seed per sample
position. The stream never ends (epochs follow each other), so no rank runs dry; the training
loop counts its own nominal epochs.

Positions: every sample carries (epoch, pos), its index in its reader's shuffled epoch stream
(counted before any key filter or decode failure). The loader records the position of the last
sample each worker delivered; on resume a worker re-reads its shards up to that position
without decoding and continues. With another number of readers (world size or workers changed)
data/reshard.py works out which samples the old readers had consumed and the new readers skip
exactly those (`Consumed`).

A sample whose image is missing or does not decode, or whose label is missing, is skipped and
counted by kind; a shard that ends early (truncated tar) is counted and the stream moves on.
"""
from __future__ import annotations

import io
import json
import os
import random
import re
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from PIL import Image
from webdataset.tariterators import group_by_keys

IMAGE_KEYS = ("jpg", "jpeg", "png")
ERROR_KINDS = ("missing_image", "missing_cls", "bad_label", "undecodable_image", "truncated_shard")


@dataclass(frozen=True)
class ShardSet:
    """A set of shards described by the JSON index that data/write_shards.py writes."""

    files: tuple[Path, ...]
    counts: tuple[int, ...]
    classes: tuple[str, ...]

    @property
    def num_samples(self) -> int:
        return sum(self.counts)

    @classmethod
    def from_index(cls, path: str | Path) -> "ShardSet":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"shard index {path} not found; write shards with data/write_shards.py")
        index = json.loads(path.read_text())
        files = tuple(path.parent / s["file"] for s in index["shards"])
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{len(missing)} shard(s) listed in {path} are missing, e.g. {missing[:3]}")
        return cls(files, tuple(s["samples"] for s in index["shards"]), tuple(index["classes"]))


def check_split(shards: ShardSet, world: int, num_workers: int) -> None:
    """Every (rank, worker) pair needs at least one shard per epoch, or it would wait forever."""
    readers = world * max(1, num_workers)
    if len(shards.files) < readers:
        raise ValueError(
            f"{len(shards.files)} shards cannot feed {world} ranks x {max(1, num_workers)} workers = {readers} "
            f"readers; write at least {readers} shards (--samples_per_shard smaller) or use fewer workers"
        )


def derive_seed(*parts: int) -> int:
    return int(np.random.SeedSequence(parts).generate_state(1, dtype=np.uint64)[0] & (2**63 - 1))


def shards_for(num_shards: int, epoch: int, seed: int, reader: int, readers: int) -> list[int]:
    """Shard ids read by one reader (rank * num_workers + worker) in one epoch."""
    order = list(range(num_shards))
    random.Random(derive_seed(seed, epoch)).shuffle(order)
    return order[reader::readers]


META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members, never part of a sample


def tar_members(f: Path, with_data: bool) -> Iterator[dict]:
    """Regular members of one tar in order, as webdataset's iterator gives them. Without data only
    the headers are read (the data is seeked over): the same members, so key-only replays see the
    same samples. A member whose data runs past the end of the file raises, as reading it would."""
    size = os.path.getsize(f)
    with tarfile.open(f, mode="r:") as tar:
        for m in tar:
            if not m.isreg() or META.match(m.name) or ("/" not in m.name and m.name.startswith("__")):
                continue
            if m.offset_data + m.size > size:
                raise tarfile.ReadError(f"{f}: member {m.name} is cut short")
            data = tar.extractfile(m).read() if with_data else None
            yield {"fname": m.name, "data": data, "__url__": str(f)}


def raw_samples(files: list[Path], errors: Counter, with_data: bool = True) -> Iterator[dict]:
    """Group tar members into samples (webdataset's grouping); a truncated tar ends its shard.
    `with_data=False` yields the same samples with keys only (`__key__`, `__url__`)."""
    for f in files:
        try:
            yield from group_by_keys(tar_members(f, with_data))
        except (tarfile.TarError, OSError, EOFError, ValueError):
            errors["truncated_shard"] += 1


def sample_id(raw: dict) -> str:
    """`<shard file name>/<key>`: unique across a shard set even if keys repeat across shards."""
    return f"{Path(raw['__url__']).name}/{raw['__key__']}"


def shuffled(samples: Iterator[dict], buffer: int, rng: random.Random) -> Iterator[dict]:
    """Reservoir-style shuffle buffer: fill, then emit a random element per new sample."""
    pool: list[dict] = []
    for s in samples:
        if len(pool) < buffer:
            pool.append(s)
            continue
        k = rng.randrange(len(pool))
        pool[k], s = s, pool[k]
        yield s
    rng.shuffle(pool)
    yield from pool


def open_sample(sample: dict) -> tuple[Image.Image, int, bytes]:
    """(lazily opened image: header read, pixels not decoded; label; encoded bytes).
    Raise KeyError / OSError / ValueError for a sample that cannot be used."""
    key = next((k for k in IMAGE_KEYS if k in sample), None)
    if key is None:
        raise KeyError("image")
    if "cls" not in sample:
        raise KeyError("cls")
    return Image.open(io.BytesIO(sample[key])), int(sample["cls"]), sample[key]


def decode(sample: dict) -> tuple[Image.Image, int]:
    """(decoded image, label); raises like `open_sample`, or OSError when the pixels do not decode."""
    img, label, _ = open_sample(sample)
    img.load()
    return img, label


def error_kind(e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"missing_{e.args[0]}"
    return "bad_label" if isinstance(e, ValueError) else "undecodable_image"


@dataclass
class Consumed:
    """Samples of one epoch that an earlier layout of readers already delivered (data/reshard.py):
    whole shards (by index) and single samples (`sample_id`)."""
    shards: set[int] = field(default_factory=set)
    samples: set[str] = field(default_factory=set)


@dataclass
class StreamStart:
    """Where the workers of one rank (re)start.

    last: per worker, (epoch, pos) of the last sample it delivered; samples up to it are re-read
      without decoding and dropped. (start_epoch, -1) = nothing delivered yet.
    start_epoch: the first epoch read (after a change of readers: the oldest unfinished one).
    consumed: per epoch, what earlier readers delivered; skipped (see data/reshard.py).
    legacy_skip: per worker, decoded samples to drop (positions recorded before (epoch, pos) were).
    """
    last: list[tuple[int, int]]
    start_epoch: int = 0
    consumed: dict[int, Consumed] = field(default_factory=dict)
    legacy_skip: list[int] | None = None

    @classmethod
    def fresh(cls, num_workers: int) -> "StreamStart":
        return cls([(0, -1)] * max(1, num_workers))


class ShardStream(torch.utils.data.IterableDataset):
    """Infinite training stream of one rank; the DataLoader's workers split it further.

    Yields dicts with `image` (transform output), `label`, and bookkeeping for the main process:
    `worker`, `epoch`, `pos` (the sample's position) and `errors` (this worker's skipped-sample
    counts since it started, ERROR_KINDS order).
    """

    def __init__(self, shards: ShardSet, transform: Callable, seed: int, rank: int, world: int, num_workers: int,
                 shuffle_buffer: int, start: StreamStart | None = None, worker_offset: int = 0,
                 keep: Callable[[str], bool] | None = None):
        super().__init__()
        self.keep = keep  # sample-key filter (a labeled split's part), applied before decoding
        self.shards, self.transform, self.seed = shards, transform, seed
        self.rank, self.world, self.num_workers = rank, world, max(1, num_workers)
        self.shuffle_buffer = shuffle_buffer
        self.start = start or StreamStart.fresh(self.num_workers)
        # DataLoader worker i plays stream (i + offset) mod W, so that after a resume the first
        # batch comes from the stream whose turn it was in the round-robin.
        self.worker_offset = worker_offset

    def worker_samples(self, worker: int, errors: Counter, with_data: bool = True) -> Iterator[tuple[int, int, dict]]:
        """(epoch, position in epoch, raw sample) for one worker, forever, from start_epoch."""
        reader, readers = self.rank * self.num_workers + worker, self.world * self.num_workers
        epoch = self.start.start_epoch
        while True:
            done = self.start.consumed.get(epoch, Consumed())
            ids = [i for i in shards_for(len(self.shards.files), epoch, self.seed, reader, readers) if i not in done.shards]
            rng = random.Random(derive_seed(self.seed, epoch, self.rank, worker))
            samples = raw_samples([self.shards.files[i] for i in ids], errors, with_data)
            if done.samples:
                samples = (s for s in samples if sample_id(s) not in done.samples)
            for pos, s in enumerate(shuffled(samples, self.shuffle_buffer, rng)):
                yield epoch, pos, s
            epoch += 1

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = ((info.id if info is not None else 0) + self.worker_offset) % self.num_workers
        errors: Counter = Counter()
        last = tuple(self.start.last[worker])
        legacy_skip = self.start.legacy_skip[worker] if self.start.legacy_skip else 0
        replayed: Counter | None = None  # errors met while re-reading delivered samples are counted already
        takes_bytes = getattr(self.transform, "takes_bytes", False)
        for epoch, pos, raw in self.worker_samples(worker, errors):
            if (epoch, pos) <= last:  # delivered before the resume: re-read, not decoded
                continue
            if replayed is None:
                replayed = Counter(errors)
            if self.keep is not None and not self.keep(raw["__key__"]):
                continue
            seed = derive_seed(self.seed, epoch, self.rank, worker, pos)
            try:
                img, label, data = open_sample(raw)
            except (KeyError, OSError, ValueError, SyntaxError) as e:  # PIL raises SyntaxError for some files
                errors[error_kind(e)] += 1
                continue
            try:  # the pixels are decoded here (at reduced size with cpu_draft; nvjpeg defers it)
                if legacy_skip > 0:  # an old-format position: decoded samples to drop
                    img.load()
                    legacy_skip -= 1
                    continue
                image = self.transform(img, seed, data) if takes_bytes else self.transform(img, seed)
            except (OSError, ValueError, SyntaxError):
                errors["undecodable_image"] += 1
                continue
            counts = torch.tensor([errors[k] - replayed[k] for k in ERROR_KINDS])
            yield {"image": image, "label": label, "worker": worker, "epoch": epoch, "pos": pos, "errors": counts}
