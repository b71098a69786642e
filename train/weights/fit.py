"""Whether the weights `--model.init_from` names fit the configured encoder, judged from the file's
tensor shapes before any process group starts (the load itself comes later, in train/run/build.py).

A mismatch is refused naming both values: input channels, width, patch size, depth, or the first
tensor whose shape differs. A position table of another grid is no mismatch (it is resized when
loaded: MAE+ pretrains on small crops).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from model.interop import DECODER_PREFIXES
from model.weights_reader import WeightsFileError, weights_shapes
from train.config.errors import ConfigError
from train.config.options import PretrainConfig, check_init_from_exists
from train.engine import checkpoint

RESIZED = {"pos_embed"}  # rebuilt for the target grid when loaded (model/interop.py resize_pos_embed)
NEW = ("head.", "fc_norm.")  # trained anew by a classifier objective
WEIGHTS_KINDS = "an exported encoder.safetensors, a run folder, an official MAE or a timm checkpoint"


def file_shapes(source: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the encoder in an exported .safetensors, an official MAE / timm
    torch file, or a run / checkpoint folder of ours (model/interop.py weights_shapes: headers or a
    memory map, the file judged whole; WeightsFileError when it is not weights)."""
    path = Path(source)
    if path.is_dir():  # a run folder or a tag: the weights file of its checkpoint, by name
        from train.engine.state_files import WEIGHTS_FILE, check_layout

        tag = checkpoint.find_resume(source, path)
        check_layout(tag)
        return {k.removeprefix("encoder."): shape for k, shape in weights_shapes(tag / WEIGHTS_FILE).items()
                if k.startswith("encoder.")}
    return {k: shape for k, shape in weights_shapes(path).items() if not k.startswith(DECODER_PREFIXES)}


def describe(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Input channels, width, patch size and depth of a ViT's encoder tensors ({} for another kind)."""
    proj = shapes.get("patch_embed.proj.weight")
    if proj is None or len(proj) != 4:
        return {}
    blocks = {int(m.group(1)) for k in shapes if (m := re.match(r"blocks\.(\d+)\.", k))}
    return {"input channels": proj[1], "width": proj[0], "patch size": proj[2], "depth": len(blocks)}


def mismatch(theirs: dict[str, tuple[int, ...]], ours: dict[str, tuple[int, ...]]) -> str:
    """How the file's encoder differs from the configured one ('' when it fits)."""
    a, b = describe(theirs), describe(ours)
    differing = [f"{what} {a[what]} (the model's: {b[what]})" for what in a if what in b and a[what] != b[what]]
    if differing:
        return ", ".join(differing)
    for name, shape in theirs.items():
        if name in ours and name not in RESIZED and not name.startswith(NEW) and shape != ours[name]:
            return f"{name} of shape {list(shape)} (the model's: {list(ours[name])})"
    return ""


def check_init_from(cfg: PretrainConfig) -> None:
    """ConfigError when model.init_from holds an encoder of other input channels or sizes than
    the configured model (model.name, model.in_chans, model.img_size)."""
    from model.hf_interop import is_transformers_folder

    check_init_from_exists(cfg.model.init_from)
    if not cfg.model.init_from or is_transformers_folder(cfg.model.init_from):  # checked by its config.json
        return
    from train.config.plan import build_encoder

    try:
        theirs = file_shapes(cfg.model.init_from)
    except WeightsFileError as e:  # the file names itself and what is wrong with it
        raise ConfigError(f"model.init_from: {e}; give {WEIGHTS_KINDS}") from None
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # a run folder without a readable checkpoint
        detail = str(e).removeprefix(f"--resume {cfg.model.init_from!r}: ")  # find_resume names the option of a resume
        raise ConfigError(f"model.init_from {cfg.model.init_from}: not an encoder this code reads ({detail}); give "
                          f"{WEIGHTS_KINDS}") from None
    with torch.device("meta"):
        ours = {k: tuple(v.shape) for k, v in build_encoder(cfg).state_dict().items()}
    if not set(theirs) & set(ours):
        raise ConfigError(f"model.init_from {cfg.model.init_from} holds no encoder tensors: none of its {len(theirs)} "
                          f"tensor names is one of the model's (e.g. {sorted(theirs)[:3]}, the model's "
                          f"{sorted(ours)[:3]}); give {WEIGHTS_KINDS}")
    problem = mismatch(theirs, ours)
    if problem:
        raise ConfigError(f"model.init_from {cfg.model.init_from} does not fit model.name {cfg.model.name} "
                          f"(model.in_chans {cfg.model.in_chans}): the file's encoder has {problem}; give the "
                          f"--model.name (and --model.in_chans) it was trained with, or another encoder")
