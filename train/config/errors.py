"""The error every configuration check raises (train/config/options.py, the presets, the ds_config):
an input error, so every entry point reports it in one line and exits 2."""
from __future__ import annotations

from data.cli import InputError


class ConfigError(InputError):
    """A configuration problem found before training starts."""
