"""GPU validation kit: one or several phases of measurements per call, run from the repository root
on a GPU machine, one compact JSON per phase (+ one log per call, and the bench phase's trace) into
--out (default runs/gpu_check/; --record: benchmarks/results/, the committed records). How to
install and run it: docs/GPU.md.

    python -m tools.gpu_check PHASE[:SECONDS] [PHASE[:SECONDS] ...] [--budget_s 480] [--smoke] [--out DIR | --record]

Phases (tools/phases/, one module each; each reuses the project's own entry points):
  compile  eager against compiled blocks replayed as CUDA graphs: equal losses (bf16, fp32 with
           accumulation), the attention kernel table (tools/choose_attention.py --write), MAE ViT-B
           at micro-batch 128 and 64 and ViT-L at 128 through train/bench.py, alternating, then
           MixedAE / MAE and AdPE / MAE+ compiled at 128
  tests    engine checks through train/pretrain.py (fp16 dynamic loss scale 50 MAE steps, bf16
           ZeRO-1/2, checkpoint + resume equality), then `pytest -m gpu`
  bench    MAE ViT-B/16 and ViT-L/16 at 224, bf16, through train/bench.py, alternating with the
           plain-PyTorch MAE (tools/mae_baseline.py); images/s, TFLOP/s, MFU, peak memory vs the
           dry-run estimate, activation checkpointing and compile on, the largest micro-batch
  methods  step time of every method against MAE at ViT-B/224, micro-batch 128, through
           train/bench.py, MixedAE with and without the fused TopK kernel; kernels/bench.py fp16 +
           bf16; each method's time by phase beside its counted arithmetic (tools/method_time.py)
  loader   decode + RandomResizedCrop 224 images/s with cpu, cpu_draft (train/bench.py
           --loader_only) and nvjpeg, on JPEG shards made by benchmarks/photo_shards.py
  study    experiments/fashion_mnist/study.py on Fashion-MNIST, 1 seed, one entry at a time (--study_pretrain_samples,
           default one epoch: 60000)
  scale    MAE ViT-B/16 images/s per GPU on 1, 2, 4, 8 GPUs of the node (those present) for ZeRO 0-3,
           through train/bench.py under torchrun; efficiency against 1 GPU beside the communication
           model's prediction for one node and 4 nodes (train/estimate/comm_model.py)

--smoke: the same phase on the CPU with tiny models and few steps (the test suite runs it); what
needs CUDA is skipped with the reason in the JSON; on a machine with a GPU every run of the call,
ours and the baseline alike, stays on the CPU. Without CUDA and without --smoke: exit 2.
--budget_s: wall-clock seconds for the whole call; PHASE:SECONDS caps a phase besides (so one call
runs several phases, each with its share: `compile:230 methods:130 loader:170`, docs/GPU.md); an item whose
estimate no longer fits is recorded as skipped, and the JSON is rewritten after every item, so a killed call still leaves
what it measured. Installs nothing (docs/GPU.md: online, or offline from `make gpu-wheels`). The
commit is $GPU_CHECK_COMMIT, else git's, else "unknown".
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
import torch

from data.cli import Parser

PHASES = ("compile", "tests", "bench", "methods", "loader", "study", "scale")
PHASE_MODULES = {"compile": "compile", "tests": "gpu_tests", "bench": "bench", "methods": "methods", "loader": "loader",
                 "study": "study", "scale": "scale"}


class Tee(io.TextIOBase):
    """Writes to the console and the call's log file."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
            st.flush()
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()


def commit() -> str:
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    from train.run.folder import git_commit

    c = git_commit()
    return c["commit"] + ("+dirty" if c.get("dirty") else "") if c["commit"] != "unknown" else "unknown"


