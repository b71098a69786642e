"""Hugging Face transformers ViT / ViT-MAE folders <-> our encoder and MAE decoder (plain PyTorch).

A transformers folder is `config.json` (sizes, `architectures`) beside the weights
(`model.safetensors` or `pytorch_model.bin`, or shards listed by their `.index.json`). Reading
one needs no transformers: the config is JSON and the weights are tensors; only building
transformers' own classes (the export, the parity tests) does.

Architectures read: ViTMAEForPreTraining (encoder under `vit.`, decoder under `decoder.`),
ViTMAEModel and ViTModel (the encoder at the top level), ViTForImageClassification (encoder under
`vit.`, `classifier`). Weight names come in two layouts, both read:
- the files of transformers 4.x and every facebook/vit-mae-* / google/vit-* folder:
  `encoder.layer.{i}.attention.attention.{query,key,value}`, `attention.output.dense`,
  `intermediate.dense`, `output.dense`, `layernorm_before/after`; decoder layers
  `decoder.decoder_layers.{i}.` (transformers 5.x writes these as `decoder.decoder_encoder.layer.{i}.`);
- the modules of transformers 5.x: `layers.{i}.attention.{q,k,v,o}_proj`, `mlp.fc1/fc2`.
Exports are written in the first layout, which transformers 4.x and 5.x both load.

Where transformers' ViT differs from ours (docs/CHECKPOINTS.md, each difference tested in
tests/model/test_hf_interop.py): q/k/v are three Linear layers (ours: one `qkv`, concatenated in
that order); layer-norm eps is a config value (1e-12 by default; ours 1e-6); ViTModel has a
`pooler` (dense + tanh on the cls token) ours has none; ViTMAE's `norm_pix_loss` defaults to
false (ours true); ViTMAE's `noise` argument is our batch's `mask_noise` (the smallest noise is
kept in both; ties are ordered by a stable sort here, by argsort there).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model.interop import load_into_objective
from model.weights_reader import safe_load, weights_shapes
from model.objectives.mae import MAEConfig, MAEObjective
from model.pos_embed import sincos_2d
from model.registry import list_models, model_arch
from model.vit import VisionTransformer, default_norm

ARCHITECTURES = ("ViTMAEForPreTraining", "ViTMAEModel", "ViTModel", "ViTForImageClassification")
WITH_VIT_PREFIX = ("ViTMAEForPreTraining", "ViTForImageClassification")  # the encoder's names start with `vit.`
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LAYER_NORM_EPS = default_norm.keywords["eps"]  # ours: 1e-6 in every LayerNorm
# transformers' config defaults (configuration_vit.py / configuration_vit_mae.py): config.json files
# written by transformers 4.x leave out the values equal to them.
DEFAULTS = {
    "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
    "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "layer_norm_eps": 1e-12,
    "image_size": 224, "patch_size": 16, "num_channels": 3, "qkv_bias": True,
    # ViTMAEConfig only
    "decoder_num_attention_heads": 16, "decoder_hidden_size": 512, "decoder_num_hidden_layers": 8,
    "decoder_intermediate_size": 2048, "mask_ratio": 0.75, "norm_pix_loss": False,
}

# Inside one transformer layer: transformers' name (4.x file | 5.x module) -> ours.
LAYER_PARTS = {
    "layernorm_before": "norm1", "layernorm_after": "norm2",
    "attention.output.dense": "attn.proj", "attention.o_proj": "attn.proj",
    "intermediate.dense": "mlp.fc1", "mlp.fc1": "mlp.fc1",
    "output.dense": "mlp.fc2", "mlp.fc2": "mlp.fc2",
}
QKV_PARTS = {  # -> the row block of our fused qkv: (3D, D) = [query; key; value]
    "attention.attention.query": 0, "attention.q_proj": 0,
    "attention.attention.key": 1, "attention.k_proj": 1,
    "attention.attention.value": 2, "attention.v_proj": 2,
}
LAYER_PARTS_OUT = {"norm1": "layernorm_before", "norm2": "layernorm_after", "attn.proj": "attention.output.dense",
                   "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense"}
QKV_OUT = ("attention.attention.query", "attention.attention.key", "attention.attention.value")
ENCODER_LAYER = re.compile(r"^(?:encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$")
DECODER_LAYER = re.compile(r"^decoder\.(?:decoder_layers|decoder_encoder\.layer)\.(\d+)\.(.+)\.(weight|bias)$")
ENCODER_OTHER = {
    "embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias",
}
DECODER_OTHER = ("decoder_embed.weight", "decoder_embed.bias", "mask_token", "decoder_pos_embed",
                 "decoder_norm.weight", "decoder_norm.bias", "decoder_pred.weight", "decoder_pred.bias")
POOLER = ("pooler.dense.weight", "pooler.dense.bias")  # ViTModel's dense + tanh on the cls token: no counterpart


@dataclass
class Split:
    """A transformers state_dict in our names: encoder (timm names), MAE decoder (official MAE
    names, as MAEDecoder's), classifier (`head.*`), and what has no counterpart (ViTModel's pooler)."""

    encoder: dict[str, torch.Tensor] = field(default_factory=dict)
    decoder: dict[str, torch.Tensor] = field(default_factory=dict)
    head: dict[str, torch.Tensor] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)


def is_transformers_folder(path: str | Path) -> bool:
    """A folder whose config.json is a transformers config (it has `model_type` or `architectures`;
    our run folders' config.json holds the run's options instead)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deep
        return False
    return isinstance(data, dict) and ("model_type" in data or "architectures" in data)


