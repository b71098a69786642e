"""Pretraining objectives: one file per method, each an `Objective` with its `ObjectiveConfig`,
registered under its name by `@register_objective` (the contract: model/objectives/base.py).

Importing a method's module registers it. This package imports every module in its folder, so
a new method is its own file here (plus its presets, train/configs/<name>/debug.json first, its tests
and its page in docs/methods/: docs/ARCHITECTURE.md "Adding a method"): no list to edit.
"""
from __future__ import annotations

import importlib
import pkgutil

from model.objectives.base import (
    OBJECTIVES,
    Objective,
    ObjectiveConfig,
    build_objective,
    list_objectives,
    register_objective,
)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")  # a method's module registers it on import

__all__ = ["OBJECTIVES", "Objective", "ObjectiveConfig", "build_objective", "list_objectives", "register_objective"]
