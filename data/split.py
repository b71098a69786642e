"""A labeled training set split into D_tr and D_val (MLO-MAE's levels I-II and III), and the
stream that feeds both.

The split is a pure function of each sample's key (webdataset's `__key__`):
    val  iff  blake2b(f"{seed}:{key}") read as a fraction in [0, 1)  <  val_fraction
so it does not depend on shard layout, world size, workers or order, needs no pass over the
data, and the two parts are disjoint and cover the index by construction. Only the training
index is ever split: the test split (a separate index) is read by no level. `describe` counts
both parts from the tar headers (no image is read) for the record in the run folder.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

import torch

from data.shard_index import ShardSet

from data.shards import raw_samples


@dataclass(frozen=True)
class LabeledSplit:
    val_fraction: float
    seed: int = 0

    def is_val(self, key: str) -> bool:
        digest = hashlib.blake2b(f"{self.seed}:{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < self.val_fraction

    def keep_train(self, key: str) -> bool:
        return not self.is_val(key)

    def describe(self, shards: ShardSet, index: str) -> dict:
        """Counts of both parts and a digest of the sorted D_val keys, from the tar headers only."""
        keys = sorted(shard_keys(shards))
        val = [k for k in keys if self.is_val(k)]
        return {
            "rule": "val iff int(blake2b('<seed>:<key>', digest_size=8), big-endian) / 2**64 < val_fraction",
            "seed": self.seed, "val_fraction": self.val_fraction, "train_index": index,
            "num_samples": len(keys), "num_train": len(keys) - len(val), "num_val": len(val),
            "val_keys_sha256": hashlib.sha256("\n".join(val).encode()).hexdigest(),
        }


def shard_keys(shards: ShardSet) -> Iterator[str]:
    """The sample keys of every shard, read from the tar headers (data is skipped)."""
    for raw in raw_samples(list(shards.files), Counter(), with_data=False):
        yield raw["__key__"]


class SplitSource:
    """Batches of D_tr (`image`, `label`) with a D_val batch (`val_image`, `val_label`) attached to
    every `val_every`-th one (1-based), from two loaders over the same shards. Its position is
    both loaders' positions; skipped-sample counters are summed."""

    def __init__(self, train, val, val_every: int):
        self.train, self.val, self.val_every = train, val, val_every
        self.batches = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self.train)
        self.batches += 1
        if self.batches % self.val_every == 0:
            v = next(self.val)
            batch = {**batch, "val_image": v["image"], "val_label": v["label"]}
        return batch

    def counters(self) -> dict[str, int]:
        if not hasattr(self.train, "counters"):
            return {}
        a, b = self.train.counters(), self.val.counters()
        return {k: a[k] + b[k] for k in a}

    def check_unusable(self, counters: dict[str, int]) -> None:
        """data.max_bad_fraction over the whole run (ShardLoader.check_unusable): both parts read
        the same shards, each its own samples (the key filter runs before decoding), so the summed
        counters stand against what both delivered. Nothing for synthetic images."""
        if hasattr(self.train, "check_unusable"):
            self.train.check_unusable(counters, self.train.delivered() + self.val.delivered())

    def state_dict(self) -> dict:
        return {"train": self.train.state_dict(), "val": self.val.state_dict(), "val_every": self.val_every,
                "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        if state["val_every"] != self.val_every:
            raise ValueError(f"the data position was recorded with a D_val batch every {state['val_every']} "
                             f"micro-batches, this run has {self.val_every}; resume with the same mlomae schedule "
                             f"and gradient accumulation")
        self.train.load_state_dict(state["train"])
        self.val.load_state_dict(state["val"])
        self.batches = int(state["batches"])

    def resume_from(self, states: list[dict]) -> None:
        """Every rank's position of a checkpointed run (rank order). Both streams continue
        (ShardLoader.resume_from, also on another world size); the micro-batch count is rescaled
        to this run's accumulation, so the D_val batch still closes each mask cycle."""
        self.train.resume_from([s["train"] for s in states])
        self.val.resume_from([s["val"] for s in states])
        batches, rest = divmod(states[0]["batches"] * self.val_every, states[0]["val_every"])  # equal on every rank
        if rest:
            raise ValueError("the checkpoint's D_val schedule does not map onto this run's gradient accumulation")
        self.batches = batches
