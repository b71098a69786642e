"""What can be wrong with a training sample or shard, and when a reader gives up.

Skipped samples, by kind (`ERROR_KINDS`, metrics `data_skipped_<kind>`):
  missing_image       no .jpg/.jpeg/.png member under the sample's key
  missing_cls         no .cls member
  bad_label           the .cls text is not an integer
  undecodable_image   the image bytes do not parse or decode
  truncated_shard     a tar that ends early or does not open (counted once per shard, not per sample)
  empty_image         a zero-byte image member
  decompression_bomb  more pixels than data.max_image_pixels (read from the header, before decoding)
New kinds are appended: checkpoints store the counts as a list in this order, and a shorter list
(written before a kind existed) is read with zeros for the missing kinds.

Converted samples are kept; `CONVERTED_KINDS` (data/image_modes.py) name what was done to them.

The give-up rule (data.max_bad_fraction): each reader (one rank's DataLoader worker) counts the
samples it examined (past the resume point and the key filter), those it skipped, and the
samples its truncated tars did not deliver (the index's count minus the samples read, "lost").
Once it has examined + lost at least as many samples as the index's largest shard holds, it raises
`CorruptDataError` as soon as (skipped + lost) / (examined + lost) > max_bad_fraction. The check
runs after every examined sample and every truncated shard; 1.0 never raises (bad <= total).
"""
from __future__ import annotations

from collections import Counter, defaultdict

ERROR_KINDS = ("missing_image", "missing_cls", "bad_label", "undecodable_image", "truncated_shard",
               "empty_image", "decompression_bomb")


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


def padded(counts: list[int], n: int) -> list[int]:
    """Counts saved before newer kinds existed, with zeros for those kinds."""
    return list(counts) + [0] * (n - len(counts))


class BadSampleBudget:
    """One reader's tally of examined / skipped / lost samples per shard, and the give-up rule above.

    max_fraction: data.max_bad_fraction; min_total: samples (examined + lost) before the rule applies.
    reader: how the error message names this reader (e.g. "rank 0 worker 1").
    """

    def __init__(self, max_fraction: float, min_total: int, reader: str):
        self.max_fraction, self.min_total, self.reader = max_fraction, max(1, min_total), reader
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
            lost = f"; {self.lost[s]} lost (tar ends early or does not open)" if self.lost[s] else ""
            lines.append(f"  {s}: {sum(self.skipped[s].values())} of {self.examined[s]} samples skipped"
                         f"{f' ({kinds})' if kinds else ''}{lost}")
        if len(shards) > 10:
            lines.append(f"  ... and {len(shards) - 10} more shard(s)")
        return (f"data reader {self.reader}: {self.bad} of {self.total} samples unusable "
                f"({self.bad / self.total:.1%}), above data.max_bad_fraction {self.max_fraction:g}. Shards:\n"
                + "\n".join(lines) + "\nFix or rewrite these shards (data/write_shards.py; --skip_bad leaves "
                "unreadable files out), or raise data.max_bad_fraction (1.0 disables this check).")
