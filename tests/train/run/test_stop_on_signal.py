"""train/run/preemption.py in a world of one: what a stop signal makes of the run. Inside a Slurm job
SIGUSR1 (the time limit ahead) requeues the job and SIGTERM (preemption, scancel) does not, and both
end it with status 0; outside Slurm SIGINT / SIGTERM are a person stopping it: 130 / 143. And the
command printed to continue an interrupted run is its own with `--resume auto` instead of the flags
that contradict it."""
import shlex
import signal

import pytest
import torch

from train.run import early_signals, preemption
from train.run.preemption import StopOnSignal, resume_hint

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@pytest.fixture
def stop_on(monkeypatch):
    """`stop_on(sig, slurm)`: a StopOnSignal after `sig` was sent to this process, inside a Slurm job or
    not; every handler it installed (close() restores only SIGINT / SIGTERM outside Slurm) is put back."""
    saved = {sig: signal.getsignal(sig) for sig in HANDLED}
    made = []

    def stop_on(sig, slurm: bool) -> StopOnSignal:
        if slurm:
            monkeypatch.setenv("SLURM_JOB_ID", "42")
        else:
            monkeypatch.delenv("SLURM_JOB_ID", raising=False)
        early_signals.take()  # nothing left over from start-up code run earlier in this process
        made.append(StopOnSignal(1, torch.device("cpu")))
        assert not made[-1].should_stop(1)  # nothing received yet
        if sig is not None:
            signal.raise_signal(sig)
        return made[-1]

    yield stop_on
    for s in made:
        s.close()
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig, slurm, requeue, status", [
    (signal.SIGTERM, True, False, 0),  # preempted or scancel'ed: Slurm requeues a preempted job itself
    (signal.SIGUSR1, True, True, 0),  # the time limit ahead: the job asks to be requeued
    (signal.SIGTERM, False, False, 128 + signal.SIGTERM),  # kill: a shell's status for it
    (signal.SIGINT, False, False, 128 + signal.SIGINT),  # Ctrl-C
])
def test_a_stop_signal_stops_the_run_with_its_requeue_and_exit_status(stop_on, sig, slurm, requeue, status):
    stop = stop_on(sig, slurm)
    assert stop.should_stop(2)
    assert stop.agreed_signal == sig
    assert stop.requeue is requeue
    assert stop.exit_status == status


def test_without_a_signal_the_run_goes_on(stop_on):
    stop = stop_on(None, slurm=True)
    assert not stop.should_stop(2) and not stop.requeue and stop.exit_status == 0


def test_the_resume_command_is_the_run_s_own_with_resume_auto(monkeypatch):
    """Every form of --resume X / --run.overwrite X (two words or one) goes, with its value; the
    rest of the command stays, in its order."""
    argv = ["python", "-m", "train.pretrain", "--resume", "step8", "--output_dir", "r", "--run.overwrite=true",
            "--optim.blr", "0.5", "--resume", "auto", "--run.overwrite", "false", "--resume=step4", "--run.epochs", "3"]
    monkeypatch.setattr(preemption, "this_command", lambda: list(argv))
    monkeypatch.setattr(preemption, "STARTED_BY_LAUNCHER", False)
    kept = ["python", "-m", "train.pretrain", "--output_dir", "r", "--optim.blr", "0.5", "--run.epochs", "3"]
    assert resume_hint(1) == shlex.join([*kept, "--resume", "auto"])
    # ranks of a launcher cannot see the command that started them: the instruction instead
    assert resume_hint(2) == "run the same command again with --resume auto (without --run.overwrite)"