class Check:
    """One phase's record: items measured in order, each under the call's time budget."""

    def __init__(self, phase: str, out_dir: Path, smoke: bool, deadline: float, work: Path, log: Path):
        from train.bench import cpu_name, versions

        self.phase, self.smoke, self.deadline, self.work, self.log = phase, smoke, deadline, work, log
        self.cuda = torch.cuda.is_available() and not smoke
        self.device = torch.device("cuda") if self.cuda else torch.device("cpu")
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        self.path = out_dir / f"gpu_check_{phase}_{'cuda' if self.cuda else 'cpu_smoke'}_{stamp}.json"
        self.record: dict = {
            "phase": phase, "mode": "smoke" if smoke else "gpu",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
            "device": torch.cuda.get_device_name() if self.cuda else cpu_name(),
            "versions": versions(), "items": {}, "summary": {},
        }
        self.started = time.monotonic()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def item(self, name: str, estimate_s: float, fn: Callable[[], dict]) -> dict | None:
        """Run fn unless `estimate_s` (seconds on the GPU; ignored in smoke) no longer fits the budget."""
        if not self.smoke and self.remaining() < estimate_s:
            return self.skip(name, f"budget: about {estimate_s:.0f} s needed, {self.remaining():.0f} s left")
        print(f"[gpu_check] {self.phase}/{name}", flush=True)
        t0 = time.monotonic()
        try:
            result = fn()
        except (Exception, SystemExit) as e:  # noqa: BLE001 - one failing measurement (an entry point's refusal exits) must not lose the others
            result = {"error": f"{type(e).__name__}: {str(e)[:600]}",
                      "traceback": traceback.format_exc()[-1500:]}
            print(result["traceback"], flush=True)
        free_memory()  # outside the handler, whose traceback would keep a failed run's tensors alive
        result["seconds"] = round(time.monotonic() - t0, 1)
        self.record["items"][name] = result
        self.save()
        return result

    def skip(self, name: str, reason: str) -> None:
        print(f"[gpu_check] {self.phase}/{name} skipped: {reason}", flush=True)
        self.record["items"][name] = {"skipped": reason}
        self.save()
        return None

    def save(self) -> None:
        self.record["seconds"] = round(time.monotonic() - self.started, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.record, indent=1, default=str))

    def run(self, cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        """A command of the project (cwd: repo root) with its output appended to the log."""
        drop_process_group_env()
        with open(self.log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            return subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True,
                                  timeout=max(5.0, timeout), env={**os.environ, **(env or {})})


def drop_process_group_env() -> None:
    """In-process runs (train/bench.py, train/pretrain.py) make this process rank 0 of a world of 1
    through these variables; a child process inheriting them would try to bind the same port. The
    next in-process run sets them afresh (train/engine/distributed.py)."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def cpu_only():
    """--smoke on a machine with a GPU: every run of the call on the CPU. The project's entry points
    (train/bench.py, train/pretrain.py) take CUDA wherever torch finds it while the phases' own runs
    (the plain-PyTorch baseline) take the Check's device, so a smoke ratio of the two would be a
    GPU's rate over a CPU's. The phases' children are shown no device (CUDA_VISIBLE_DEVICES=""), and
    in this process torch.cuda answers as it would have under that variable (the variable itself is
    read once, when CUDA first initialises, which may have happened already)."""
    saved_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    saved = torch.cuda.is_available, torch.cuda.device_count
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.cuda.is_available, torch.cuda.device_count = (lambda: False), (lambda: 0)
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.device_count = saved
        if saved_env is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved_env


def phase_and_cap(text: str) -> tuple[str, float | None]:
    """'compile' -> ('compile', None); 'compile:260' -> ('compile', 260.0): the phase's cap in seconds."""
    name, _, cap = text.partition(":")
    if name not in PHASES:
        raise argparse.ArgumentTypeError(f"unknown phase {name!r}; choose from {', '.join(PHASES)}")
    if not cap:
        return name, None
    try:
        seconds = float(cap)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the cap after ':' must be seconds, e.g. {name}:200") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the cap must be > 0 seconds")
    return name, seconds


