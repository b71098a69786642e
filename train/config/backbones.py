"""Checks before start for a timm backbone (`model.name timm/<name>`, model/timm_backbone.py): it is
built on the meta device (shapes only, nothing allocated), so what it cannot take is refused in one
line rather than as a traceback where the engine is built or at the first step."""
from __future__ import annotations

from typing import Any

import torch

from train.config.errors import ConfigError


def check_timm_backbone(name: str, img_size: int, options: dict[str, Any], layer_decay: float,
                        double_backward: bool) -> None:
    """Refuse layer-wise lr decay (it numbers a ViT's blocks), options the timm model `name` does
    not take (stochastic depth, iRPE), an image size off its patch grid (its patch embedding would
    drop the border) and, for objectives that differentiate twice (energy), an operation without a
    double backward. `options`: the encoder's, as the model section gives them (in_chans,
    drop_path_rate, rpe, attn_backend)."""
    from model.registry import create_model

    if layer_decay < 1:
        raise ConfigError(f"optim.layer_decay {layer_decay:g} numbers the blocks of a ViT of this codebase; timm "
                          f"backbone {name} has none: leave optim.layer_decay 1.0")
    try:
        with torch.device("meta"):
            encoder = create_model(name, img_size=img_size, **options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.name {name}: {e}") from None
    patch = encoder.patch_size
    if patch and img_size % patch:
        raise ConfigError(f"model.img_size {img_size} is not divisible by the patch size {patch} of {name}, "
                          f"whose patch embedding would drop the last {img_size % patch} rows and columns: give a "
                          f"multiple of the patch size (e.g. {max(patch, img_size // patch * patch)})")
    if double_backward and (missing := missing_double_backward(encoder, options["in_chans"], img_size)):
        raise ConfigError(f"model.name {name}: this objective differentiates the backbone twice, and PyTorch "
                          f"has no double backward for one of its operations ({missing}): choose a backbone "
                          f"without it (e.g. timm/convnext_atto, timm/vit_tiny_patch16_224)")


def missing_double_backward(encoder: torch.nn.Module, in_chans: int, img_size: int) -> str | None:
    """The autograd message of an operation of `encoder` (on the meta device) that has no double
    backward, else None. The probe is the energy step's pattern: the input gradient with its graph,
    then a backward through it. An operation without a meta kernel cannot be probed: None."""
    x = torch.zeros(2, in_chans, img_size, img_size, device="meta", requires_grad=True)  # 2: BatchNorm trains on it
    try:
        (grad,) = torch.autograd.grad(encoder(x).float().sum(), x, create_graph=True)
        grad.sum().backward()
    except (NotImplementedError, ValueError):  # no meta kernel; a shape the model cannot take (the step says)
        return None
    except RuntimeError as e:
        if "derivative for" in str(e) and "not implemented" in str(e):
            return str(e).splitlines()[0]
        return None
    return None
