"""Fault injection for the reliability tests (tests/faults/): faults named in the environment.

    PRETRAIN_FAULTS="<point>@<steps>[:rank<r>],..."     e.g. "after_step@5:rank1"

<steps> is one optimizer step (`5`) or a range (`3-6`); without `:rank<r>` every rank is hit.
Points:
  after_step        the process SIGKILLs itself once optimizer step <steps> has completed
                    (before that step's checkpoint, if one is due)
  checkpoint_write  SIGKILL after this rank's files of the checkpoint at step <steps> are
                    written, before the tag is declared complete
  nan_loss          the loss of the micro-batches of steps <steps> is NaN (a diverging model)
  slow_step         each of steps <steps> takes SLOW_STEP_SECONDS longer (a slow node: the real-Slurm
                    test of a short time limit needs a run that outlives slurmctld's 30 s check)

`<steps>` counts optimizer steps from 1, as the logs do. Unset (every normal run), each check is
one dict lookup. SIGKILL cannot be caught: nothing of the process runs after it, as when the
kernel's OOM killer or a failing node ends a rank.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch

ENV = "PRETRAIN_FAULTS"
POINTS = ("after_step", "checkpoint_write", "nan_loss", "slow_step")
SLOW_STEP_SECONDS = float(os.environ.get("PRETRAIN_SLOW_STEP_SECONDS", 0.3))  # a test may need a wider window


def parse(spec: str) -> dict[str, list[tuple[int, int, int | None]]]:
    """'after_step@5:rank1,nan_loss@3-4' -> {point: [(first step, last step, rank or None)]}."""
    faults: dict[str, list[tuple[int, int, int | None]]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            where, _, who = item.partition(":")
            point, steps = where.split("@")
            first, _, last = steps.partition("-")
            rank = int(who.removeprefix("rank")) if who else None
            if point not in POINTS or (who and not who.startswith("rank")):
                raise ValueError
            faults.setdefault(point, []).append((int(first), int(last or first), rank))
        except ValueError:
            raise ValueError(f"{ENV}: cannot read {item!r}; write <point>@<step>[-<step>][:rank<r>] with a point "
                             f"from {POINTS}") from None
    return faults


_FAULTS = parse(os.environ.get(ENV, ""))


def _rank() -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def hit(point: str, step: int) -> bool:
    """Whether fault `point` is armed for this rank at optimizer step `step`."""
    if point not in _FAULTS:
        return False
    return any(first <= step <= last and rank in (None, _rank()) for first, last, rank in _FAULTS[point])


def at(point: str, step: int) -> None:
    """Kill this process (SIGKILL) if `point` is armed here."""
    if hit(point, step):
        # said first: which rank died first is otherwise a race the launcher's report may lose
        # (a peer blocked in a collective can fail and be reported before the killed rank is)
        print(f"[fault] rank {_rank()} SIGKILLs itself at {point}@{step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def slow_down(step: int) -> None:
    """Sleep SLOW_STEP_SECONDS after optimizer step `step` if `slow_step` is armed for it."""
    if hit("slow_step", step):
        time.sleep(SLOW_STEP_SECONDS)


def poison_loss(loss: torch.Tensor, step: int) -> torch.Tensor:
    """The loss, or NaN in its place when `nan_loss` is armed for this step."""
    return loss * float("nan") if hit("nan_loss", step) else loss
