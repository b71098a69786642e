"""What torch.compile did in a run with `run.compile` (every ViT block compiled: model/vit.py
`Block.compile_static`), read from dynamo's own counters at the loop's log steps.

Every block graph of a run is compiled in its first step: one per block shape (the encoder's, the
MAE decoder's) and grad mode. A graph compiled later is a recompile (a new token count or width,
a changed guard), which costs seconds of compile time each and, past dynamo's recompile limit (8
graphs of one code object), stops the run: the blocks compile with `fullgraph`, which makes that
limit an error rather than a fallback to eager. Each log line therefore carries `compiled_graphs`,
and a rise after the first read is a warning naming the step. Evaluation and figures run the blocks eagerly
(`eager_blocks`), so they add no graphs. The compile cache: docs/TRAINING.md.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch._dynamo.utils import compilation_time_metrics, counters

log = logging.getLogger("pretrain")
# dynamo's timers of a graph's compilation: the forward (trace, AOTAutograd, inductor) and the
# backward graph, which inductor compiles when the first backward reaches it
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far."""
    return int(counters["stats"].get("unique_graphs", 0))


def graph_breaks() -> int:
    return int(sum(counters["graph_break"].values()))


def compile_seconds() -> float:
    return float(sum(sum(compilation_time_metrics.get(name, [])) for name in COMPILE_TIMERS))


class CompileWatch:
    """Reads the counters at every log step of a compiled run: the first read reports what the
    first steps compiled, later reads warn about graphs compiled since."""

    def __init__(self) -> None:
        self.start_graphs, self.start_seconds = compiled_graphs(), compile_seconds()
        self.graphs: int | None = None  # at the last read
        self.last_step = 0

    def read(self, step: int, quiet: bool) -> dict[str, int]:
        """{"compiled_graphs": graphs this run compiled so far}; logs on rank 0 unless `quiet`."""
        graphs = compiled_graphs() - self.start_graphs
        if not quiet and self.graphs is None:
            log.info("run.compile: %d block graphs compiled in %.1f s by step %d (inductor's cache: "
                     "docs/TRAINING.md), %d graph breaks", graphs, compile_seconds() - self.start_seconds, step,
                     graph_breaks())
        elif not quiet and graphs > self.graphs:
            log.warning("run.compile: %d block graphs compiled between steps %d and %d, after the first steps (a "
                        "recompile: a new shape or guard; rerun with TORCH_LOGS=recompiles to see why)",
                        graphs - self.graphs, self.last_step, step)
        self.graphs, self.last_step = graphs, step
        return {"compiled_graphs": graphs}


@contextlib.contextmanager
def eager_blocks() -> Iterator[None]:
    """Compiled blocks run eagerly inside (evaluation, figures: no_grad passes over batches of any
    size, which would otherwise compile graphs of their own)."""
    with torch.compiler.set_stance("force_eager"):
        yield