# The config.json values read here, by type: a value of another type is refused naming its key
POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "num_channels",
                 "decoder_num_attention_heads", "decoder_hidden_size", "decoder_num_hidden_layers",
                 "decoder_intermediate_size")
SQUARE_SIZES = ("image_size", "patch_size")  # an int, or [h, w]


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_config(folder: str | Path) -> dict:
    """config.json with transformers' defaults filled in; refuses an architecture we do not map and
    a value of a type transformers would not write (ValueError naming the key)."""
    folder = Path(folder)
    try:
        saved = json.loads((folder / "config.json").read_text())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise ValueError(f"{folder}/config.json is not readable JSON ({e})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{folder}/config.json holds a JSON {type(saved).__name__}, not a transformers config")
    config = {**DEFAULTS, **saved}
    bad = [f"{key} {json.dumps(config[key])} (a positive integer)" for key in POSITIVE_INTS if not _positive_int(config[key])]
    bad += [f"{key} {json.dumps(config[key])} (a positive integer or [h, w])" for key in SQUARE_SIZES
            if not (_positive_int(config[key]) or (isinstance(config[key], list) and len(config[key]) == 2
                                           and all(map(_positive_int, config[key]))))]
    if not isinstance(config["hidden_act"], str) or not isinstance(config["qkv_bias"], bool):
        bad.append(f"hidden_act {json.dumps(config['hidden_act'])} / qkv_bias {json.dumps(config['qkv_bias'])} "
                   f"(a name / true or false)")
    if bad:
        raise ValueError(f"{folder}/config.json gives {'; '.join(bad)}: not a config transformers wrote; save the "
                         f"model again with save_pretrained")
    names = config.get("architectures") or []
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise ValueError(f"{folder}/config.json names architectures {names or 'none'}; a transformers folder is read "
                         f"as one of {', '.join(ARCHITECTURES)}: save the model with one of those classes "
                         f"(e.g. ViTModel.from_pretrained(...).save_pretrained(folder))")
    return config


