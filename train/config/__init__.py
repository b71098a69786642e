"""Configuration: what a run is asked to do, checked before anything starts. Imports nothing of
train/ but itself (model/, data/ and kernels/ below it).

    options.py        the typed, strict options (`--section.key value`, presets, `--help`'s
                      lines), their ranges and the checks across them; PretrainConfig
    values.py         the one set of rules for reading a value (types, finiteness, intervals)
    presets.py        the shipped `--config` presets (train/configs/) and how several compose
    help.py           the option lines of `--help`
    ds_config.py      the DeepSpeed JSON: batch plan, precision, ZeRO stage, clipping;
                      ds_keys.py every key it may hold and what the engine reads of it
    device_checks.py  the machine: a GPU the torch build has kernels for, bf16 where it exists
    plan.py           what a configuration implies: its encoder, labeled split, peak lr, schedule
    flags.py          an entry point's own flags, taken out before the options are parsed
    errors.py         ConfigError: bad input, one line, exit 2

The package exports the options' API (`from train.config import parse_args, PretrainConfig, ...`).
"""
from train.config.errors import ConfigError
from train.config.options import PretrainConfig, help_text, parse_args, section, to_dict, valid_keys

__all__ = ["ConfigError", "PretrainConfig", "help_text", "parse_args", "section", "to_dict", "valid_keys"]
