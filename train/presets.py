"""The shipped `--config` presets: train/configs/<method>/*.json and their variants/ folders."""
from __future__ import annotations

import difflib
from pathlib import Path

from data.cli import InputError, read_json
from train.config_error import ConfigError

PRESETS = Path(__file__).resolve().parent / "configs"  # train/configs/<method>/*.json, variants/ below


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