def architecture(config: dict) -> str:
    return config["architectures"][0]


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files of a folder: one file, or the shards an `.index.json` lists."""
    folder = Path(folder)
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return [folder / name]
        index = folder / f"{name}.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map")
            except (UnicodeDecodeError, ValueError, AttributeError, RecursionError) as e:
                raise ValueError(f"{index} is not a JSON object of transformers' shard index ({e})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index} has no weight_map of tensor name -> shard file: save the model again with "
                                 f"save_pretrained, or fetch the index again")
            shards = [folder / shard for shard in sorted(set(weight_map.values()))]
            missing = [shard.name for shard in shards if not shard.is_file()]
            if missing:
                raise ValueError(f"{index} lists shards the folder lacks: {missing[:3]}; fetch them into {folder}")
            return shards
    raise ValueError(f"{folder} has a transformers config.json but no weights ({' or '.join(WEIGHT_FILES)}): "
                     f"fetch the weight file into the folder too (e.g. huggingface-cli download <repo> --local-dir "
                     f"{folder})")


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder (safetensors, or torch files loaded with weights_only=True)."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        state.update(safe_load(path))
    return state


def _square(config: dict, key: str) -> int:
    value = config[key]
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"config.json {key} {value} is not square; this ViT takes square images and patches")
        value = value[0]
    return int(value)


def encoder_arch(config: dict) -> dict:
    """VisionTransformer kwargs of a transformers ViT / ViT-MAE config."""
    if config["hidden_act"] != "gelu":
        raise ValueError(f"config.json hidden_act is {config['hidden_act']!r}; this ViT's MLP uses the exact GELU "
                         f"('gelu'), so the weights would compute something else")
    if not config["qkv_bias"]:
        raise ValueError("config.json has qkv_bias false; this ViT's attention has query/key/value biases")
    dim = config["hidden_size"]
    return dict(img_size=_square(config, "image_size"), patch_size=_square(config, "patch_size"),
                in_chans=config["num_channels"], embed_dim=dim, depth=config["num_hidden_layers"],
                num_heads=config["num_attention_heads"], mlp_ratio=config["intermediate_size"] / dim)


def decoder_arch(config: dict) -> dict:
    """MAEConfig's decoder fields of a ViTMAE config (our decoder's MLP is 4x its width)."""
    dim = config["decoder_hidden_size"]
    if config["decoder_intermediate_size"] != 4 * dim:
        raise ValueError(f"config.json decoder_intermediate_size {config['decoder_intermediate_size']} is not 4 x "
                         f"decoder_hidden_size {dim}; the MAE decoder here has a 4x MLP")
    return dict(decoder_dim=dim, decoder_depth=config["decoder_num_hidden_layers"],
                decoder_heads=config["decoder_num_attention_heads"])


# --- checks before start ---------------------------------------------------------------------------

ENCODER_SIZES = (  # (transformers config key, ours, our value in transformers' terms)
    ("hidden_size", "embed_dim", lambda a: a["embed_dim"]),
    ("num_hidden_layers", "depth", lambda a: a["depth"]),
    ("num_attention_heads", "num_heads", lambda a: a["num_heads"]),
    ("intermediate_size", "embed_dim x mlp_ratio", lambda a: int(a["embed_dim"] * a["mlp_ratio"])),
    ("patch_size", "patch_size", lambda a: a["patch_size"]),
    ("num_channels", "in_chans", lambda a: a["in_chans"]),
)
DECODER_SIZES = {"decoder_dim": "decoder_hidden_size", "decoder_depth": "decoder_num_hidden_layers",
                 "decoder_heads": "decoder_num_attention_heads"}  # MAEConfig field -> ViTMAEConfig key


def _same_sizes(theirs: dict) -> list[str]:
    """Registered models of the folder's sizes (any image size: position tables are resized)."""
    keys = ("embed_dim", "depth", "num_heads", "mlp_ratio", "patch_size")
    return [name for name in list_models() if all(model_arch(name)[k] == theirs[k] for k in keys)]


