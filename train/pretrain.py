"""Pretraining entry point: `python -m train.pretrain --ds_config FILE [--key value ...]`, or
`deepspeed --module train.pretrain ...` on GPUs; `--help` prints the usage (train/trainer.py's
USAGE) and every option. The run itself is train/trainer.py (checks before start, then the
Trainer); its builders are train/build.py.
"""
from __future__ import annotations

if __name__ == "__main__":  # before the heavy imports below: a stop signal from now on waits for the loop
    from train import early_signals

    early_signals.catch_stop_signals()
    early_signals.quiet_interrupts()  # Ctrl-C / kill outside Slurm before the loop: end at once, no traceback

from train.cli import cli
from train.trainer import main

if __name__ == "__main__":
    try:
        cli(main)
    finally:  # ending with its own status: a SIGTERM during Python's shutdown (srun --kill-on-bad-exit
        early_signals.ignore_stop_signals()  # after another rank failed) must not turn exit 2 into 143
