"""Encoders rebuilt from what their files say of them: an export's `.json` (`timm_kwargs`) or a
checkpoint's complete.json (`encoder_timm_kwargs`) is checked (types, then against the weights'
shapes on the meta device) before anything is built, so that a description cannot size what is
allocated (a depth of ten million, a width of a million)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from data.cli import InputError
from model.interop import accepted_shapes, resize_pos_embed, shapes_misfit, vit_misfit
from model.timm_backbone import TimmBackbone
from model.vit import VisionTransformer

ENCODER_FILES = "give an exported encoder.safetensors (with its .json beside it), an official MAE or a timm checkpoint"
OUR_ARCH_KEYS = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias")
ARCH_SIZES = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads")  # integers >= 1
TIMM_SIZES = ("img_size", "in_chans")  # a timm backbone's, beside its name
EXPORT_FIX = ("give the .json train.export wrote beside these weights (python -m train.export --checkpoint <run> "
              "writes both again)")
CHECKPOINT_FIX = "give another of the run's checkpoints (checkpoints/step*)"


def _shown(value: object) -> str:
    """A value for a one-line message, cut short: a hostile file may hold a long one."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _kwarg_problem(key: str, value: object) -> str:
    """What is wrong with one architecture value of an encoder's description ('' when it is sound)."""
    if key in ARCH_SIZES and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return "not an integer >= 1"
    if key == "mlp_ratio" and not (isinstance(value, int | float) and not isinstance(value, bool)
                                   and math.isfinite(value) and value > 0):
        return "not a finite number > 0"
    if key in ("qkv_bias", "rpe") and not isinstance(value, bool):
        return "not true or false"
    if key == "global_pool" and value not in ("token", "avg"):
        return "not 'token' or 'avg'"
    if key == "timm_model" and not isinstance(value, str):
        return "not a timm model's name"
    return ""


def checked_timm_kwargs(kwargs: object, where: str, fix: str) -> dict:
    """`kwargs` when they describe an encoder: our ViT's OUR_ARCH_KEYS (rpe, global_pool optional),
    or a timm backbone's name and sizes; else InputError naming `where`, the key and `fix`."""
    if not isinstance(kwargs, dict):
        raise InputError(f"{where} is {_shown(kwargs)}, not a table of the encoder's architecture "
                         f"({', '.join(OUR_ARCH_KEYS)}): {fix}")
    required = ("timm_model", *TIMM_SIZES) if "timm_model" in kwargs else OUR_ARCH_KEYS
    for key in required:
        if key not in kwargs:
            raise InputError(f"{where} has no {key}: {fix}")
    for key in (*required, "rpe", "global_pool"):
        if key in kwargs and (problem := _kwarg_problem(key, kwargs[key])):
            raise InputError(f"{where}: {key} is {_shown(kwargs[key])}, {problem}: {fix}")
    return kwargs


def encoder_misfit(kwargs: dict, shapes: dict[str, tuple[int, ...]]) -> str:
    """How weights (name -> shape) differ from the encoder `kwargs` describe ('' when they fit),
    judged on the meta device: nothing the description claims is allocated or built."""
    if "timm_model" not in kwargs:
        return vit_misfit({**{k: kwargs[k] for k in OUR_ARCH_KEYS}, "rpe": kwargs.get("rpe", False),
                           "global_pool": kwargs.get("global_pool", "token")}, shapes)
    with torch.device("meta"):  # a timm model's depth is its name's; its sizes are the description's
        ours = accepted_shapes(TimmBackbone(kwargs["timm_model"], kwargs["img_size"], kwargs["in_chans"]))
    return shapes_misfit(shapes, ours)


def described_encoder(kwargs: object, state: dict[str, torch.Tensor], where: str, fix: str,
                      img_size: int = 0) -> VisionTransformer | TimmBackbone:
    """The encoder the description `kwargs` (read from `where`) records, with the weights `state`,
    built only once the description is sound and fits the weights (InputError naming both)."""
    kwargs = checked_timm_kwargs(kwargs, where, fix)
    problem = encoder_misfit(kwargs, {k: tuple(v.shape) for k, v in state.items()})
    if problem:
        raise InputError(f"{where} does not describe the weights beside it, which hold {problem}: {fix}")
    model = encoder_from_timm_kwargs(kwargs, img_size)
    load_state_any_size(model, state)
    return model


def encoder_from_timm_kwargs(kwargs: dict, img_size: int = 0) -> VisionTransformer | TimmBackbone:
    """The encoder an export's description (or a checkpoint's meta) records, without a classifier:
    a fine-tuned one keeps its pooling (avg: `fc_norm` after the patch mean, no final `norm`)."""
    if "timm_model" in kwargs:  # a timm backbone (model/timm_backbone.py)
        return TimmBackbone(kwargs["timm_model"], img_size or kwargs["img_size"], kwargs["in_chans"])
    arch = {k: kwargs[k] for k in OUR_ARCH_KEYS} | ({"img_size": img_size} if img_size else {})
    return VisionTransformer(**arch, rpe=kwargs.get("rpe", False), global_pool=kwargs.get("global_pool", "token"),
                             num_classes=0)


def load_state_any_size(model: VisionTransformer, state: dict) -> None:
    """Strict load of the encoder (a fine-tuned model's classifier `head.*` left out); an encoder
    trained at another resolution (MAE+ crops) gets this model's own sin-cos `pos_embed` for its
    grid, or, when its table was learned (fine-tuned), that table interpolated (model/interop.py
    resize_pos_embed)."""
    if isinstance(model, VisionTransformer):
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
    if "pos_embed" in state and state["pos_embed"].shape != model.pos_embed.shape:
        state = {**state, "pos_embed": resize_pos_embed(state["pos_embed"], model.patch_embed.grid_size)}
    model.load_state_dict(state, strict=True)


def checkpoint_description(meta: object, tag_dir: Path, state: dict[str, torch.Tensor]) -> dict:
    """A checkpoint's `encoder_timm_kwargs` once sound and fitting its encoder's weights `state`
    (InputError naming complete.json and the key otherwise)."""
    where = f"{tag_dir / 'complete.json'}: encoder_timm_kwargs"
    if not isinstance(meta, dict) or "encoder_timm_kwargs" not in meta:
        raise InputError(f"{tag_dir / 'complete.json'} holds no encoder_timm_kwargs (the encoder's architecture): "
                         f"{CHECKPOINT_FIX}")
    kwargs = checked_timm_kwargs(meta["encoder_timm_kwargs"], where, CHECKPOINT_FIX)
    problem = encoder_misfit(kwargs, {k: tuple(v.shape) for k, v in state.items()})
    if problem:
        raise InputError(f"{where} does not describe the weights beside it, which hold {problem}: {CHECKPOINT_FIX}")
    return kwargs
