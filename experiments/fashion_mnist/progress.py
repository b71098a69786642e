"""Where a study stands (`study.py --status`), read from its run folders only: for each (seed,
entry) whether it is done (with its accuracies), pretraining or fine-tuning (step, the last
logged step time, the steps left at that rate, how long ago it last logged), evaluating frozen
features, or not started. The 10-epoch study runs for hours, often in several sittings; this answers
"how far along, and is it still moving?" without opening a log.

Stages follow study.run_entry: <entry>/seed<k>/pretrain (train/pretrain.py; encoder.safetensors is
written at its end), then the kNN / linear-probe evaluations (nothing on disk until result.json),
then <entry>/seed<k>/finetune (train/finetune.py), then result.json. The supervised control only
fine-tunes."""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.fashion_mnist.common import read_result
from train.run.folder import read_metrics

RECENT_STEPS = 5  # step time: the median over this many last logged steps (one slow step is noise)


@dataclass
class EntryStatus:
    entry: str
    seed: int
    stage: str  # "done" | "done, other budget" | "pretraining" | "evaluating" | "fine-tuning" | "not started"
    step: int = 0
    total_steps: int = 0
    seconds_per_step: float | None = None  # the median of the last RECENT_STEPS logged step times
    last_log_age_s: float | None = None  # seconds since the stage's metrics.jsonl was last written
    result: dict | None = None  # result.json, when done

    @property
    def seconds_left(self) -> float | None:
        """The stage's remaining steps at the last logged step time (not the stages after it)."""
        if self.seconds_per_step is None or not self.total_steps:
            return None
        return (self.total_steps - self.step) * self.seconds_per_step


def _stage(run: Path, stage: str, entry: str, seed: int, now: float) -> EntryStatus:
    """A pretraining or fine-tuning run folder: its step out of meta.json's total_steps."""
    total = json.loads((run / "meta.json").read_text())["total_steps"]
    status = EntryStatus(entry, seed, stage, total_steps=total)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():  # started, nothing logged yet
        return status
    rows = [r for r in read_metrics(run) if "step_time" in r]
    if rows:
        status.step = rows[-1]["step"]
        status.seconds_per_step = statistics.median(r["step_time"] for r in rows[-RECENT_STEPS:])
    status.last_log_age_s = now - metrics.stat().st_mtime
    return status


def entry_status(out: Path, entry: str, seed: int, budget: dict, now: float | None = None) -> EntryStatus:
    """Where one (entry, seed) of the study in `out` stands; `budget` as study.run_entry records it."""
    now = time.time() if now is None else now
    run = out / entry / f"seed{seed}"
    if (run / "result.json").is_file():
        result = read_result(run / "result.json")
        stage = "done" if result.get("budget") == budget else "done, other budget"
        return EntryStatus(entry, seed, stage, result=result)
    if (run / "finetune" / "meta.json").is_file():
        return _stage(run / "finetune", "fine-tuning", entry, seed, now)
    if (run / "pretrain" / "encoder.safetensors").is_file():
        return EntryStatus(entry, seed, "evaluating")
    if (run / "pretrain" / "meta.json").is_file():
        return _stage(run / "pretrain", "pretraining", entry, seed, now)
    return EntryStatus(entry, seed, "not started")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def describe(s: EntryStatus) -> str:
    """One line for a status."""
    head = f"seed {s.seed}  {s.entry:<24} {s.stage}"
    if s.result is not None:
        r = s.result
        scores = [f"{name} {r[key]:.2f}" for name, key in (("kNN", "knn_top1"), ("linear", "linear_probe_top1"),
                                                           ("fine-tune", "finetune_top1")) if key in r]
        if math.isfinite(r.get("pretrain_seconds", math.nan)):  # NaN: resumed, so not timed (study._timed)
            scores.append(f"pretrained in {_minutes(r['pretrain_seconds'])}")
        if s.stage != "done":
            scores.append(f"measured with {r.get('budget')}")
        return f"{head}: {', '.join(scores)}"
    if s.stage in ("pretraining", "fine-tuning"):
        parts = [f"step {s.step} of {s.total_steps} ({100 * s.step / s.total_steps:.0f}%)"]
        if s.seconds_per_step is not None:
            parts.append(f"{s.seconds_per_step:.2f} s/step, about {_minutes(s.seconds_left)} of {s.stage} left "
                         f"at that rate")
        if s.last_log_age_s is not None:
            parts.append(f"last logged {_minutes(s.last_log_age_s)} ago")
        return f"{head}: {'; '.join(parts)}"
    if s.stage == "evaluating":
        return f"{head}: pretrained; kNN and linear probe on frozen features, then fine-tuning"
    return head


def report(statuses: list[EntryStatus]) -> str:
    """Every line, then the count done."""
    done = sum(s.stage == "done" for s in statuses)
    return "\n".join([*map(describe, statuses), f"{done} of {len(statuses)} runs done"])
