"""Pretraining objectives. Each is an nn.Module built from (encoder, its own config) whose
forward(batch) returns a dict with `loss` plus named 0-dim tensors to log (other entries are
outputs for inspection and are not logged). Extra optimisable state lives in the module."""
from __future__ import annotations

from typing import Any

from torch import nn

from model.objectives.energy import EnergyConfig, EnergyObjective
from model.objectives.finetune import FinetuneConfig, FinetuneObjective
from model.objectives.linear_probe import LinearProbeConfig, LinearProbeObjective
from model.objectives.mae import MAEConfig, MAEObjective
from model.objectives.maeplus import MAEPlusConfig, MAEPlusObjective
from model.objectives.mixedae import MixedAEConfig, MixedAEObjective
from model.objectives.mlomae import MLOMAEConfig, MLOMAEObjective
from model.vit import VisionTransformer

# name -> (config class, objective class)
OBJECTIVES: dict[str, tuple[type, type[nn.Module]]] = {
    "mae": (MAEConfig, MAEObjective),
    "maeplus": (MAEPlusConfig, MAEPlusObjective),
    "mixedae": (MixedAEConfig, MixedAEObjective),
    "mlomae": (MLOMAEConfig, MLOMAEObjective),
    "energy": (EnergyConfig, EnergyObjective),
    "linprobe": (LinearProbeConfig, LinearProbeObjective),
    "finetune": (FinetuneConfig, FinetuneObjective),
}


def build_objective(name: str, encoder: VisionTransformer, cfg: Any) -> nn.Module:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {sorted(OBJECTIVES)}")
    return OBJECTIVES[name][1](encoder, cfg)
