"""The training commands' front (train/pretrain.py; finetune.py and linprobe.py with their recipes
first in argv): `--help`, `--dry-run` (train/estimate/dry_run.py), or the command line parsed
and handed to a run (train/run/trainer.py). Only the configuration is imported up front: the
run's machinery (the data pipeline with torchvision and timm, the engines, the loop) loads once
the command line parsed, so `--help` and a bad value answer in about half the start-up.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from train.config.flags import pop_flags
from train.config.parsing import defaults_under, help_text, parse_args
from train.run.early_signals import catch_stop_signals

log = logging.getLogger("pretrain")  # the trainer's logger: train/run/trainer.py, build.py and folder.py log under it


class CommandName(logging.Filter):
    """Gives the lines of the "pretrain" logger, which pretraining, fine-tuning and the linear probe
    share, the name of the command that runs (`[finetune] ...`)."""

    def __init__(self, command: str):
        super().__init__()
        self.command = command

    def filter(self, record: logging.LogRecord) -> bool:
        record.name = self.command
        return True


def name_log_lines(command: str) -> None:
    """From here on the trainer's log lines start with [command] (pretrain: the logger's own name)."""
    for earlier in [f for f in log.filters if isinstance(f, CommandName)]:  # an earlier run in this process
        log.removeFilter(earlier)
    if command != log.name:
        log.addFilter(CommandName(command))


USAGE = """Pretraining entry point.

    deepspeed --num_gpus 8 train/pretrain.py --ds_config ds_configs/<file>.json [--key value ...]
    python train/pretrain.py --ds_config ds_configs/cpu_debug.json [--key value ...]   (or python -m train.pretrain)

Options: `python train/pretrain.py --help`; `--dry-run [--world_size N] [--gpu a100|cpu]` checks a
configuration for another world size and GPU and estimates memory (train/estimate/dry_run.py). Everything
is checked before the process group starts; then: build encoder + objective, the engine
(train/engine/: one rank or ZeRO-0 replicated, ZeRO-1-3 on FSDP2), resume (also on another world size and ZeRO
stage), loop (Ctrl-C / kill: a checkpoint, then exit 130 / 143; Slurm's SIGUSR1: a checkpoint and
requeue), final checkpoint, export.
"""


def main(argv: list[str] | None = None, command: str = "pretrain", usage: str = USAGE) -> Path:
    """The pretraining command (or `command`, which runs it with its recipe's `--config` first in
    `argv`: finetune, linprobe, each with its own `usage`): the run folder of a finished (or stopped) run."""
    catch_stop_signals()  # SIGUSR1 / SIGTERM during start-up: acted on at the loop's first stop check
    name_log_lines(command)
    argv = sys.argv[1:] if argv is None else argv
    flags, rest = pop_flags(argv, {"--help": None, "-h": None, "--dry-run": None})
    if flags.get("help") or flags.get("h"):  # the defaults shown are the recipe's, where the command has one
        print(usage.rstrip() + "\n\n" + help_text(defaults_under(rest)))
        raise SystemExit(0)
    if flags.get("dry-run"):  # check for a world size and GPU, estimate memory; start nothing
        from train.estimate import dry_run

        raise SystemExit(dry_run.main(argv))
    cfg = parse_args(argv)
    from train.run import trainer  # the run's machinery, once there is a run to make

    return trainer.run(cfg)
