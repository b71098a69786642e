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

Faults (data/faults.py): a sample that cannot be used (image missing, empty, undecodable or
above data.max_image_pixels; in a labeled set: label missing or not an integer; its image or label
member larger than `member_limit`, judged from the tar header and never read) is skipped and
counted by kind; a shard that ends early (truncated tar) is counted and the stream moves on.
Images of other modes are converted to 8-bit RGB and counted by conversion (CMYK, 16-bit, other),
images in formats other than JPEG / PNG / WebP counted as `other_format` (data/image_modes.py).
Each reader gives up with `CorruptDataError` when more than data.max_bad_fraction of what it
read was unusable (the rule is in data/faults.py). Which shards a set holds, and the checks made
of an index before any shard is read, are in data/shard_index.py.
"""
from __future__ import annotations

import io
import os
import random
import re
import struct
import subprocess
import tarfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from PIL import Image
from webdataset.tariterators import base_plus_ext, group_by_keys

from data.faults import ERROR_KINDS, BadSampleBudget, CorruptDataError, SampleError, verify_hint
from data.image_modes import CONVERTED_KINDS, conversion_kind, format_kind
from data.labels import LabelKey
from data.shard_index import PipeShard, ShardSet, shard_name

# Image members, in the order a sample's image is picked when it has several: JPEG, PNG, WebP
# (img2dataset's default), then the still-image formats PIL decodes with its own codecs (counted
# `other_format`); formats that need an optional library or program (EPS, PDF, AVIF) are left out.
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "jpe", "jfif", "gif", "bmp", "tif", "tiff", "ppm", "pgm", "pbm", "pnm",
              "tga", "qoi")
CLS = LabelKey()  # the labels of data/write_shards.py's shards
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # PIL's default Image.MAX_IMAGE_PIXELS (data.max_image_pixels)
# What PIL raises for malformed image bytes (struct.error / IndexError from some truncated headers)
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError)
# What reading a damaged tar raises: tarfile's errors, ValueError (int() of a malformed GNU sparse pax
# header), RecursionError (tarfile reads each of a chain of pax / GNU long-name headers by recursing)
TAR_READ_ERRORS = (tarfile.TarError, OSError, EOFError, ValueError, RecursionError)
# The most bytes read of one member (`member_limit`). An image member: an uncompressed image of
# data.max_image_pixels pixels at 8 bytes a pixel (16-bit RGBA or CMYK, the widest PIL opens) plus
# room for metadata (ICC profile, EXIF, XMP). Any other member: the reader needs at most the label
# (a number, or a JSON record of a few kB), so 1 MiB; larger ones are left unread, which harms only
# a sample whose label it holds.
BYTES_PER_PIXEL = 8
IMAGE_METADATA_BYTES = 16 << 20
OTHER_MEMBER_BYTES = 1 << 20


def derive_seed(*parts: int) -> int:
    return int(np.random.SeedSequence(parts).generate_state(1, dtype=np.uint64)[0] & (2**63 - 1))


def shards_for(num_shards: int, epoch: int, seed: int, reader: int, readers: int) -> list[int]:
    """Shard ids read by one reader (rank * num_workers + worker) in one epoch."""
    order = list(range(num_shards))
    random.Random(derive_seed(seed, epoch)).shuffle(order)
    return order[reader::readers]


META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members, never part of a sample


def _is_sample_member(m: tarfile.TarInfo) -> bool:
    return m.isreg() and not META.match(m.name) and not ("/" not in m.name and m.name.startswith("__"))


@dataclass(frozen=True)
class UnreadMember:
    """The data of a member larger than its `member_limit`, in place of its bytes: its size, from
    the tar header. A sample whose image or label is one is skipped (`oversized_member`)."""
    size: int

    def __len__(self) -> int:  # as the bytes would be (data/index_shards.py counts members by size)
        return self.size


def member_limit(name: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> int:
    """The most bytes read of member `name` (an image member by its extension, as webdataset groups it)."""
    ext = (base_plus_ext(name)[1] or "").lower()
    return BYTES_PER_PIXEL * max_pixels + IMAGE_METADATA_BYTES if ext in IMAGE_KEYS else OTHER_MEMBER_BYTES


def tar_members(f: Path | PipeShard, with_data: bool, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Iterator[dict]:
    """Regular members of one tar in order, as webdataset's iterator gives them. Without data only
    the headers are read (the data is seeked over): the same members, so key-only replays see the
    same samples. A member whose data runs past the end of the file raises, as reading it would.
    A member over its `member_limit` (for data.max_image_pixels `max_pixels`) is not read: its data
    is an UnreadMember, decided from the header alone."""
    if isinstance(f, PipeShard):
        yield from pipe_members(f, max_pixels)
        return
    size = os.path.getsize(f)
    with tarfile.open(f, mode="r:") as tar:
        for m in tar:
            if not _is_sample_member(m):
                continue
            if m.offset_data + m.size > size:
                raise tarfile.ReadError(f"{f}: member {m.name} is cut short")
            if not with_data:
                data = None
            elif m.size > member_limit(m.name, max_pixels):
                data = UnreadMember(m.size)
            else:
                data = tar.extractfile(m).read()
            yield {"fname": m.name, "data": data, "__url__": str(f)}


def _streamed_data(tar: tarfile.TarFile, m: tarfile.TarInfo, max_pixels: int) -> bytes | UnreadMember:
    """A streamed member's bytes, or, over its `member_limit`, an UnreadMember once its data has been
    read through in small pieces (a stream cannot seek; a member cut short raises as a whole read would)."""
    f = tar.extractfile(m)
    if m.size <= member_limit(m.name, max_pixels):
        return f.read()
    while f.read(1 << 20):
        pass
    return UnreadMember(m.size)


def pipe_members(shard: PipeShard, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Iterator[dict]:
    """Members of the tar a shell command writes to stdout, read as a stream ("r|"). The data is
    always read, also for key-only replays: a stream cannot seek, and reading the data is how a
    member cut short shows, so both see the same samples (a member over its `member_limit` is read
    through and dropped, an UnreadMember). A command that exits with an error status ends the shard
    like a truncated tar."""
    proc = subprocess.Popen(shard.command, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for m in tar:
                if _is_sample_member(m):
                    yield {"fname": m.name, "data": _streamed_data(tar, m, max_pixels), "__url__": shard.url}
        proc.stdout.read()  # the archive's zero padding: left unread, the command could die of SIGPIPE
        if (status := proc.wait()) != 0:
            raise tarfile.ReadError(f"{shard.url}: the command exited with status {status}")
    finally:  # also when the reader ends early: no command left running
        proc.stdout.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def shard_samples(f: Path | PipeShard, errors: Counter, with_data: bool = True,
                  max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Iterator[dict]:
    """The samples of one tar (webdataset's grouping of members by key); a truncated tar ends
    early and is counted. `with_data=False` yields the same samples with keys only (`__key__`,
    `__url__`). max_pixels: data.max_image_pixels, which sets the largest image member read."""
    try:
        yield from group_by_keys(tar_members(f, with_data, max_pixels))
    except TAR_READ_ERRORS:
        errors["truncated_shard"] += 1


def raw_samples(files: list[Path | PipeShard], errors: Counter, with_data: bool = True,
                max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Iterator[dict]:
    """The samples of several tars in order (see `shard_samples`)."""
    for f in files:
        yield from shard_samples(f, errors, with_data, max_pixels)


def sample_id(raw: dict) -> str:
    """`<shard name>/<key>`: unique across a shard set even if keys repeat across shards."""
    return f"{shard_name(raw['__url__'])}/{raw['__key__']}"


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


def open_sample(sample: dict, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                labels: LabelKey | None = CLS) -> tuple[Image.Image, int | None, bytes]:
    """(lazily opened image: header read, pixels not decoded; label (None when `labels` is None:
    an unlabeled set, whose samples need no label); encoded bytes).
    Raise SampleError (a ValueError) naming the kind of a sample that cannot be used; an image of
    more than `max_pixels` pixels is refused from its header, before any decoding, and an image or
    label member left unread (an UnreadMember: over its `member_limit`) without a look."""
    key = next((k for k in IMAGE_KEYS if k in sample), None)
    if key is None:
        raise SampleError("missing_image")
    if labels is not None and not labels.present(sample):
        raise SampleError("missing_cls", f"no {labels.member} member")
    data = sample[key]
    if isinstance(data, UnreadMember):
        raise SampleError("oversized_member", f"the {key} member is {data.size:,} bytes, more than an image of "
                                              f"{max_pixels:,} pixels takes")
    if not data:
        raise SampleError("empty_image")
    label = read_label(labels, sample) if labels is not None else None
    try:
        with warnings.catch_warnings():  # PIL's warning for a large header: refused below, not noise in the log
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise SampleError("decompression_bomb") from None
    except DECODE_ERRORS as e:
        raise SampleError("undecodable_image", str(e)) from None
    if img.size[0] * img.size[1] > max_pixels:
        raise SampleError("decompression_bomb", f"{img.size[0]} x {img.size[1]} pixels")
    return img, label, data


def read_label(labels: LabelKey, sample: dict) -> int:
    """labels.read, or SampleError `oversized_member` when the label's member was too large to read."""
    value = sample[labels.member]
    if isinstance(value, UnreadMember):
        raise SampleError("oversized_member", f"the {labels.member} member is {value.size:,} bytes, over the "
                                              f"{OTHER_MEMBER_BYTES:,} read of a label")
    return labels.read(sample)


def decode(sample: dict, labels: LabelKey | None = CLS) -> tuple[Image.Image, int | None]:
    """(decoded image, label); raises like `open_sample`, or OSError when the pixels do not decode."""
    img, label, _ = open_sample(sample, labels=labels)
    img.load()
    return img, label


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

    Yields dicts with `image` (transform output), `label` (not in an unlabeled set: no key at all), and
    bookkeeping for the main process:
    `worker`, `epoch`, `pos` (the sample's position), `errors` and `converted` (this worker's
    skipped / converted sample counts since it started, ERROR_KINDS / CONVERTED_KINDS order).
    max_bad_fraction: give up past this fraction of unusable samples (data/faults.py; 1.0 = never).
    max_image_pixels: larger images are skipped from their header (`decompression_bomb`), and image
      members larger than `member_limit` from their tar header, unread (`oversized_member`).
    """

    def __init__(self, shards: ShardSet, transform: Callable, seed: int, rank: int, world: int, num_workers: int,
                 shuffle_buffer: int, start: StreamStart | None = None, worker_offset: int = 0,
                 keep: Callable[[str], bool] | None = None, max_bad_fraction: float = 1.0,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        super().__init__()
        self.keep = keep  # sample-key filter (a labeled split's part), applied before decoding
        self.shards, self.transform, self.seed = shards, transform, seed
        self.rank, self.world, self.num_workers = rank, world, max(1, num_workers)
        self.shuffle_buffer = shuffle_buffer
        self.start = start or StreamStart.fresh(self.num_workers)
        # DataLoader worker i plays stream (i + offset) mod W, so that after a resume the first
        # batch comes from the stream whose turn it was in the round-robin.
        self.worker_offset = worker_offset
        self.max_bad_fraction, self.max_image_pixels = max_bad_fraction, max_image_pixels

    def read_shards(self, ids: list[int], errors: Counter, with_data: bool,
                    budget: BadSampleBudget | None) -> Iterator[dict]:
        """The samples of shards `ids` in order; samples a tar does not deliver (its index count
        minus those read) are counted as lost, and a tar that ends short without an error as truncated."""
        for i in ids:
            f, expected, got, truncated = self.shards.files[i], self.shards.counts[i], 0, errors["truncated_shard"]
            for s in shard_samples(f, errors, with_data, self.max_image_pixels):
                got += 1
                yield s
            if got < expected:
                if errors["truncated_shard"] == truncated:  # cut between members: no read error to count
                    errors["truncated_shard"] += 1
                if budget is not None:
                    budget.lose(str(f), expected - got)

    def worker_samples(self, worker: int, errors: Counter, with_data: bool = True,
                       budget: BadSampleBudget | None = None) -> Iterator[tuple[int, int, dict]]:
        """(epoch, position in epoch, raw sample) for one worker, forever, from start_epoch."""
        reader, readers = self.rank * self.num_workers + worker, self.world * self.num_workers
        epoch = self.start.start_epoch
        # shards read whole with no sample the key filter keeps, while none ever had one: when they are
        # all of the index's, that part of the split is empty and every later epoch would be the same
        barren: set[int] | None = set() if self.keep is not None else None
        while True:
            done = self.start.consumed.get(epoch, Consumed())
            ids = [i for i in shards_for(len(self.shards.files), epoch, self.seed, reader, readers) if i not in done.shards]
            rng = random.Random(derive_seed(self.seed, epoch, self.rank, worker))
            read = raw_read = 0

            def counted(samples: Iterator[dict]) -> Iterator[dict]:
                nonlocal read, raw_read
                for s in samples:  # read: those the key filter keeps (this reader's part of a split)
                    raw_read += 1
                    read += self.keep is None or self.keep(s["__key__"])
                    yield s

            samples = counted(self.read_shards(ids, errors, with_data, budget))
            if done.samples:
                samples = (s for s in samples if sample_id(s) not in done.samples)
            for pos, s in enumerate(shuffled(samples, self.shuffle_buffer, rng)):
                yield epoch, pos, s
            if barren is not None and read:
                barren = None  # its part has samples: an epoch of shards without any is only an idle one
            elif barren is not None and ids and raw_read:
                barren.update(ids)
                if len(barren) == len(self.shards.files):  # the stream would wait forever
                    raise CorruptDataError(f"data reader rank {self.rank} worker {worker}: none of the samples of "
                                           f"the {len(barren)} shard(s) belongs to its part of the labeled split: "
                                           f"that part is empty; give it a larger share (e.g. mlomae.val_fraction), "
                                           f"or more samples")
            if ids and not raw_read:
                names = [str(self.shards.files[i]) for i in ids]
                raise CorruptDataError(f"data reader rank {self.rank} worker {worker}: none of its {len(ids)} shard(s) "
                                       f"delivered a sample in epoch {epoch}, e.g. {names[:3]}; fix or rewrite them "
                                       f"(data/write_shards.py). {verify_hint(self.shards.index)}")
            epoch += 1

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = ((info.id if info is not None else 0) + self.worker_offset) % self.num_workers
        errors: Counter = Counter()
        converted: Counter = Counter()
        budget = BadSampleBudget(self.max_bad_fraction, max(self.shards.counts), f"rank {self.rank} worker {worker}",
                                 self.shards.index)
        if Image.MAX_IMAGE_PIXELS is not None and self.max_image_pixels > Image.MAX_IMAGE_PIXELS:
            # PIL's own check is process-wide and would refuse (above 2x its limit) what the config allows
            Image.MAX_IMAGE_PIXELS = self.max_image_pixels
        last = tuple(self.start.last[worker])
        legacy_skip = self.start.legacy_skip[worker] if self.start.legacy_skip else 0
        replayed: Counter | None = None  # errors met while re-reading delivered samples are counted already
        takes_bytes = getattr(self.transform, "takes_bytes", False)
        labels = self.shards.labels
        for epoch, pos, raw in self.worker_samples(worker, errors, budget=budget):
            if (epoch, pos) <= last:  # delivered before the resume: re-read, not decoded
                continue
            if replayed is None:
                replayed = Counter(errors)
            if self.keep is not None and not self.keep(raw["__key__"]):
                continue
            seed = derive_seed(self.seed, epoch, self.rank, worker, pos)
            shard = raw["__url__"]
            budget.seen(shard)
            try:
                img, label, data = open_sample(raw, self.max_image_pixels, labels)
            except SampleError as e:
                errors[e.kind] += 1
                budget.skip(shard, e.kind)
                continue
            mode, fmt = img.mode, img.format  # from the header; decoding may change the mode (JPEG draft)
            try:  # the pixels are decoded here (at reduced size with cpu_draft; nvjpeg defers it)
                if legacy_skip > 0:  # an old-format position: decoded samples to drop
                    img.load()
                    legacy_skip -= 1
                    continue
                image = self.transform(img, seed, data) if takes_bytes else self.transform(img, seed)
            except (*DECODE_ERRORS, Image.DecompressionBombError) as e:  # PIL checks GIF frames as it decodes
                kind = "decompression_bomb" if isinstance(e, Image.DecompressionBombError) else "undecodable_image"
                errors[kind] += 1
                budget.skip(shard, kind)
                continue
            for kind in (conversion_kind(mode), format_kind(fmt)):
                if kind is not None:
                    converted[kind] += 1
            counts = torch.tensor([errors[k] - replayed[k] for k in ERROR_KINDS])
            sample = {"image": image, "worker": worker, "epoch": epoch, "pos": pos, "errors": counts,
                      "converted": torch.tensor([converted[k] for k in CONVERTED_KINDS])}
            yield sample if label is None else {**sample, "label": label}
