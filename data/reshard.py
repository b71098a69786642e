"""Continue a shard stream on another number of readers (world size or workers per rank changed).

A checkpoint records, for every reader (rank x worker) of the run that wrote it, the position
(epoch, pos) of the last sample it delivered. A reader's stream is a pure function of (index,
seed, world, workers, shuffle buffer), so what it delivered can be listed again from the tar
headers alone, without reading image data: in epochs before its current one, all of its shards;
in its current epoch, the first pos + 1 samples of its shuffled stream. The new readers start at
the oldest epoch any old reader was still in and skip exactly those samples, so within the
epochs in flight no sample is repeated or skipped (up to a shard cut short mid-member, which
reading and header scans may count differently); later epochs are read as usual.

Positions after such a change count samples of the new, filtered streams, so the layout that
defines the filter stays in the loader's state and is applied again at every later resume (a
chain, if the world changes again). Each new rank lists only the samples of its own shards.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

from data.shard_index import ShardSet

from data.shards import Consumed, ShardStream, StreamStart, sample_id, shards_for


@dataclass(frozen=True)
class ReaderLayout:
    """The readers of a checkpointed run and how far each got."""
    seed: int
    world: int
    num_workers: int
    shuffle_buffer: int
    last: tuple[tuple[int, int], ...]  # per reader (rank * num_workers + worker): (epoch, pos)
    start_epoch: int = 0  # where these readers' streams began
    previous: "ReaderLayout | None" = None  # the layout whose samples these readers skipped

    @property
    def workers(self) -> int:
        """Readers per rank: num_workers 0 reads in the rank's own process, as one reader."""
        return max(1, self.num_workers)

    @property
    def readers(self) -> int:
        return self.world * self.workers

    def to_dict(self) -> dict:
        return {"seed": self.seed, "world": self.world, "num_workers": self.num_workers,
                "shuffle_buffer": self.shuffle_buffer, "last": [list(p) for p in self.last],
                "start_epoch": self.start_epoch, "previous": self.previous.to_dict() if self.previous else None}

    @classmethod
    def from_dict(cls, d: dict | None) -> "ReaderLayout | None":
        if d is None:
            return None
        return cls(d["seed"], d["world"], d["num_workers"], d["shuffle_buffer"], tuple(tuple(p) for p in d["last"]),
                   d["start_epoch"], cls.from_dict(d["previous"]))

    @classmethod
    def from_states(cls, states: list[dict]) -> "ReaderLayout":
        """The layout of a run from its ranks' loader states (ShardLoader.state_dict, rank order)."""
        first = states[0]
        for key in ("seed", "shuffle_buffer", "num_workers", "start_epoch"):
            if any(s[key] != first[key] for s in states):
                raise ValueError(f"the ranks' data positions disagree on {key}; the checkpoint is inconsistent")
        last = tuple(tuple(p) for s in states for p in s["last"])
        return cls(first["seed"], len(states), first["num_workers"], first["shuffle_buffer"], last,
                   first["start_epoch"], cls.from_dict(first["layout"]))


def consumed(layout: ReaderLayout, shards: ShardSet,
             wanted: Callable[[int], set[int]] | None = None) -> tuple[int, dict[int, Consumed]]:
    """(first epoch not finished by every old reader, what the old readers delivered per epoch from
    then on). `wanted(epoch)`: the shard ids the asking rank will read; single samples of other
    shards are left out of the answer (whole shards are cheap to list and always included)."""
    every = set(range(len(shards.files)))
    wanted = wanted or (lambda epoch: every)
    names = [f.name for f in shards.files]
    start = min(epoch for epoch, _ in layout.last)
    # what these readers themselves skipped: needed in full to replay their streams exactly
    _, earlier = consumed(layout.previous, shards) if layout.previous else (0, {})
    out: dict[int, Consumed] = {}
    for epoch, c in earlier.items():
        if epoch >= start:
            keep = {names[i] for i in wanted(epoch)}
            out[epoch] = Consumed(set(c.shards), {s for s in c.samples if s.split("/", 1)[0] in keep})
    for reader, (epoch_now, pos) in enumerate(layout.last):
        rank, worker = divmod(reader, layout.workers)
        for epoch in range(start, epoch_now):  # epochs this reader finished: all of its shards
            out.setdefault(epoch, Consumed()).shards.update(
                shards_for(len(names), epoch, layout.seed, reader, layout.readers))
        own = set(shards_for(len(names), epoch_now, layout.seed, reader, layout.readers))
        if pos < 0 or not own & wanted(epoch_now):
            continue
        keep = {names[i] for i in wanted(epoch_now)}
        stream = ShardStream(shards, None, layout.seed, rank, layout.world, layout.num_workers,
                             layout.shuffle_buffer, StreamStart([], epoch_now, earlier))
        done = out.setdefault(epoch_now, Consumed())
        for epoch, p, raw in stream.worker_samples(worker, Counter(), with_data=False):  # tar headers only
            if epoch != epoch_now or p > pos:
                break
            if (sid := sample_id(raw)).split("/", 1)[0] in keep:
                done.samples.add(sid)
    return start, out
