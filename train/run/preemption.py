"""Stop on a signal with a checkpoint, and ask Slurm to requeue the job.

Slurm sends SIGUSR1 ahead of the time limit (`#SBATCH --signal=USR1@180` in
launchers/pretrain.sbatch) and SIGTERM when it preempts or cancels. Any rank may get it first
and at any point of a step, while a checkpoint is a collective, so the ranks agree: every
`run.stop_check_every` optimizer steps each rank all-reduces (MAX) what it received, and all of
them act on the result of the previous round, the same value on every rank at the same step.
On a GPU the flag travels through pinned memory with non-blocking copies and the result is read
one round later through a CUDA event that completed long ago, so the check never stalls the
step. Then the run writes a checkpoint, rank 0 calls `scontrol requeue $SLURM_JOB_ID` if the
signal was SIGUSR1 inside a Slurm job (a preempted job with --requeue is requeued by Slurm
itself), and the process exits 0; the requeued job resumes with `--resume auto`. SIGTERM is
caught only inside a Slurm job; data-loader workers ignore both (data/loader.py), so a signal
sent to every process of a job step cannot kill them under the training process.

Outside Slurm, SIGINT (Ctrl-C) and SIGTERM (kill) stop the same way, checked at every step in a
world of one: the run writes a checkpoint, rank 0 prints one line naming it and the command that
continues it (`Interrupted`, train/run/cli.py), and the process exits 130 / 143 (128 + the signal);
the same signal again ends it at once (train/run/early_signals.py). Loader workers ignore SIGINT too,
so a Ctrl-C sent to the terminal's whole process group reaches only the training process.
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from train.run import early_signals

log = logging.getLogger("preemption")
# MAX over ranks: a requeue request wins; a Ctrl-C wins over the SIGTERM the deepspeed launcher
# sends each rank when it gets the Ctrl-C too
CODES = {signal.SIGTERM: 1, signal.SIGINT: 2, signal.SIGUSR1: 3}
SIGNALS = {code: sig for sig, code in CODES.items()}
# ranks started by a launcher (deepspeed, torchrun, srun) find RANK set; read at import, before
# train/engine/distributed.py sets it for a world of one
STARTED_BY_LAUNCHER = "RANK" in os.environ or "LOCAL_RANK" in os.environ


class Interrupted(Exception):
    """A run stopped by SIGINT / SIGTERM outside Slurm, its checkpoint written: train/run/cli.py prints
    `message` (rank 0; empty on the other ranks) and exits with `status` (128 + the signal)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class StopOnSignal:
    def __init__(self, every: int, device: torch.device):
        self.every, self.device = every, device
        self.received = 0  # CODES value of the strongest signal this process got
        self.agreed = 0  # what every rank agreed on (0 = keep training)
        self._pending = None  # (event or None, host tensor) of the round in flight
        self._host = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._result = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")  # read before reuse
        # SIGTERM means preemption inside Slurm; outside, SIGINT and SIGTERM are a person stopping the run
        for sig in early_signals.stop_signals():
            signal.signal(sig, self._handle)
        # restored by close(): an in-process caller (a test) gets its own Ctrl-C handling back
        self._previous = {sig: signal.signal(sig, self._handle) for sig in early_signals.interrupt_signals()}
        for signum in early_signals.take():  # received during start-up (train/run/early_signals.py)
            self._handle(signum, None)

    def _handle(self, signum, frame) -> None:
        self.received = max(self.received, CODES[signum])
        early_signals.abort_on_repeat(signum)  # SIGINT / SIGTERM outside Slurm: the same again ends at once

    def close(self) -> None:
        """The training loop is over: SIGINT / SIGTERM outside Slurm get their handlers from before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def should_stop(self, step: int) -> bool:
        """Collective every `every` steps (every rank calls it with the same step); in a world of
        one, no collective: checked at every step."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            self.agreed = self.received
            return bool(self.agreed)
        if step % self.every:
            return False
        if self._pending is not None:  # the previous round's result: identical on every rank
            event, result = self._pending
            if event is not None:
                event.synchronize()  # recorded `every` steps ago: long complete
            self.agreed = int(result[0])
            if self.agreed:
                return True
        self._host[0] = self.received
        flag = self._host.to(self.device, non_blocking=True, copy=True)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if self.device.type == "cuda":
            self._result.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (event, self._result)
        else:
            self._pending = (None, flag)
        return False

    @property
    def requeue(self) -> bool:
        return self.agreed == CODES[signal.SIGUSR1]

    @property
    def agreed_signal(self) -> signal.Signals | None:
        """The signal the ranks agreed to stop on (the strongest any of them got)."""
        return SIGNALS.get(self.agreed)

    @property
    def exit_status(self) -> int:
        """128 + the signal for SIGINT / SIGTERM outside Slurm (a shell's status for a process
        ended by it); 0 for Slurm's stop signals (the job is requeued or ends: not a failure)."""
        return 128 + self.agreed_signal if self.agreed_signal in early_signals.interrupt_signals() else 0


def resume_hint(world: int) -> str:
    """How to continue a stopped run: the command that started this process with `--resume auto`
    (and without --resume X / --run.overwrite X, which contradict it); for ranks started by a
    launcher, or a run called from other code, whose command this process cannot see: the
    instruction to rerun it with that flag."""
    argv = this_command()
    if argv is None or world > 1 or STARTED_BY_LAUNCHER:
        return "run the same command again with --resume auto (without --run.overwrite)"
    kept, i = [], 0
    while i < len(argv):
        if argv[i] in ("--resume", "--run.overwrite"):
            i += 2
            continue
        if not argv[i].startswith(("--resume=", "--run.overwrite=")):
            kept.append(argv[i])
        i += 1
    return shlex.join([*kept, "--resume", "auto"])


def this_command() -> list[str] | None:
    """The command line that started this process (`python -m train.pretrain ...`, `python
    train/finetune.py ...`) when it ran an entry point as a script or module; None otherwise."""
    argv = list(getattr(sys, "orig_argv", []))  # the interpreter's own argv, its options included
    n = len(sys.argv) - 1  # the entry point's arguments end the interpreter's argv
    if not sys.argv[0] or len(argv) < n + 2 or argv[len(argv) - n:] != sys.argv[1:]:
        return None
    before = argv[len(argv) - n - 2:len(argv) - n]  # ['-m', module] or [..., script]
    if before[0] == "-m":
        return argv if before[1].split(".")[-1] == Path(sys.argv[0]).stem else None
    return argv if before[1].endswith(".py") and Path(before[1]).resolve() == Path(sys.argv[0]).resolve() else None


REQUEUE_FAILED = 75  # EX_TEMPFAIL: the job stopped early, its checkpoint written, and is not queued again


def requeue_job() -> tuple[bool, str]:
    """`scontrol requeue $SLURM_JOB_ID`: (whether the job is queued again, what happened for the
    log). A failed requeue (requeue disabled, no scontrol inside a container) is no success: the
    job would end COMPLETED in the middle of its schedule."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return True, "not a Slurm job: nothing to requeue"
    try:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except OSError as e:
        return False, f"scontrol requeue {job} could not run ({e.strerror or e})"
    if proc.returncode:
        return False, f"scontrol requeue {job} failed ({proc.returncode}): {proc.stderr.strip()}"
    return True, f"requeued Slurm job {job}"
