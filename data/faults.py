"""What can be wrong with a training sample or shard, and when a reader gives up.

Skipped samples, by kind (`ERROR_KINDS`, metrics `data_skipped_<kind>`):
  missing_image       no image member (data/shards.py IMAGE_KEYS: jpg, png, webp, ...) under the sample's key
  missing_cls         in a labeled set: no label under its label key (the .cls member by default;
                      json:FIELD: the json member or its field; data/labels.py)
  bad_label           the label is not an integer
  undecodable_image   the image bytes do not parse or decode
  truncated_shard     a tar that ends early or does not open (counted once per shard, not per sample)
  empty_image         a zero-byte image member
  decompression_bomb  more pixels than data.max_image_pixels (read from the header, before decoding)
  oversized_member    an image or label member larger than any usable one can be (data/shards.py
                      member_limit: for an image, 8 bytes a pixel of data.max_image_pixels plus 16 MiB;
                      for a label, 1 MiB), judged from its tar header: never read
New kinds are appended: checkpoints store the counts as a list in this order, and a shorter list
(written before a kind existed) is read with zeros for the missing kinds.

Converted samples are kept; `CONVERTED_KINDS` (data/image_modes.py) name what was done to them.

The give-up rule (data.max_bad_fraction): each reader (one rank's DataLoader worker) counts the
samples it examined (past the resume point and the key filter), those it skipped, and the
samples its truncated tars did not deliver (the index's count minus the samples read, "lost").
Once it has examined + lost at least as many samples as the index's largest shard holds, it raises
`CorruptDataError` as soon as (skipped + lost) / (examined + lost) > max_bad_fraction. The check
runs after every examined sample and every truncated shard; 1.0 never raises (bad <= total).
The message names the worst shards and how to list every bad one at once (`verify_hint`); a
reader in a DataLoader worker raises it there, and data/loader.py re-raises it in the training
process with that message alone (no worker traceback), so the run ends with one clear message.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import ClassVar

ERROR_KINDS = ("missing_image", "missing_cls", "bad_label", "undecodable_image", "truncated_shard",
               "empty_image", "decompression_bomb", "oversized_member")


class SampleError(ValueError):
    """A sample that cannot be used; `kind` is one of ERROR_KINDS. A ValueError, so callers that
    skip (KeyError, OSError, ValueError) keep skipping it."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class CorruptDataError(RuntimeError):
    """Too many unusable samples: the shards need fixing. Takes one message argument, so PyTorch's
    DataLoader re-raises it in the main process with its class and message."""


class ShardIndexError(ValueError):
    """A shard index that cannot be read from: empty, malformed, or naming shards it may not open."""


@dataclass
class Tally:
    """A count and its first MAX_EXAMPLES examples ("<where>: <why>"): files a writer rejected,
    samples an indexer could not index."""

    count: int = 0
    examples: list[str] = field(default_factory=list)
    MAX_EXAMPLES: ClassVar[int] = 20

    def add(self, where, why: str) -> None:
        self.count += 1
        if len(self.examples) < self.MAX_EXAMPLES:
            self.examples.append(f"{where}: {why}")

    def merge(self, other: Tally) -> None:
        self.count += other.count
        self.examples += other.examples[: self.MAX_EXAMPLES - len(self.examples)]

    def as_json(self) -> dict:
        return {"count": self.count, "examples": self.examples}


def verify_hint(index) -> str:
    """How to list every bad shard of `index` (the shard index's path; None: not known) without
    training, and how to refuse them before a run starts (data/verify.py)."""
    where = str(index) if index else "<shard index>"
    return (f"List every bad shard at once (headers only, in seconds): python -m data.verify {where}; "
            f"--data.verify_shards true runs that check before a run starts.")


def big_image_hint(kinds) -> str:
    """For readers that skipped decompression_bomb samples (`kinds`: the kinds skipped): images over
    data.max_image_pixels are often valid large photos, whose fix is a larger limit, not new shards."""
    if "decompression_bomb" not in kinds:
        return ""
    return ("decompression_bomb samples are images over data.max_image_pixels: if they are valid large images, raise "
            "it (--data.max_image_pixels N, N at least their width x height) rather than rewriting the shards. ")


def padded(counts: list[int], n: int) -> list[int]:
    """Counts saved before newer kinds existed, with zeros for those kinds."""
    return list(counts) + [0] * (n - len(counts))


class BadSampleBudget:
    """One reader's tally of examined / skipped / lost samples per shard, and the give-up rule above.

    max_fraction: data.max_bad_fraction; min_total: samples (examined + lost) before the rule applies.
    reader: how the error message names this reader (e.g. "rank 0 worker 1").
    index: the shard index read (named in the message's `python -m data.verify` hint), if known.
    """

    def __init__(self, max_fraction: float, min_total: int, reader: str, index=None):
        self.max_fraction, self.min_total, self.reader = max_fraction, max(1, min_total), reader
        self.index = index
        self.total = self.bad = 0
        self.examined: Counter = Counter()  # shard -> samples examined
        self.skipped: dict[str, Counter] = defaultdict(Counter)  # shard -> kind -> samples skipped
        self.lost: Counter = Counter()  # shard -> samples its tar did not deliver

    def seen(self, shard: str) -> None:
        self.examined[shard] += 1
        self.total += 1
        self.check()

    def skip(self, shard: str, kind: str) -> None:
        """A sample already `seen` was skipped."""
        self.skipped[shard][kind] += 1
        self.bad += 1
        self.check()

    def lose(self, shard: str, n: int) -> None:
        self.lost[shard] += n
        self.total += n
        self.bad += n
        self.check()

    def check(self) -> None:
        if self.bad > self.max_fraction * self.total and self.total >= self.min_total:
            raise CorruptDataError(self.message())

    def message(self) -> str:
        shards = sorted(set(self.skipped) | set(self.lost),
                        key=lambda s: -(sum(self.skipped[s].values()) + self.lost[s]))
        lines = []
        for s in shards[:10]:
            kinds = ", ".join(f"{k} {n}" for k, n in self.skipped[s].most_common())
            parts = [(f"{sum(self.skipped[s].values())} of {self.examined[s]} samples skipped"
                      f"{f' ({kinds})' if kinds else ''}")] if self.skipped[s] else []
            if self.lost[s]:  # a shard that only lost samples has nothing skipped to say
                parts.append(f"{self.lost[s]} samples lost (the tar ends early or does not open)")
            lines.append(f"  {s}: {'; '.join(parts)}")
        if len(shards) > 10:
            lines.append(f"  ... and {len(shards) - 10} more shard(s)")
        return (f"data reader {self.reader}: {self.bad} of {self.total} samples unusable "
                f"({self.bad / self.total:.1%}), above data.max_bad_fraction {self.max_fraction:g}. Shards:\n"
                + "\n".join(lines) + "\nFix or rewrite these shards (data/write_shards.py; --skip_bad leaves "
                "unreadable files out), or raise data.max_bad_fraction (1.0 disables this check). "
                + big_image_hint({k for kinds in self.skipped.values() for k, n in kinds.items() if n})
                + verify_hint(self.index))