def cutlass_dsl_on_path() -> Path | None:
    """flash-attn-4's CUTLASS DSL keeps its packages in nvidia_cutlass_dsl/dsl_packages, which a
    `.pth` file puts on sys.path; Python reads `.pth` files only in site directories, so installed
    with `pip --target` and found through PYTHONPATH the DSL would not import and flash-attn-4 would
    not be timed. Puts that folder on sys.path and PYTHONPATH (the phases' subprocesses); returns it,
    or None where nothing was missing."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("cutlass") is not None:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "dsl_packages"
    if not folder.is_dir():
        return None
    sys.path.insert(0, str(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])
    return folder


def main(argv: list[str] | None = None) -> list[Path]:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phases", nargs="+", type=phase_and_cap, metavar="PHASE[:SECONDS]",
                   help=f"one of {', '.join(PHASES)}; ':SECONDS' caps the phase's share of --budget_s")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny models, few steps (the test suite's mode)")
    p.add_argument("--budget_s", type=float, default=480.0, help="seconds for the whole call (default 8 min)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder of the JSONs, the log and the trace (default runs/gpu_check, git-ignored)")
    p.add_argument("--record", action="store_true", help="write them into benchmarks/results/ (the committed records)")
    p.add_argument("--fashion_mnist", type=Path, default=None,
                   help="study: folder of the Fashion-MNIST idx files (default: runs/fashion-mnist, then "
                        "/usr/share/datasets/fashion-mnist)")
    p.add_argument("--study_pretrain_samples", type=int, default=60000,
                   help="study: pretraining images per method (whole epochs of 60k, or under one)")
    a = p.parse_args(argv)
    if not a.smoke and not torch.cuda.is_available():
        print("error: no CUDA device here; pass --smoke for the CPU smoke mode", file=sys.stderr)
        raise SystemExit(2)
    if a.out and a.record:
        p.error("give --out or --record, not both")
    named = [name for name, _ in a.phases]
    if len(set(named)) < len(named):
        p.error(f"a phase is named twice ({' '.join(named)}): name each once, with its whole share (e.g. methods:300)")
    if a.study_pretrain_samples < 1:
        p.error(f"--study_pretrain_samples must be >= 1, got {a.study_pretrain_samples}")
    out = a.out or REPO / ("benchmarks/results" if a.record else "runs/gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    if (dsl := cutlass_dsl_on_path()) is not None:
        print(f"[gpu_check] the CUTLASS DSL's packages put on the path from {dsl}", flush=True)
    deadline = time.monotonic() + a.budget_s
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    log = out / f"gpu_check_{'+'.join(name for name, _ in a.phases)}_{'cpu_smoke' if a.smoke else 'cuda'}_{stamp}.log"
    paths = []
    with (open(log, "a") as logf, tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp,
          cpu_only() if a.smoke else contextlib.nullcontext()):
        tee = Tee(sys.__stdout__, logf)
        with redirect_stdout(tee), redirect_stderr(tee):
            for phase, cap in a.phases:
                ends = deadline if cap is None else min(deadline, time.monotonic() + cap)
                check = Check(phase, out, a.smoke, ends, Path(tmp) / phase, log)
                check.work.mkdir(parents=True)
                check.save()
                try:
                    importlib.import_module(f"tools.phases.{PHASE_MODULES[phase]}").run(check, a)
                except (Exception, SystemExit):  # noqa: BLE001 - keep what the phase measured, go on to the next phase
                    check.record["phase_error"] = traceback.format_exc()[-2000:]
                    print(check.record["phase_error"], flush=True)
                check.save()
                print(f"[gpu_check] {phase}: wrote {check.path}", flush=True)
                print(json.dumps(check.record["summary"], indent=1, default=str), flush=True)
                paths.append(check.path)
                free_memory()
    return paths


if __name__ == "__main__":
    main()
