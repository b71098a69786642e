"""Pretraining entry point: `python train/pretrain.py --ds_config FILE [--key value ...]` (or
`python -m train.pretrain`), `deepspeed --num_gpus 8 train/pretrain.py ...` on GPUs; `--help`
prints the usage (train/run/command.py's USAGE) and every option. The run itself is train/run/trainer.py (checks before start, then the
Trainer); its builders are train/run/build.py.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

if __name__ == "__main__":  # before the heavy imports below: a stop signal from now on waits for the loop;
    from train.run import early_signals  # Ctrl-C / kill outside Slurm before the loop ends it at once, no traceback

    early_signals.at_script_start()

from train.run.cli import run_script
from train.run.command import main

if __name__ == "__main__":
    run_script(main)
