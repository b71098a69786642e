"""Where a training step's time goes, from torch.profiler: the GPU kit's attribution of one variant
(tools/phases/bench.py), for ours, DeepSpeed's engine or the plain-PyTorch baseline alike.

`attribution(subject, steps, device, trace, compiled)` runs `steps` optimizer steps of a
tools/census.py Subject under the profiler (after WARMUP_STEPS unprofiled ones, COMPILED_WARMUP_STEPS
with run.compile), each phase of a step (data, forward, backward, step, hook) inside a
`record_function` range, and summarises:
  host_ms_per_step     the host's time inside the phases per step: what it needs to issue a step
  device_busy_fraction the union of the device's kernel and copy intervals over the profiled
                       window (from the first phase's start to the last device activity's end)
  kernels_per_step     device kernels (CUDA) per step; on CPU the top-level aten ops
  top_kernels          the 15 with the most device time (CPU: self CPU time): name, ms, count
  longest_gaps         the 5 longest stretches with no device activity (CUDA), with the kernels
                       on either side
  cuda_syncs_per_step  the host-device syncs PyTorch reports in the steps, with the Python line
                       of each (CUDA: torch.cuda.set_sync_debug_mode("warn"), one more run of
                       `steps` steps, unprofiled, whose last step reads the log window: 1 sync)
and, when `trace` is given, writes the Chrome trace gzipped there if it stays under 16 MiB.
"""
from __future__ import annotations

import contextlib
import gzip
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from train.run.loop import no_phases

PHASE_PREFIX = "phase:"
TRACE_LIMIT = 16 * 2**20
WARMUP_STEPS = 1  # eager: the allocator's first blocks, cuDNN / cuBLAS heuristics, Triton's autotuning
# run.compile replays the blocks as CUDA graphs (torch.compile's "reduce-overhead", model/vit.py):
# cudagraph trees run a graph's first call as a warm-up, record it on the second and replay it from
# the third. With one warm-up step the profiled window would hold the recording (a step of copies
# into the graphs' pool); 3 leave inductor's compile, the recording and a first replay out of it
COMPILED_WARMUP_STEPS = 3


def _marker(name: str) -> contextlib.AbstractContextManager:
    return record_function(PHASE_PREFIX + name)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def attribution(subject, steps: int, device: torch.device, trace: Path | None = None, compiled: bool = False) -> dict:
    """The summary of the module docstring for `steps` steps of `subject`, after the warm-up steps
    (`compiled`: the subject runs run.compile's blocks, whose CUDA graphs need more of them)."""
    cuda = device.type == "cuda"
    subject.run(no_phases, COMPILED_WARMUP_STEPS if compiled else WARMUP_STEPS)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        subject.run(_marker, steps)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.events()
    phases = [e for e in events if e.name.startswith(PHASE_PREFIX)]
    host_us = sum(e.time_range.elapsed_us() for e in phases)
    by_phase: dict[str, float] = defaultdict(float)
    for e in phases:
        by_phase[e.name[len(PHASE_PREFIX):]] += e.time_range.elapsed_us() / steps / 1e3
    out = {"steps": steps, "wall_ms_per_step": wall / steps * 1e3, "host_ms_per_step": host_us / steps / 1e3,
           "host_ms_per_phase": dict(by_phase)}
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = _merge([(e.time_range.start, e.time_range.end) for e in kernels])
        window = (min(e.time_range.start for e in phases), max([b for _, b in busy] or [0]))
        out["device_busy_fraction"] = sum(b - a for a, b in busy) / max(1.0, window[1] - window[0])
        out["kernels_per_step"] = len(kernels) / steps
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for e in kernels:
            totals[e.name][0] += e.time_range.elapsed_us()
            totals[e.name][1] += 1
        ordered = sorted(kernels, key=lambda e: e.time_range.start)
        gaps = [(b.time_range.start - a.time_range.end, a.name, b.name) for a, b in zip(ordered, ordered[1:])]
        out["longest_gaps"] = [{"us": round(g, 1), "after": a[:80], "before": b[:80]}
                               for g, a, b in sorted(gaps, reverse=True)[:5]]
    else:
        top = [e for e in events if e.name.startswith("aten::") and (e.cpu_parent is None or
                                                                    not e.cpu_parent.name.startswith("aten::"))]
        out["device_busy_fraction"] = None  # the CPU runs the kernels itself
        out["kernels_per_step"] = len(top) / steps
        totals = defaultdict(lambda: [0.0, 0])
        for e in top:
            totals[e.name][0] += e.self_cpu_time_total
            totals[e.name][1] += 1
    out["top_kernels"] = [{"name": name[:120], "ms": round(us / 1e3, 3), "count": n}
                          for name, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:15]]
    if trace is not None:
        out["trace"] = _write_trace(prof, trace)
    if cuda:
        out.update(cuda_syncs(subject, steps))
    return out


SYNC_MESSAGE = "called a synchronizing CUDA operation"  # PyTorch's warning for each sync (its debug mode)


def cuda_syncs(subject, steps: int) -> dict:
    """Syncs PyTorch's sync debug mode reports while `subject` runs `steps` steps, with the line of
    Python that issued each. The steps include one log read, by design (the loop's metrics window,
    read at the last step: one sync per `log_every` steps in a run)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            subject.run(no_phases, steps)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = sync_sites(caught)
    return {"cuda_syncs_per_step": len(sites) / steps, "cuda_sync_sites": sites[:10]}


def sync_sites(caught: list) -> list[str]:
    """file:line of each recorded sync warning; the debug mode's notice that it is a prototype (a
    warning too, once per process) is not a sync."""
    return [f"{_short(w.filename)}:{w.lineno}" for w in caught if SYNC_MESSAGE in str(w.message)]


def _short(path: str) -> str:
    here = Path(path).resolve()
    root = Path(__file__).resolve().parents[1]
    return str(here.relative_to(root)) if here.is_relative_to(root) else path


def _write_trace(prof, path: Path) -> dict:
    """The Chrome trace, gzipped at `path` when it stays under TRACE_LIMIT; what happened either way."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        packed = Path(tmp) / "trace.json.gz"
        with open(raw, "rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        size = packed.stat().st_size
        if size > TRACE_LIMIT:
            return {"written": False, "bytes": size, "why": f"over {TRACE_LIMIT // 2**20} MiB: profile fewer steps"}
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(packed, path)
        return {"written": True, "file": path.name, "bytes": size}
