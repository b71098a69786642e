"""Configuration: what a run is asked to do, checked before anything starts. Imports nothing of
train/ but itself (model/, data/ and kernels/ below it).

    options.py        the typed, strict options (PretrainConfig's sections), their ranges and
                      the checks across them
    parsing.py        reading a command's options: presets, `--section.key value`, `--help`,
                      options set that nothing of the run would read
    objective_fits.py the objective against the model, batch, engine and data, before start
    backbones.py      a timm backbone's fit, checked on the meta device
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
from train.config.options import PretrainConfig, section, valid_keys
from train.config.parsing import help_text, parse_args, to_dict

__all__ = ["ConfigError", "PretrainConfig", "help_text", "parse_args", "section", "to_dict", "valid_keys"]
