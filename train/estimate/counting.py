"""Counting what makes a training step slow on a GPU, on any device: kernel launches and
collectives (a TorchDispatchMode) and host-device syncs (patched calls), each attributed to the
phase of the step it happened in (tools/census.py reports them).

  launches  every aten op that runs a device kernel: views, aliases, allocations and metadata
            changes are not kernels (NOT_KERNELS); a foreach or fused multi-tensor op counts once
            (on CUDA it launches one kernel per chunk of tensors). In a step with torch.compile'd
            graphs (`counting(tally, compiled=True)`): each kernel inductor generated counts once per
            launch (from the profiler), and each aten op a graph calls outside those kernels (extern
            kernels: matmuls, attention) as above
  comm      collectives (c10d ops), each also recorded with its elements and whether it was issued
            inside autograd's backward (while torch.autograd.backward / grad runs: DDP's bucket
            all-reduces, FSDP2's per-unit reduce-scatters and its end-of-backward callback) or outside
            it (a reduction issued after the backward returned cannot overlap it)
  syncs     calls that make the host wait for the device (SYNC_CALLS), wherever they are made: on
            CPU nothing waits, so each call is counted where it would wait on CUDA
Phases: data, forward, backward, step (the optimizer step), hook (the objective's after-step hook), loop
(the rest), marked by the loops through `Tally` as their phase marker.
"""
from __future__ import annotations

import bisect
import functools
import re
import sys
import threading
from collections import Counter, defaultdict
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = ("data", "forward", "backward", "step", "hook", "loop")
aten = torch.ops.aten
# Ops that change metadata or allocate without running a kernel (views are recognised by their schema)
NOT_KERNELS = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.resize_.default, aten._unsafe_view.default, aten.lift_fresh.default,
    aten.detach_.default, aten.set_.source_Storage, aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor, aten.set_.default, aten.as_strided_.default, aten.squeeze_.default,
    aten.squeeze_.dim, aten.unsqueeze_.default, aten.t_.default, aten.transpose_.default,
    aten._local_scalar_dense.default,  # .item(): a device-to-host read, counted as a sync
    aten.is_same_size.default, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
}
COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def _is_kernel(func) -> bool:
    if func.namespace == "profiler" or func in NOT_KERNELS:
        return False
    return not func.is_view


class Tally:
    """Counts by (step, phase): launches, comm, syncs, and the ops behind the launches."""

    def __init__(self):
        self.phase = "loop"
        self.step = 0  # optimizer steps begun
        self.micro = 0  # data phases begun in this step
        self.accum = 1
        self.counts: dict[tuple[int, str], Counter] = defaultdict(Counter)
        self.ops: dict[tuple[int, str], Counter] = defaultdict(Counter)
        self.syncs: list[tuple[int, str, str, str]] = []  # (step, phase, call, where)
        self.collectives: list[Collective] = []
        self.in_autograd = 0  # depth of torch.autograd.backward / grad calls running now
        self.profiled = False  # phases also marked for the profiler (counting compiled kernels)

    @contextmanager
    def __call__(self, name: str):
        """The phase marker the loops take (train/run/loop.py, tools/mae_baseline.py)."""
        if name == "data":
            if self.micro % self.accum == 0:
                self.step += 1
                self.micro = 0
            self.micro += 1
        outer, self.phase = self.phase, name
        try:
            with record_function(f"{PHASE_MARK}{self.step} {name}") if self.profiled else nullcontext():
                yield
        finally:
            self.phase = outer

    def add(self, kind: str, op: str = "", at: tuple[int, str] | None = None) -> None:
        """One `kind` in the current step and phase, or in `at` (step, phase)."""
        at = at or (self.step, self.phase)
        self.counts[at][kind] += 1
        if op:
            self.ops[at][op] += 1

    def per_step(self, step: int) -> dict[str, dict[str, int]]:
        """{phase: {"launches", "comm", "syncs"}} and "total" for one step."""
        out = {p: {k: self.counts[step, p][k] for k in ("launches", "comm", "syncs")} for p in PHASES}
        out["total"] = {k: sum(out[p][k] for p in PHASES) for k in ("launches", "comm", "syncs")}
        return out

    def top_ops(self, step: int, phase: str, n: int = 8) -> list[tuple[str, int]]:
        return self.ops[step, phase].most_common(n)