def check_folder_fits(folder: str | Path, model_name: str, arch: dict, decoder_options: dict[str, int]) -> None:
    """Before start: the folder is readable (known architecture, weights present and sound) and its
    config's sizes are those of `model_name` (`arch`: its VisionTransformer kwargs) and, for a
    ViTMAEForPreTraining folder, of the objective's decoder (`decoder_options`, e.g.
    {"mae.decoder_dim": 512, "mae.decoder_depth": 8, "mae.decoder_heads": 16}; empty when the
    objective has no MAE decoder). A mismatch names both values. Another image size is allowed."""
    config = read_config(folder)
    for path in weight_files(folder):  # each judged whole from its header (or a memory map): WeightsFileError
        weights_shapes(path)
    theirs = encoder_arch(config)
    if not arch.get("depth"):
        raise ValueError(f"{folder} holds a transformers ViT, which initialises this repository's ViT; model.name "
                         f"{model_name} is a timm backbone: give a vit_* model.name")
    wrong = [f"config.json {key} {_square(config, key)} vs {model_name}'s {ours} {mapped(arch)}"
             for key, ours, mapped in ENCODER_SIZES if _square(config, key) != mapped(arch)]
    if wrong:
        same = _same_sizes(theirs)
        fix = f"give --model.name {' or '.join(same)}" if same else "give a model.name of the folder's sizes"
        if len(wrong) == 1 and wrong[0].startswith("config.json num_channels"):  # the sizes fit: the input channels differ
            fix = f"give --model.in_chans {theirs['in_chans']}"
        raise ValueError(f"{folder} ({architecture(config)}) does not fit the configured encoder: {'; '.join(wrong)}; "
                         f"{fix} (or another folder)")
    if architecture(config) == "ViTMAEForPreTraining" and decoder_options:
        want = decoder_arch(config)
        fields = {option: option.rpartition(".")[2] for option in decoder_options}
        wrong = [f"config.json {DECODER_SIZES[f]} {want[f]} vs --{option} {decoder_options[option]}"
                 for option, f in fields.items() if want[f] != decoder_options[option]]
        if wrong:
            fix = " ".join(f"--{option} {want[f]}" for option, f in fields.items())
            raise ValueError(f"{folder}'s MAE decoder does not fit the configured one: {'; '.join(wrong)}; give {fix}")


# --- names ---------------------------------------------------------------------------------------

def from_transformers(state: dict[str, torch.Tensor]) -> Split:
    """A transformers ViT / ViT-MAE state_dict (either layout, with or without `vit.`) in our names."""
    split, qkv = Split(), {}  # qkv: (stack, layer, weight|bias) -> {row block: tensor}
    unknown = []
    for key, value in state.items():
        name = key.removeprefix("vit.")
        if (m := ENCODER_LAYER.match(name)) or (m := DECODER_LAYER.match(key)):
            stack = "decoder_blocks" if m.re is DECODER_LAYER else "blocks"
            target = split.decoder if m.re is DECODER_LAYER else split.encoder
            index, part, kind = m.groups()
            if part in QKV_PARTS:
                qkv.setdefault((stack, int(index), kind), {})[QKV_PARTS[part]] = value
            elif part in LAYER_PARTS:
                target[f"{stack}.{index}.{LAYER_PARTS[part]}.{kind}"] = value
            else:
                unknown.append(key)
        elif name in ENCODER_OTHER:
            split.encoder[ENCODER_OTHER[name]] = value
        elif key.startswith("decoder.") and key.removeprefix("decoder.") in DECODER_OTHER:
            split.decoder[key.removeprefix("decoder.")] = value
        elif key.startswith("classifier."):
            split.head[key.replace("classifier.", "head.", 1)] = value
        elif name in POOLER:
            split.dropped.append(key)
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"weights with names a transformers ViT / ViT-MAE does not have: {sorted(unknown)[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''}")
    for (stack, index, kind), blocks in sorted(qkv.items()):
        if sorted(blocks) != [0, 1, 2]:
            raise ValueError(f"layer {index} of the {'decoder' if stack == 'decoder_blocks' else 'encoder'} lacks some "
                             f"of its query/key/value {kind}s")
        target = split.decoder if stack == "decoder_blocks" else split.encoder
        target[f"{stack}.{index}.attn.qkv.{kind}"] = torch.cat([blocks[0], blocks[1], blocks[2]], dim=0)  # (3D[, D])
    return split


