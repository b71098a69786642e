"""Catch the stop signals from the first line of an entry point, before its heavy imports.

Slurm sends SIGUSR1 ahead of the time limit and SIGTERM on preemption, scancel, and, through
`srun --kill-on-bad-exit`, to the other ranks once one rank has failed. Training reacts to them
(train/run/preemption.py: checkpoint, requeue on SIGUSR1), but only once its loop runs: imports,
process-group start, engine, data and resume come first and can take minutes. A signal in that
window used to kill the rank with the signal's default action: a restarted job ended FAILED
instead of being requeued, and a configuration error on one rank became exit 143 on the other.

Caught here, a signal is only recorded; the loop's StopOnSignal takes it over (`take()`) and acts
at its first stop check, after which a checkpoint exists to resume from, and a rank that meets a
configuration error still exits 2. SIGTERM is caught here only inside a Slurm job.

Outside Slurm, SIGINT (Ctrl-C) and SIGTERM (a plain kill) are a person stopping the run: during
start-up nothing is lost by ending at once, so they keep the default action (`quiet_interrupts`:
no KeyboardInterrupt traceback); from the loop on, the first one ends it with a checkpoint
(train/run/preemption.py) and a second of the same kind ends the process at once (`abort_on_repeat`:
the default action, which needs no Python code to run, so it works in a hung collective too).
Imports os and signal only, so it can run before torch is imported.
"""
from __future__ import annotations

import os
import signal

_received: list[int] = []  # signal numbers, in arrival order, not yet taken by a StopOnSignal


def _record(signum, frame) -> None:
    _received.append(signum)


def in_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ


def stop_signals() -> tuple[signal.Signals, ...]:
    """What Slurm sends to stop a job: caught from the first line (`catch_stop_signals`)."""
    return (signal.SIGUSR1, signal.SIGTERM) if in_slurm() else (signal.SIGUSR1,)


def interrupt_signals() -> tuple[signal.Signals, ...]:
    """What a person sends to stop a run outside Slurm: Ctrl-C, kill. Inside Slurm, none (SIGTERM is
    Slurm's: stop_signals)."""
    return () if in_slurm() else (signal.SIGINT, signal.SIGTERM)


def catch_stop_signals() -> None:
    """Record SIGUSR1 (and SIGTERM inside Slurm) from now on instead of dying of them."""
    for sig in stop_signals():
        signal.signal(sig, _record)


def quiet_interrupts() -> None:
    """SIGINT / SIGTERM outside Slurm end the process at once with the signal's default action (no
    KeyboardInterrupt traceback), until the training loop takes them over. For the first line of a
    command run as a script; an in-process caller (a test) keeps its own handlers."""
    for sig in interrupt_signals():
        signal.signal(sig, signal.SIG_DFL)


def abort_on_repeat(signum: int) -> None:
    """After a first SIGINT / SIGTERM outside Slurm (the run is stopping with a checkpoint): the
    same signal again ends the process at once. Only the same one: the deepspeed launcher passes a
    Ctrl-C on to its ranks as SIGTERM, which must not abort the checkpoint the Ctrl-C asked for."""
    if signum in interrupt_signals():
        signal.signal(signum, signal.SIG_DFL)


def at_script_start() -> None:
    """The first line of a training command run as a script (pretrain, finetune, linprobe), before
    its heavy imports: Slurm's stop signals are recorded for the loop, a person's Ctrl-C / kill ends
    the start-up at once without a traceback (train/run/cli.py's `run_script` then runs the command)."""
    catch_stop_signals()
    quiet_interrupts()


def take() -> list[int]:
    """The signals received so far (emptied: each is handed over once)."""
    got = list(_received)
    del _received[:len(got)]
    return got


def ignore_stop_signals() -> None:
    """Ignore them from now on: for a process that is ending with its own exit status. Python's
    shutdown restores the default action (die) of the signals it handles, so a SIGTERM during a
    slow teardown would otherwise replace the status with 143; an ignored signal stays ignored.
    SIGINT / SIGTERM outside Slurm keep their default action: a person asking again is obeyed."""
    for sig in stop_signals():
        signal.signal(sig, signal.SIG_IGN)