@dataclass
class Collective:
    step: int
    phase: str
    op: str  # e.g. c10d::_reduce_scatter_base_
    elements: int  # reduced (all-reduce, reduce-scatter: the input), gathered (all-gather: the output) or sent
    in_backward: bool  # issued while autograd's backward ran
    launches_before: int = 0  # kernels launched earlier in the same step and phase

    @property
    def reduces(self) -> bool:
        return "reduce" in self.op and "scatter" in self.op or "allreduce" in self.op or "all_reduce" in self.op


def _elements(func, args) -> int:
    """What a collective reduces (its input), gathers (its output) or otherwise moves."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    lists = [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
    name = func.name()
    if "reduce_scatter" in name and len(tensors) >= 2:
        return tensors[1].numel()  # (output, input)
    if "allgather" in name or "all_gather" in name:
        return (tensors or lists)[0].numel()  # the output
    return sum(t.numel() for t in tensors + lists)


class LaunchCounter(TorchDispatchMode):
    def __init__(self, tally: Tally):
        super().__init__()
        self.tally = tally

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile traces and compiles with the counter off (a mode it must respect would make
        it run the graph eagerly, or refuse a fullgraph one) and runs the compiled graph with it on:
        the graph's extern aten calls are counted here, its fused kernels never reach the dispatcher
        (counting_compiled_kernels counts them)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in COMM_NAMESPACES:
            self.tally.add("comm", func.name())
            self.tally.collectives.append(Collective(self.tally.step, self.tally.phase, func.name(),
                                                     _elements(func, args), self.tally.in_autograd > 0,
                                                     self.tally.counts[self.tally.step, self.tally.phase]["launches"]))
            if self.tally.profiled:  # the compiled kernels launched before it are known after the run
                with record_function(f"{COLLECTIVE_MARK}{len(self.tally.collectives) - 1}"):
                    return func(*args, **(kwargs or {}))
        elif _is_kernel(func):
            self.tally.add("launches", func.name())
        return func(*args, **(kwargs or {}))


# --- kernels inductor generated (torch.compile) --------------------------------------------------
PHASE_MARK = "census phase: "  # the profiler range of a phase: "census phase: <step> <phase>"
COLLECTIVE_MARK = "census collective: "  # the range of a collective: "census collective: <index in Tally.collectives>"
GRAPH_CALL = "## Call CompiledFxGraph"  # the profiler range inductor opens around each call of a compiled graph
GRAPH_PREFIX = re.compile(r"^graph_\d+_")  # a C++ kernel's event: graph_<graph>_<kernel>


def kernels_profiled():
    """While active, inductor compiles its C++ kernels so that each launch records a profiler event
    (inductor's Triton launcher records one whenever the profiler runs); kernels compiled before
    stay silent, so compile under it."""
    import torch._inductor.config  # a second to import: only where a compiled step is counted

    return torch._inductor.config.patch({"cpp.enable_kernel_profile": True})


def _is_compiled_kernel(event) -> bool:
    """A launch of a kernel inductor generated: a range directly inside a compiled graph's call that is
    not a dispatcher op (the graph's aten calls, its extern kernels, reach the LaunchCounter)."""
    parent = event.cpu_parent
    return parent is not None and parent.name.startswith(GRAPH_CALL) and "::" not in event.name


def _step_and_phase(mark: str) -> tuple[int, str]:
    step, phase = mark[len(PHASE_MARK):].split(" ")
    return int(step), phase


def _marked(event) -> tuple[int, str] | None:
    """(step, phase) of the innermost phase range around `event`; None outside every phase."""
    while event is not None and not event.name.startswith(PHASE_MARK):
        event = event.cpu_parent
    return None if event is None else _step_and_phase(event.name)


@contextmanager
def counting_compiled_kernels(tally: Tally):
    """Each launch of a kernel inductor generated, as a launch of the phase it ran in (under the
    profiler: phases marked as ranges; a launch outside every phase is the loop's, in the step of
    the last phase begun before it), and in `launches_before` of the collectives of that phase
    issued after it. Its name in the ops: `inductor::` and the kernel's name."""
    tally.profiled = True
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
    finally:
        tally.profiled = False
    events = prof.events()
    begun = sorted((e.time_range.start, _step_and_phase(e.name)[0]) for e in events if e.name.startswith(PHASE_MARK))
    issued = [(tally.collectives[int(e.name[len(COLLECTIVE_MARK):])], e.time_range.start)
              for e in events if e.name.startswith(COLLECTIVE_MARK)]
    for event in events:
        if not _is_compiled_kernel(event):
            continue
        at = _marked(event)
        if at is None:
            last = bisect.bisect_right(begun, (event.time_range.start, sys.maxsize)) - 1
            at = (begun[last][1] if last >= 0 else tally.step, "loop")
        tally.add("launches", "inductor::" + GRAPH_PREFIX.sub("", event.name), at)
        for collective, start in issued:
            if (collective.step, collective.phase) == at and start > event.time_range.start:
                collective.launches_before += 1


@contextmanager
def marking_autograd(tally: Tally):
    """Count the depth of torch.autograd.backward / grad calls (Tensor.backward calls the first)."""
    def marked(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            tally.in_autograd += 1
            try:
                return fn(*args, **kwargs)
            finally:
                tally.in_autograd -= 1
        return call

    with mock.patch.object(torch.autograd, "backward", marked(torch.autograd.backward)), \
            mock.patch.object(torch.autograd, "grad", marked(torch.autograd.grad)):
        yield


# --- host-device syncs -------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[2]
OURS = tuple(REPO / d for d in ("train", "model", "data", "kernels", "tools"))


@functools.lru_cache(maxsize=None)
def _where(filename: str) -> str | None:
    """A frame's file as shown: ours relative to the repository, a library's from its package; None
    for torch's own files (skipped to the frame that called torch)."""
    path = Path(filename).resolve()
    if any(path.is_relative_to(d) for d in OURS):
        return str(path.relative_to(REPO))
    parts = path.parts
    if "site-packages" in parts:
        rel = parts[parts.index("site-packages") + 1:]
        return None if rel[0] == "torch" else "/".join(rel)
    return None if "torch" in parts else path.name


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


# Tensor methods / torch functions that read a device value on the host or need a data-dependent
# shape (the host waits for the device), with the test that makes a call one (None: always).
SYNC_METHODS = {name: None for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu",
                                        "numpy", "__array__", "nonzero", "argwhere", "masked_select", "unique")}
SYNC_METHODS["__getitem__"] = lambda self, index: _bool_index(index)
SYNC_METHODS["__setitem__"] = lambda self, index, value: _bool_index(index)
SYNC_METHODS["repeat_interleave"] = lambda self, repeats, *a, **k: (isinstance(repeats, torch.Tensor)
                                                                    and k.get("output_size") is None)
SYNC_FUNCTIONS = {name: None for name in ("nonzero", "argwhere", "masked_select", "unique")}
SYNC_FUNCTIONS["where"] = lambda *args, **kwargs: len(args) + len(kwargs) == 1
# host values copied to a device: on CUDA a copy from pageable memory that waits for the stream
# (model/constants.py makes such constants once, without waiting)
SYNC_FUNCTIONS["tensor"] = SYNC_FUNCTIONS["as_tensor"] = lambda *args, **kwargs: kwargs.get("device") is not None
SYNC_FUNCTIONS["repeat_interleave"] = lambda x, repeats=None, *a, **k: (isinstance(repeats, torch.Tensor)
                                                                        and k.get("output_size") is None)
SYNC_CALLS = (*(f"Tensor.{m}" for m in SYNC_METHODS), *(f"torch.{f}" for f in SYNC_FUNCTIONS),
              "torch.cuda.synchronize", "Stream.synchronize", "Event.synchronize", "accelerator.synchronize",
              "dist.barrier")
# torch.optim's read of a host-side `step` tensor (AdamW without fused / capturable): host memory on CUDA too
_HOST_SCALAR_READ = None


def _host_scalar_read():
    global _HOST_SCALAR_READ
    if _HOST_SCALAR_READ is None:
        from torch.optim.optimizer import _get_value
        _HOST_SCALAR_READ = _get_value.__code__
    return _HOST_SCALAR_READ


@dataclass
class SyncRecord:
    what: str  # the call
    where: str  # file:line (function) of the innermost frame outside torch
    phase: str
    step: int


@dataclass
class SyncCounter:
    """Every sync call made while `counting_syncs` is active, with where it was made."""
    tally: Tally | None = None
    records: list[SyncRecord] = field(default_factory=list)

    def __post_init__(self):
        self._inside = threading.local()

    def record(self, what: str) -> None:
        frame = sys._getframe(2)  # the caller of the patched function
        if frame.f_code is _host_scalar_read():
            return
        where = "?"
        while frame is not None:
            shown = _where(frame.f_code.co_filename)
            if shown is not None:
                where = f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})"
                break
            frame = frame.f_back
        phase, step = (self.tally.phase, self.tally.step) if self.tally else ("", 0)
        self.records.append(SyncRecord(what, where, phase, step))
        if self.tally is not None:
            self.tally.add("syncs")

    def wrap(self, what: str, fn, counts=None):
        """`fn`, counted when called from outside another counted call and `counts(*args)` (if
        given) says its arguments make it a sync."""
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if getattr(self._inside, "on", False):
                return fn(*args, **kwargs)
            if counts is None or counts(*args, **kwargs):
                self.record(what)
            self._inside.on = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside.on = False
        return counted