def to_transformers(encoder: dict[str, torch.Tensor], decoder: dict[str, torch.Tensor] | None = None,
                    head: dict[str, torch.Tensor] | None = None, vit_prefix: bool = False) -> dict[str, torch.Tensor]:
    """Our encoder (timm names), MAE decoder and `head.*` -> a transformers state_dict in the files'
    layout (4.x names: what every published ViT / ViT-MAE folder holds). Tensors are cloned and
    contiguous (safetensors refuses views of one storage, as the split qkv rows would be)."""
    out: dict[str, torch.Tensor] = {}
    prefix = "vit." if vit_prefix else ""
    other = {ours: theirs for theirs, ours in ENCODER_OTHER.items()}

    def layer(stack_out: str, index: str, part: str, kind: str, value: torch.Tensor) -> None:
        if part == "attn.qkv":  # (3D[, D]) -> query, key, value
            for name, block in zip(QKV_OUT, value.chunk(3, dim=0)):
                out[f"{stack_out}.{index}.{name}.{kind}"] = block.clone().contiguous()
        elif part in LAYER_PARTS_OUT:
            out[f"{stack_out}.{index}.{LAYER_PARTS_OUT[part]}.{kind}"] = value.clone().contiguous()
        else:
            raise ValueError(f"{stack_out} layer {index} has {part}.{kind}, which transformers' ViT has no place for")

    for key, value in encoder.items():
        if m := re.match(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$", key):
            layer(f"{prefix}encoder.layer", m.group(1), m.group(2), m.group(3), value)
        elif key in other:
            out[prefix + other[key]] = value.clone().contiguous()
        else:
            raise ValueError(f"encoder weight {key} has no place in transformers' ViT (iRPE tables, fc_norm of "
                             f"average pooling, or a timm backbone's)")
    for key, value in (decoder or {}).items():
        if m := re.match(r"^decoder_blocks\.(\d+)\.(.+)\.(weight|bias)$", key):
            layer("decoder.decoder_layers", m.group(1), m.group(2), m.group(3), value)
        elif key in DECODER_OTHER:
            out[f"decoder.{key}"] = value.clone().contiguous()
        else:
            raise ValueError(f"decoder weight {key} has no place in transformers' ViT-MAE decoder")
    for key, value in (head or {}).items():
        out[key.replace("head.", "classifier.", 1)] = value.clone().contiguous()
    return out


def transformers_config(arch: dict, decoder: dict | None = None, mask_ratio: float = 0.75,
                        norm_pix_loss: bool = True) -> dict:
    """ViTConfig / ViTMAEConfig keyword arguments of our encoder (`arch`: its VisionTransformer
    kwargs) and, for ViTMAE, MAE decoder (`decoder`: MAEConfig's decoder fields)."""
    dim = arch["embed_dim"]
    config = dict(hidden_size=dim, num_hidden_layers=arch["depth"], num_attention_heads=arch["num_heads"],
                  intermediate_size=int(dim * arch["mlp_ratio"]), hidden_act="gelu", hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, layer_norm_eps=LAYER_NORM_EPS, image_size=arch["img_size"],
                  patch_size=arch["patch_size"], num_channels=arch["in_chans"], qkv_bias=True)
    if decoder is not None:
        config.update(decoder_hidden_size=decoder["decoder_dim"], decoder_num_hidden_layers=decoder["decoder_depth"],
                      decoder_num_attention_heads=decoder["decoder_heads"],
                      decoder_intermediate_size=4 * decoder["decoder_dim"], mask_ratio=mask_ratio,
                      norm_pix_loss=norm_pix_loss)
    return config


# --- into our modules ------------------------------------------------------------------------------

def config_notes(config: dict, objective_cfg: object | None = None) -> list[str]:
    """What of a transformers config this repository's modules do not reproduce, for the log."""
    notes = []
    if config["layer_norm_eps"] != LAYER_NORM_EPS:
        notes.append(f"layer_norm_eps {config['layer_norm_eps']:g} read as {LAYER_NORM_EPS:g} (this ViT's)")
    dropout = {k: config[k] for k in ("hidden_dropout_prob", "attention_probs_dropout_prob") if config[k]}
    if dropout:
        notes.append(f"{', '.join(f'{k} {v:g}' for k, v in dropout.items())} not applied (this ViT has no dropout)")
    if architecture(config) == "ViTMAEForPreTraining" and objective_cfg is not None:
        for key in ("norm_pix_loss", "mask_ratio"):
            ours = getattr(objective_cfg, key, None)
            if ours is not None and ours != config[key]:
                notes.append(f"config.json {key} {config[key]}, this run {objective_cfg.section}.{key} {ours}")
    return notes


def head_misfit(encoder: torch.nn.Module, head: dict[str, torch.Tensor]) -> str | None:
    """Why a transformers classifier (`head.*`, trained on the cls token) cannot continue as the
    encoder's head, or None when it can (same classes, cls-token pooling)."""
    classes = head["head.weight"].shape[0]
    ours = getattr(encoder, "head", None)
    if not isinstance(ours, torch.nn.Linear):
        return f"classifier ({classes} classes) not loaded: the objective's encoder has no head"
    if ours.weight.shape != head["head.weight"].shape:
        return f"classifier not loaded: {classes} classes in the folder, {ours.out_features} configured"
    if encoder.global_pool != "token":
        return "classifier not loaded: it was trained on the cls token, model.global_pool is avg"
    return None


def read_folder(folder: str | Path) -> tuple[dict, Split, list[str]]:
    """(config with defaults, the weights in our names, notes for the log) of a transformers folder.

    ViT-MAE's position tables are fixed sin-cos (never trained), and transformers builds them as
    zeros when a model is made from a config without weights (the decoder's in 4.x, both in 5.x):
    a folder saved from such a model carries zero tables, which become the sin-cos tables here."""
    config = read_config(folder)
    arch = encoder_arch(config)  # refuses an activation / bias layout this ViT does not compute
    split = from_transformers(read_weights(folder))
    notes = []
    if architecture(config).startswith("ViTMAE"):
        grid = (arch["img_size"] // arch["patch_size"],) * 2
        for part, key in ((split.encoder, "pos_embed"), (split.decoder, "decoder_pos_embed")):
            table = part.get(key)
            if table is not None and not table[:, 1:].any():  # (1, 1+N, D), the cls row is zero anyway
                part[key] = sincos_2d(table.shape[-1], grid, cls_token=True)[None].to(table.dtype)
                notes.append(f"{key} all zero in the folder (a ViT-MAE made from a config): the fixed sin-cos table")
    return config, split, notes


def load_transformers_folder(objective: torch.nn.Module, folder: str | Path) -> str:
    """Initialise an objective from a transformers folder: the encoder always, the MAE decoder of
    a ViTMAEForPreTraining folder when the objective has one, the classifier of a
    ViTForImageClassification folder when the objective's encoder has a head of the same classes
    on the cls token. Position tables of another image size are resized (model.interop). Returns a
    one-line summary for the log."""
    config, split, notes = read_folder(folder)
    notes += config_notes(config, getattr(objective, "cfg", None))
    misfit = head_misfit(objective.encoder, split.head) if split.head else None
    if misfit:
        notes.append(misfit)
    if split.dropped:
        notes.append("ViTModel's pooler (dense + tanh) dropped: this ViT has none")
    loaded = load_into_objective(objective, folder, {**split.encoder, **split.decoder},
                                 head=split.head if split.head and not misfit else None)
    return f"{loaded} ({architecture(config)}{'; ' + '; '.join(notes) if notes else ''})"


def encoder_from_transformers(folder: str | Path, **overrides) -> VisionTransformer:
    """Our ViT with the encoder (and classifier, if any) of a transformers folder: strict load."""
    config, split, _ = read_folder(folder)
    classes = split.head["head.weight"].shape[0] if split.head else 0
    model = VisionTransformer(**encoder_arch(config), num_classes=classes, **overrides)
    model.load_state_dict({**split.encoder, **split.head}, strict=True)
    return model


def mae_from_transformers(folder: str | Path, **mae_overrides) -> MAEObjective:
    """Our MAE objective (encoder + decoder) from a ViTMAEForPreTraining folder; the config's mask
    ratio and norm_pix_loss unless overridden."""
    config = read_config(folder)
    if architecture(config) != "ViTMAEForPreTraining":
        raise ValueError(f"{folder} holds a {architecture(config)}, which has no MAE decoder; use "
                         f"encoder_from_transformers")
    _, split, _ = read_folder(folder)
    cfg = MAEConfig(**{**decoder_arch(config), "mask_ratio": config["mask_ratio"],
                       "norm_pix_loss": config["norm_pix_loss"], **mae_overrides})
    objective = MAEObjective(VisionTransformer(**encoder_arch(config)), cfg)
    objective.encoder.load_state_dict(split.encoder, strict=True)
    objective.decoder.load_state_dict(split.decoder, strict=True)
    return objective
