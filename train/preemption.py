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
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess

import torch
import torch.distributed as dist

from train import early_signals

log = logging.getLogger("preemption")
CODES = {signal.SIGTERM: 1, signal.SIGUSR1: 2}  # MAX over ranks: a requeue request wins


class StopSignal:
    def __init__(self, every: int, device: torch.device):
        self.every, self.device = every, device
        self.received = 0  # CODES value of the strongest signal this process got
        self.agreed = 0  # what every rank agreed on (0 = keep training)
        self._pending = None  # (event or None, host tensor) of the round in flight
        self._host = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._result = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")  # read before reuse
        # SIGTERM means preemption only inside Slurm; elsewhere (the deepspeed launcher cleaning up
        # after a failed rank, a plain kill) it keeps its default: stop at once.
        for sig in early_signals.stop_signals():
            signal.signal(sig, self._handle)
        for signum in early_signals.take():  # received during start-up (train/early_signals.py)
            self._handle(signum, None)

    def _handle(self, signum, frame) -> None:
        self.received = max(self.received, CODES[signum])

    def should_stop(self, step: int) -> bool:
        """Collective every `every` steps (every rank calls it with the same step)."""
        if step % self.every:
            return False
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            self.agreed = self.received
            return bool(self.agreed)
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


def requeue_job() -> str:
    """`scontrol requeue $SLURM_JOB_ID`; returns what happened (for the log)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return "not a Slurm job: nothing to requeue"
    proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if proc.returncode:
        return f"scontrol requeue {job} failed ({proc.returncode}): {proc.stderr.strip()}"
    return f"requeued Slurm job {job}"
