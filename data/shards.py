"""Reading webdataset shards: deterministic, split by rank and worker, resumable.

The stream of one (rank, worker) is a pure function of (index, seed, world, num_workers):
for epoch e = 0, 1, ...: the shards are permuted with (seed, e); shard k of that order goes to
the (rank, worker) pair number k mod (world x num_workers), so every sample is read exactly once
per epoch across all ranks and workers; samples pass through a shuffle buffer seeded with
(seed, e, rank, worker) and are decoded and augmented with a seed per sample position. The
stream never ends (epochs follow each other), so no rank runs dry; the training loop counts
its own nominal epochs.

Resuming: the loader records how many batches this rank consumed; each worker replays its
stream up to its share of them (reading and decoding, to recognise corrupt samples the same
way, but not augmenting).

A sample whose image is missing or does not decode, or whose label is missing, is skipped and
counted by kind; a shard that ends early (truncated tar) is counted and the stream moves on.
"""
from __future__ import annotations

import io
import json
import random
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from PIL import Image
from webdataset.tariterators import group_by_keys, tar_file_iterator

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


def raw_samples(files: list[Path], errors: Counter) -> Iterator[dict]:
    """Group tar members into samples (webdataset's grouping); a truncated tar ends its shard."""
    for f in files:
        try:
            with open(f, "rb") as stream:
                members = ({**m, "__url__": str(f)} for m in tar_file_iterator(stream))
                yield from group_by_keys(members)
        except (tarfile.TarError, OSError, EOFError, ValueError):
            errors["truncated_shard"] += 1


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


def decode(sample: dict) -> tuple[Image.Image, int]:
    """Raise KeyError / OSError / ValueError for a sample that cannot be used."""
    key = next((k for k in IMAGE_KEYS if k in sample), None)
    if key is None:
        raise KeyError("image")
    if "cls" not in sample:
        raise KeyError("cls")
    img = Image.open(io.BytesIO(sample[key]))
    img.load()
    return img, int(sample["cls"])


def error_kind(e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"missing_{e.args[0]}"
    return "bad_label" if isinstance(e, ValueError) else "undecodable_image"


class ShardStream(torch.utils.data.IterableDataset):
    """Infinite training stream of one rank; the DataLoader's workers split it further.

    Yields dicts with `image` (3, S, S), `label`, and bookkeeping for the main process:
    `worker` and `errors` (this worker's cumulative skipped-sample counts, ERROR_KINDS order).
    """

    def __init__(self, shards: ShardSet, transform: Callable, seed: int, rank: int, world: int, num_workers: int,
                 shuffle_buffer: int, skip_per_worker: list[int] | None = None, worker_offset: int = 0,
                 keep: Callable[[str], bool] | None = None):
        super().__init__()
        self.keep = keep  # sample-key filter (a labeled split's part), applied before decoding
        self.shards, self.transform, self.seed = shards, transform, seed
        self.rank, self.world, self.num_workers = rank, world, max(1, num_workers)
        self.shuffle_buffer = shuffle_buffer
        self.skip_per_worker = skip_per_worker or [0] * self.num_workers
        # DataLoader worker i plays stream (i + offset) mod W, so that after a resume the first
        # batch comes from the stream whose turn it was in the round-robin.
        self.worker_offset = worker_offset

    def worker_samples(self, worker: int, errors: Counter) -> Iterator[tuple[int, int, dict]]:
        """(epoch, position in epoch, raw sample) for one worker, forever."""
        reader, readers = self.rank * self.num_workers + worker, self.world * self.num_workers
        epoch = 0
        while True:
            ids = shards_for(len(self.shards.files), epoch, self.seed, reader, readers)
            rng = random.Random(derive_seed(self.seed, epoch, self.rank, worker))
            files = [self.shards.files[i] for i in ids]
            for pos, s in enumerate(shuffled(raw_samples(files, errors), self.shuffle_buffer, rng)):
                yield epoch, pos, s
            epoch += 1

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = ((info.id if info is not None else 0) + self.worker_offset) % self.num_workers
        errors: Counter = Counter()
        to_skip = self.skip_per_worker[worker]
        for epoch, pos, raw in self.worker_samples(worker, errors):
            if self.keep is not None and not self.keep(raw["__key__"]):
                continue
            try:
                img, label = decode(raw)
            except (KeyError, OSError, ValueError, SyntaxError) as e:  # PIL raises SyntaxError for some files
                errors[error_kind(e)] += 1
                continue
            if to_skip > 0:  # replaying up to the resumed position (decoded: corrupt ones must not count)
                to_skip -= 1
                continue
            image = self.transform(img, derive_seed(self.seed, epoch, self.rank, worker, pos))
            counts = torch.tensor([errors[k] for k in ERROR_KINDS])
            yield {"image": image, "label": label, "worker": worker, "errors": counts}
