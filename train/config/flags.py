"""An entry point's own flags (--dry-run, --world_size, --loader_only, ...), taken out of its
arguments before the run options are parsed."""
from __future__ import annotations

from typing import Any, Callable

from data.cli import did_you_mean, is_option_word
from train.config.errors import ConfigError
from train.config.options import valid_keys

COMMAND_LINE_KEYS = ("config", "local_rank")  # read by train/config/parsing.py besides the options


def pop_flags(argv: list[str], flags: dict[str, Callable[[str], Any] | None]) -> tuple[dict[str, Any], list[str]]:
    """(the entry point's flags found in argv, the other arguments in their order). `flags` maps
    each flag to the type of its value, or None for a switch; a flag found is keyed by its name
    without its dashes (--world_size -> "world_size"; a switch's value is True). A --word that is
    neither a flag nor a run option and is closest to a flag (--dry_run, --wolrd_size) is refused
    naming the flag; the run options' own misspellings are left to the options' parser."""
    found: dict[str, Any] = {}
    names = [*(f"--{key}" for key in (*valid_keys(), *COMMAND_LINE_KEYS)), *(f for f in flags if f.startswith("--"))]
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in flags and flags[arg] is None:
            found[arg.lstrip("-")] = True
            i += 1
        elif arg in flags:
            if i + 1 >= len(argv) or is_option_word(argv[i + 1]):
                raise ConfigError(f"{arg} needs a value")
            found[arg.lstrip("-")] = flags[arg](argv[i + 1])
            i += 2
        else:
            check_not_a_misspelt_flag(arg, flags, names)
            rest.append(arg)
            i += 1
    return found, rest


def check_not_a_misspelt_flag(arg: str, flags: dict[str, Any], names: list[str]) -> None:
    """ConfigError when `arg` is a --word of none of `names` (the run options and the flags) whose
    closest name is a flag: `--dry_run` -> "unknown option '--dry_run'; did you mean --dry-run?"."""
    name = arg.split("=", 1)[0]
    if not is_option_word(name) or name in names:
        return
    meant = did_you_mean(name, names)
    if meant in flags:
        raise ConfigError(f"unknown option {name!r}; did you mean {meant}?")
