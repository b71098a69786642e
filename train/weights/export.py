"""Encoders out of checkpoints, for other programs: timm (`<out>.safetensors` with timm's names and
`<out>.json` with the kwargs and the lines that rebuild it, checked against timm's own model) and
Hugging Face transformers folders (train/weights/transformers.py); the encoder (and MAE decoder)
of a tag for `--model.init_from`; the checks on where an export may write. The command is
train/export.py.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from data.folders import unwritable, unwritable_file
from data.outputs import check_output, written_whole
from model.weights_reader import safe_load
from train.config.errors import ConfigError
from train.engine.checkpoint import find_resume, read_meta
from train.engine.state_files import WEIGHTS_FILE, LegacyCheckpointError, check_layout
from train.weights.described import checkpoint_description

ENCODER_PREFIX = "encoder."
# Our registry name at 224 px -> timm's model name, for users who prefer timm.create_model.
TIMM_NAMES = {
    "vit_tiny_patch16": "vit_tiny_patch16_224", "vit_small_patch16": "vit_small_patch16_224",
    "vit_base_patch16": "vit_base_patch16_224", "vit_large_patch16": "vit_large_patch16_224",
    "vit_huge_patch14": "vit_huge_patch14_224",
}


def _module_state(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The module's tensors in a checkpoint tag: fp32 weights of every trained parameter (the
    engine's master copy), frozen tables and buffers. Objectives' extra state (e.g. AdPE's
    adversaries under `_extra_state`) is not weights and is not in that file. Read with the checks
    of model/interop.py safe_load: a damaged file is a WeightsFileError naming it."""
    check_layout(tag_dir)
    return safe_load(tag_dir / WEIGHTS_FILE)


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The fp32 tensors under `prefix`, with the prefix removed."""
    return {k[len(prefix):]: v.float().contiguous() for k, v in state.items() if k.startswith(prefix)}


def encoder_state(tag_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The encoder's fp32 weights (timm names) from a checkpoint tag, and its complete.json, whose
    encoder_timm_kwargs are checked against those weights before anyone builds from them."""
    encoder, meta = _encoder_of(_module_state(tag_dir), tag_dir), read_meta(tag_dir)
    checkpoint_description(meta, tag_dir, encoder)
    return encoder, meta


def _encoder_of(state: dict[str, torch.Tensor], tag_dir: Path) -> dict[str, torch.Tensor]:
    encoder = _strip(state, ENCODER_PREFIX)
    if not encoder:
        raise ValueError(f"{tag_dir} holds no '{ENCODER_PREFIX}*' weights")
    return encoder


def pretrained_state(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Encoder (timm names) and, when the run had one, its MAE decoder (official MAE names:
    decoder_embed, decoder_blocks, ...) in fp32: what continued pretraining starts from."""
    state = _module_state(tag_dir)
    return {**_encoder_of(state, tag_dir), **_strip(state, "decoder.")}


def _arguments(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _timm_model(name: str | None, kwargs: dict):
    """timm's model as the snippet builds it, on the meta device (no memory, no init cost)."""
    import timm
    from timm.models.vision_transformer import VisionTransformer

    with torch.device("meta"):
        return timm.create_model(name, pretrained=False, **kwargs) if name else VisionTransformer(**kwargs)


def timm_loading(kwargs: dict, model_name: str, state: dict[str, torch.Tensor], path: Path) -> dict:
    """How timm rebuilds this encoder: {"timm_model_name", "timm_create_kwargs", "timm_snippet"}
    (None for an encoder timm cannot hold). The snippet's model is built here (meta device) and
    must have exactly the file's names and shapes, so what it tells users loads with strict=True."""
    if kwargs.get("rpe"):  # iRPE tables: our VisionTransformer only (train.evaluate --encoder)
        return {"timm_model_name": None, "timm_create_kwargs": None, "timm_snippet": None}
    if "timm_model" in kwargs:  # a timm backbone: its own name, without a classifier
        name, create = kwargs["timm_model"], {"num_classes": 0, "in_chans": kwargs["in_chans"]}
        try:  # resolution-dependent models (ViT, Swin) take img_size, convolutional ones do not
            sized = {**create, "img_size": kwargs["img_size"]}
            model, create = _timm_model(name, sized), sized
        except TypeError:
            model = _timm_model(name, create)
        build = f"timm.create_model({name!r}, {_arguments(create)})"
    else:
        name = TIMM_NAMES.get(model_name) if kwargs["img_size"] == 224 else None
        if name:  # timm's defaults: num_classes=1000 (a head this file may not have), token pooling, RGB
            create = {"num_classes": kwargs["num_classes"], "global_pool": kwargs["global_pool"],
                      "in_chans": kwargs["in_chans"]}
            build = f"timm.create_model({name!r}, {_arguments(create)})"
        else:
            create = dict(kwargs)
            build = f"timm.models.vision_transformer.VisionTransformer({_arguments(create)})"
        model = _timm_model(name, create)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in state.items()}
    if theirs != ours:  # a bug here or a timm version that names things otherwise: no snippet that fails
        warnings.warn(f"{build} does not match the exported weights (missing {sorted(set(theirs) - set(ours))[:5]}, "
                      f"unexpected {sorted(set(ours) - set(theirs))[:5]}); encoder.json gets no timm snippet")
        return {"timm_model_name": None, "timm_create_kwargs": None, "timm_snippet": None}
    snippet = "\n".join([
        "import safetensors.torch, timm",
        f"model = {build}",
        f"model.load_state_dict(safetensors.torch.load_file({str(path)!r}))  # strict",
    ])
    return {"timm_model_name": name, "timm_create_kwargs": create, "timm_snippet": snippet}


