"""Progress of work that takes more than a few seconds (shard writing, indexing, verification,
feature extraction, kNN, probes, benchmarks): a tqdm bar when stderr is a terminal; otherwise (a
log file, a Slurm job, a pipe) one line at least every `LINE_EVERY_S` seconds, and a last line when
anything was said, so a log never goes quiet for long and never fills with a bar's redraws.

    with Progress("decoding test split", total=len(batches), unit="batch") as progress:
        for batch in batches:
            ...
            progress.update()
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Iterator, TextIO, TypeVar

LINE_EVERY_S = 30.0
T = TypeVar("T")
R = TypeVar("R")


def seconds(s: float) -> str:
    """A duration as people read it: 45 s, 2.5 min, 17.8 h."""
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


class Progress:
    """Counts work done of `total` (None: unknown); a bar on a terminal, else timed lines."""

    def __init__(self, what: str, total: int | None = None, unit: str = "it", stream: TextIO | None = None,
                 every_s: float = LINE_EVERY_S, clock: Callable[[], float] = time.monotonic, initial: int = 0,
                 leave: bool = False):
        self.what, self.total, self.unit, self.every_s, self.clock = what, total, unit, every_s, clock
        self.stream = stream if stream is not None else sys.stderr
        self.initial = self.done = initial  # work done before (a resumed run): not in the rate
        self.start = clock()
        self.last_line = self.start
        self.said = False  # a line was printed: the last one is printed too
        self.postfix: dict[str, str] = {}
        self.bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=what, unit=unit, file=self.stream, dynamic_ncols=True,
                            leave=leave)

    def line(self) -> str:
        elapsed, new = self.clock() - self.start, self.done - self.initial
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        if self.total:
            left = elapsed / new * (self.total - self.done) if new else None
            eta = f", about {seconds(left)} left" if left is not None and self.done < self.total else ""
            return (f"{self.what}: {self.done}/{self.total} {self.unit} ({100 * self.done / self.total:.0f}%), "
                    f"{seconds(elapsed)}{eta}{extra}")
        return f"{self.what}: {self.done} {self.unit}, {seconds(elapsed)}{extra}"

    def set_postfix(self, **values: str) -> None:
        """Values shown beside the count (the bar's postfix; in each line)."""
        self.postfix = values
        if self.bar is not None:
            self.bar.set_postfix(**values)

    def write(self, text: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = self.clock()
        if now - self.last_line >= self.every_s:
            self.say()
            self.last_line = now

    def say(self) -> None:
        print(self.line(), file=self.stream, flush=True)
        self.said = True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.said:
            self.say()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(items: Iterable[T], what: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """`items`, counted by a Progress as they are taken."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with Progress(what, total, unit) as p:
        for item in items:
            yield item
            p.update()


def mapped(fn: Callable[[T], R], jobs: list[T], workers: int, what: str, unit: str = "shards",
           chunksize: int = 1) -> list[R]:
    """[fn(job) for job in jobs], in order, by `workers` processes (1: in this one), counted by a Progress."""
    out: list[R] = []
    with Progress(what, len(jobs), unit) as p:
        if workers <= 1:
            for job in jobs:
                out.append(fn(job))
                p.update()
            return out
        with ProcessPoolExecutor(workers) as pool:
            for result in pool.map(fn, jobs, chunksize=chunksize):
                out.append(result)
                p.update()
    return out
