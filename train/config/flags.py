"""An entry point's own flags (--dry-run, --world_size, --loader_only, ...), taken out of its
arguments before the run options are parsed."""
from __future__ import annotations

from typing import Any, Callable

from train.config.errors import ConfigError


def pop_flags(argv: list[str], flags: dict[str, Callable[[str], Any] | None]) -> tuple[dict[str, Any], list[str]]:
    """(the entry point's flags found in argv, the other arguments in their order). `flags` maps
    each flag to the type of its value, or None for a switch; a flag found is keyed by its name
    without its dashes (--world_size -> "world_size"; a switch's value is True)."""
    found: dict[str, Any] = {}
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in flags and flags[arg] is None:
            found[arg.lstrip("-")] = True
            i += 1
        elif arg in flags:
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a value")
            found[arg.lstrip("-")] = flags[arg](argv[i + 1])
            i += 2
        else:
            rest.append(arg)
            i += 1
    return found, rest