@contextmanager
def counting_syncs(tally: Tally | None = None):
    """Patch every call of SYNC_CALLS with a counter (yielded)."""
    counter = SyncCounter(tally)
    patches = [(torch.Tensor, name, f"Tensor.{name}", counts) for name, counts in SYNC_METHODS.items()]
    patches += [(torch, name, f"torch.{name}", counts) for name, counts in SYNC_FUNCTIONS.items()]
    patches += [(torch.cuda, "synchronize", "torch.cuda.synchronize", None),
                (torch.cuda.Stream, "synchronize", "Stream.synchronize", None),
                (torch.cuda.Event, "synchronize", "Event.synchronize", None),
                (torch.distributed, "barrier", "dist.barrier", None)]
    try:  # DeepSpeed's accelerator, where it is installed and imported
        import deepspeed

        patches.append((type(deepspeed.get_accelerator()), "synchronize", "accelerator.synchronize", None))
    except ImportError:
        pass
    with ExitStack() as stack:
        for owner, name, label, counts in patches:
            stack.enter_context(mock.patch.object(owner, name, counter.wrap(label, getattr(owner, name), counts)))
        yield counter


@contextmanager
def counting(tally: Tally, compiled: bool = False):
    """Launches, collectives and syncs into `tally` while active; `compiled`: the step runs graphs
    compiled under `kernels_profiled`, whose fused kernels are counted too."""
    with counting_syncs(tally) as syncs, marking_autograd(tally), LaunchCounter(tally), \
            counting_compiled_kernels(tally) if compiled else nullcontext():
        yield syncs
