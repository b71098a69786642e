"""The shipped `--config` presets (train/configs/<method>/*.json and their variants/ folders), and
how several presets compose.

Composition does not depend on the order of the `--config` files: each option takes the value the
presets agree on, and two presets that set one option to different values are refused, naming
both files, the option and both values (keep one of them, or give the option on the command line,
which wins over every preset). Two parts of a preset are set apart:
  - "defaults": values that yield to any other preset's own. The recipes train/finetune.py and
    train/linprobe.py load keep theirs there, and a base preset keeps there what its variants
    change (energy's backbone, MixedAE's attention and loss weights, ...). Two presets' defaults
    that differ are refused the same way, unless a preset's own option or the command line sets
    the option.
  - "if_objective": {"<objective>": {...}}: options applied only when the run's objective is that
    one (train/configs/mae/debug.json's MAE decoder); they compose as the preset's own options.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.cli import InputError, read_json
from train.config.errors import ConfigError
from train.config.values import shown

PRESETS = Path(__file__).resolve().parents[1] / "configs"  # train/configs/<method>/*.json, variants/ below
DEFAULTS = "defaults"  # a preset's values that yield to any other preset's
IF_OBJECTIVE = "if_objective"  # a preset's sections applied only when the run's objective is theirs


def preset_names() -> list[str]:
    """Every shipped preset, as a path from the repository root (train/configs/mae/debug.json, ...)."""
    root = PRESETS.parent.parent
    return sorted(str(p.relative_to(root)) for p in PRESETS.rglob("*.json"))


def load_preset(value: str) -> dict:
    """The options of a --config preset; ConfigError for a missing file (naming where presets live
    and the nearest shipped ones), malformed JSON (file, line and column) or JSON that is not an
    object of options."""
    path = Path(value)
    if not path.is_file():
        given = str(path.resolve().relative_to(PRESETS.parent.parent)) \
            if path.resolve().is_relative_to(PRESETS.parent.parent) else value
        near = difflib.get_close_matches(given, preset_names(), n=3, cutoff=0.6)
        hint = f"; nearest: {', '.join(near)}" if near else f"; e.g. {', '.join(preset_names()[:3])}"
        raise ConfigError(f"preset --config {value} {'is a folder' if path.is_dir() else 'does not exist'}: presets "
                          f"live in train/configs/<method>/ and train/configs/<method>/variants/{hint}")
    try:
        preset = read_json(path, "preset --config")
    except InputError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(preset, dict):
        raise ConfigError(f"preset --config {value} holds a JSON {type(preset).__name__}, not an object of options "
                          f'(e.g. {{"optim": {{"blr": 1.5e-4}}}})')
    return preset


@dataclass(frozen=True)
class PresetOptions:
    """One --config file's options, as dotted keys with values read as their types."""
    path: str
    options: dict[str, Any]
    defaults: dict[str, Any]  # its "defaults" part
    if_objective: dict[str, dict[str, Any]]  # objective -> the options applied under it


def compose(presets: list[PresetOptions], command_line: set[str], objective: str | None = None
            ) -> dict[str, tuple[Any, str]]:
    """Option -> (value, the preset it comes from): every preset's defaults, under every preset's
    own options (with its if_objective options for `objective`). ConfigError for two presets that
    set an option to different values, whatever their order, unless something above them settles
    it: the command line for every option, a preset's own option for defaults."""
    own = _agreed([(p.path, {**p.options, **p.if_objective.get(objective, {})}) for p in presets], command_line)
    return {**_agreed([(p.path, p.defaults) for p in presets], command_line | set(own)), **own}


def _agreed(sets: list[tuple[str, dict[str, Any]]], command_line: set[str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for path, values in sets:
        for key, value in values.items():
            if key in out and out[key][0] != value and key not in command_line:
                was, first = out[key]
                raise ConfigError(f"the presets {first} and {path} set {key} to {shown(was)} and {shown(value)}: "
                                  f"keep one of them, or give --{key} on the command line, which wins over every "
                                  f"preset")
            out.setdefault(key, (value, path))
    return out
