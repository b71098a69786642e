"""Catch the stop signals from the first line of an entry point, before its heavy imports.

Slurm sends SIGUSR1 ahead of the time limit and SIGTERM on preemption, scancel, and, through
`srun --kill-on-bad-exit`, to the other ranks once one rank has failed. Training reacts to them
(train/preemption.py: checkpoint, requeue on SIGUSR1), but only once its loop runs: imports,
process-group start, engine, data and resume come first and can take minutes. A signal in that
window used to kill the rank with the signal's default action: a restarted job ended FAILED
instead of being requeued, and a configuration error on one rank became exit 143 on the other.

Caught here, a signal is only recorded; the loop's StopSignal takes it over (`take()`) and acts
at its first stop check, after which a checkpoint exists to resume from, and a rank that meets a
configuration error still exits 2. SIGTERM is caught only inside a Slurm job, as in
train/preemption.py; elsewhere (a plain kill, the deepspeed launcher cleaning up after a failed
rank) it keeps its default. Imports os and signal only, so it can run before torch is imported.
"""
from __future__ import annotations

import os
import signal

_received: list[int] = []  # signal numbers, in arrival order, not yet taken by a StopSignal


def _record(signum, frame) -> None:
    _received.append(signum)


def stop_signals() -> tuple[signal.Signals, ...]:
    return (signal.SIGUSR1, signal.SIGTERM) if "SLURM_JOB_ID" in os.environ else (signal.SIGUSR1,)


def catch_stop_signals() -> None:
    """Record SIGUSR1 (and SIGTERM inside Slurm) from now on instead of dying of them."""
    for sig in stop_signals():
        signal.signal(sig, _record)


def take() -> list[int]:
    """The signals received so far (emptied: each is handed over once)."""
    got = list(_received)
    del _received[:len(got)]
    return got


def ignore_stop_signals() -> None:
    """Ignore them from now on: for a process that is ending with its own exit status. Python's
    shutdown restores the default action (die) of the signals it handles, so a SIGTERM during a
    slow teardown would otherwise replace the status with 143; an ignored signal stays ignored."""
    for sig in stop_signals():
        signal.signal(sig, signal.SIG_IGN)