def readable_as_umask_says(path: Path) -> None:
    """Give `path` the mode a plain open() would have (0666 less the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' Rust writer names the OS's failure


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, whose failed writes (a full disk) are raised as the OSError they are
    rather than a SafetensorError naming no file."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = OS_ERROR.search(str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None


def export_checkpoint(tag_dir: Path, out: Path) -> Path:
    """`out` (the encoder's fp32 weights) and `out` with .json (how timm rebuilds it), each written
    under a temporary name and renamed once both are complete: an interrupted export leaves the
    files as they were."""
    encoder, meta = encoder_state(tag_dir)
    out = Path(out)
    kwargs = meta["encoder_timm_kwargs"]
    info = {
        "timm_kwargs": kwargs,
        "model_name": meta["model_name"],
        **timm_loading(kwargs, meta["model_name"], encoder, out),
        "objective": meta["objective"],
        "step": meta["step"],
        "source": str(tag_dir),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(out) as weights, written_whole(out.with_suffix(".json")) as description:
        save_safetensors(encoder, weights)
        readable_as_umask_says(weights)  # safetensors writes 0600: teammates on a shared file system could not read it
        description.write_text(json.dumps(info, indent=2))
    return out


def export_transformers(tag_dir: Path, out: Path) -> tuple[Path, str]:
    """The checkpoint as a transformers folder; returns (the folder, the transformers class name)."""
    from train.weights.transformers import write_folder

    state = _module_state(tag_dir)
    encoder, meta = _encoder_of(state, tag_dir), read_meta(tag_dir)
    checkpoint_description(meta, tag_dir, encoder)  # before a model of the sizes it claims is built
    out, name = write_folder(encoder, _strip(state, "decoder."), meta, tag_dir, out)
    for path in out.iterdir():
        readable_as_umask_says(path)
    return out, name


def load_timm_encoder(path: Path):
    """Rebuild the exported encoder as a timm VisionTransformer (strict load)."""
    from timm.models.vision_transformer import VisionTransformer

    path = Path(path)
    kwargs = json.loads(path.with_suffix(".json").read_text())["timm_kwargs"]
    model = VisionTransformer(**kwargs)
    model.load_state_dict(safe_load(path), strict=True)
    return model


def find_checkpoint(path: str, option: str) -> Path:
    """The checkpoint tag `path` names (a run folder or checkpoints folder: its latest complete one);
    ConfigError naming `option` when there is none."""
    if not Path(path).exists():
        raise ConfigError(f"{option} {path} does not exist: give a run folder (its latest complete checkpoint is "
                          f"taken) or one of its checkpoints/step* folders")
    try:
        tag = find_resume(path, Path(path))
    except FileNotFoundError as e:  # its message names the option of a resume
        detail = str(e).removeprefix(f"--resume {path!r}: ")
        raise ConfigError(f"{option} {path}: {detail}; give a run folder or one of its checkpoints/step* "
                          f"folders") from None
    try:
        check_layout(tag)
    except LegacyCheckpointError as e:
        raise ConfigError(f"{option}: {e}") from None
    return tag


def in_run_folder(tag_dir: Path) -> bool:
    """The tag is one of a run folder's (<run>/checkpoints/<tag> beside the run's config.json), whose
    default export names are the run's own."""
    return tag_dir.parent.name == "checkpoints" and (tag_dir.parent.parent / "config.json").is_file()


def check_outputs(out: Path, default: Path, tag_dir: Path, overwrite: bool, folder: bool) -> None:
    """Before the checkpoint is read: the export's files (`out`, and for timm its .json beside it)
    can be written, are not inside the checkpoint, and replace no existing file unless --overwrite.
    The run folder's own export (`default`, rewritten at the end of every run) passes here when
    the tag is one of a run folder's (<run>/checkpoints/<tag>, beside the run's config.json): the
    caller has checked that it holds the export of the same step, or has --overwrite
    (train/export.py `check_same_step`); the same path above a tag kept elsewhere may hold anyone's file."""
    if folder:
        outputs = [out]
        if problem := unwritable(out):
            raise ConfigError(f"--out {out} {problem}")
        overwrite = overwrite or (out.is_dir() and not any(out.iterdir()))  # an empty folder: nothing to replace
    else:
        if out.suffix != ".safetensors":  # readers tell the formats apart by the name: x.pt would be read as a pickle
            raise ConfigError(f"--out {out} does not end in .safetensors, the format written (and the name readers go "
                              f"by): give NAME.safetensors")
        if problem := unwritable_file(out):
            raise ConfigError(f"--out {out} {problem}")
        outputs = [out, out.with_suffix(".json")]
    owned = in_run_folder(tag_dir) and out.resolve() == default.resolve()
    for path in outputs:
        check_output(path, [tag_dir], overwrite or owned, "--out" if path == out else "the description beside --out")
        if folder and tag_dir.resolve().is_relative_to(path.resolve()):
            raise ConfigError(f"--out {out} holds the checkpoint {tag_dir} it would be written from (--overwrite "
                              f"never replaces an input); give another folder")
