"""Import weights from other formats into our modules (plain PyTorch, safe loading only).

- Official MAE checkpoints (facebookresearch/mae release): `{"model": state_dict}` with timm-style
  encoder names at the top level (cls_token, pos_embed, patch_embed.*, blocks.*, norm.*) and, in
  pretraining checkpoints, the decoder (mask_token, decoder_embed.*, decoder_pos_embed,
  decoder_blocks.*, decoder_norm.*, decoder_pred.*). Fine-tuned ones carry fc_norm/head instead
  of norm; the encoder part is what we import from them.
- timm VisionTransformer state_dicts: our encoder uses timm's names, so they load as they are.

Every file is read by `model/weights_reader.py`, which never unpickles anything but tensors and
plain containers and judges the file before reading it.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import torch

from model.irpe import ContextualRPE
from model.mae_decoder import MAEDecoder
from model.objectives.mae import MAEConfig, MAEObjective
from model.pos_embed import sincos_2d
from model.timm_backbone import TimmBackbone
from model.vit import VisionTransformer
from model.weights_reader import safe_load

DECODER_PREFIXES = ("mask_token", "decoder_")
HEADS_BY_WIDTH = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}  # ViT-Ti/S/B/L/H; heads are not in the weights


def split_official_mae(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """-> (encoder state, decoder state) with our names (decoder keys as MAEDecoder's)."""
    state = state.get("model", state)
    encoder = {k: v for k, v in state.items() if not k.startswith(DECODER_PREFIXES)}
    decoder = {k: v for k, v in state.items() if k.startswith(DECODER_PREFIXES)}
    return encoder, decoder


def _block_name(name: str, prefix: str) -> re.Match | None:
    """`{prefix}.N.rest` (groups: N, rest) with N written as Python writes it (no leading zero, at
    most 9 digits), else None: `blocks.01.x` is not block 1."""
    return re.fullmatch(rf"{prefix}\.(0|[1-9]\d{{0,8}})\.(.+)", name)


def _depth(names, prefix: str, whose: str = "a ViT's", fix: str = "give a whole ViT encoder's weights") -> int:
    """How many blocks `{prefix}.N.*` the names hold; ValueError unless they are numbered 0..n-1 in
    turn: the depth built is the count of blocks the file holds, never a number one name claims."""
    ids = sorted({int(m.group(1)) for k in names if (m := _block_name(k, prefix))})
    if ids and ids[-1] != len(ids) - 1:
        shown = ", ".join(map(str, ids[:3])) + (f", ..., {ids[-1]}" if len(ids) > 3 else "")
        raise ValueError(f"holds {len(ids)} {prefix} numbered {shown}, not 0 to {len(ids) - 1} in turn as {whose} "
                         f"are: {fix}")
    return len(ids)


def accepted_shapes(model: torch.nn.Module) -> dict[str, set[tuple[int, ...]]]:
    """Name -> the shapes `model.load_state_dict` takes for it: its own, and for an iRPE table the
    other head layout too (shared or per head, adopted when loaded: model/irpe.py ContextualRPE)."""
    shapes = {name: {tuple(value.shape)} for name, value in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, ContextualRPE):
            rows, _, width = module.table.shape
            shapes[f"{name}.table"] |= {(rows, 1, width), (rows, module.num_heads, width)}
    return shapes


def shapes_misfit(theirs: dict[str, tuple[int, ...]], ours: dict[str, set[tuple[int, ...]]],
                  depth: int | None = None, blocks: str = "blocks") -> str:
    """How tensors `theirs` (name -> shape) differ from a model's `ours` (accepted_shapes), '' when
    the names and shapes are the same. With `depth`, `ours` is a one-block build whose `{blocks}.0.*`
    stands for each of `depth` blocks: a claimed depth is judged without building it."""
    if depth is not None and (held := _depth(theirs, blocks)) != depth:
        return f"{held} {blocks}, where the model has {depth}"
    for name, shape in theirs.items():
        accepted = ours.get(_as_block_zero(name, blocks) if depth is not None else name)
        if accepted is None:
            return f"a tensor {name}, which the model has not"
        if tuple(shape) not in accepted:
            return f"{name} of shape {list(shape)} (the model's: {' or '.join(str(list(s)) for s in sorted(accepted))})"
    if depth is None:
        expected = iter(ours)
    else:  # every block holds what the template's block 0 holds
        rests = [m.group(2) for name in ours if (m := _block_name(name, blocks))]
        outside = (name for name in ours if not _block_name(name, blocks))
        expected = itertools.chain(outside, (f"{blocks}.{i}.{rest}" for i in range(depth) for rest in rests))
    absent = next((name for name in expected if name not in theirs), None)
    return f"no {absent}, which the model has" if absent else ""


def _as_block_zero(name: str, blocks: str = "blocks") -> str:
    """`{blocks}.N.rest` -> `{blocks}.0.rest`; any other name as it is."""
    m = _block_name(name, blocks)
    return f"{blocks}.0.{m.group(2)}" if m else name


def vit_misfit(arch: dict, theirs: dict[str, tuple[int, ...]]) -> str:
    """How an encoder's tensors (name -> shape; a classifier `head.*` aside) differ from those of
    VisionTransformer(**arch) ('' when they fit exactly). Compared with a one-block build on the
    meta device, so no depth or width the description claims is ever allocated or built."""
    with torch.device("meta"):
        template = VisionTransformer(**{**arch, "depth": 1, "num_classes": 0})
    theirs = {k: v for k, v in theirs.items() if not k.startswith("head.")}
    return shapes_misfit(theirs, accepted_shapes(template), arch["depth"])


def _shape(encoder: dict[str, torch.Tensor], name: str, layout: str, whole: str = "ViT encoder") -> tuple[int, ...]:
    """The shape of encoder[name], which must exist with as many dimensions as `layout` names."""
    if name not in encoder:
        raise ValueError(f"holds no {name} among its {whole} tensors: give a whole {whole}'s weights")
    shape = tuple(encoder[name].shape)
    if len(shape) != layout.count(",") + 1:
        raise ValueError(f"holds a {name} of shape {shape}, not a ViT's {layout}: give the weights as a ViT's "
                         f"state_dict holds them")
    return shape


def infer_encoder_arch(encoder: dict[str, torch.Tensor], num_heads: int | None = None) -> dict:
    """Architecture kwargs of VisionTransformer read off an encoder state_dict."""
    if "patch_embed.proj.weight" not in encoder:
        raise ValueError(f"holds no ViT encoder tensors: no patch_embed.proj.weight among its {len(encoder)} tensors "
                         f"(e.g. {sorted(encoder)[:3]})")
    dim, chans, patch, _ = _shape(encoder, "patch_embed.proj.weight", "(width, channels, patch, patch)")
    grid = round((_shape(encoder, "pos_embed", "(1, 1 + grid, width)")[1] - 1) ** 0.5)
    heads = num_heads or HEADS_BY_WIDTH.get(dim)
    if heads is None:
        raise ValueError(f"cannot infer the number of heads of a {dim}-wide ViT (weights do not hold it; known widths: "
                         f"{', '.join(map(str, HEADS_BY_WIDTH))}): pass num_heads (train.evaluate: --num_heads)")
    if dim % heads:
        raise ValueError(f"{heads} heads do not divide the width {dim}: pass a num_heads that does")
    mlp_ratio = _shape(encoder, "blocks.0.mlp.fc1.weight", "(hidden, width)")[0] / dim
    return dict(img_size=grid * patch, patch_size=patch, in_chans=chans, embed_dim=dim,
                depth=_depth(encoder, "blocks"), num_heads=heads, mlp_ratio=mlp_ratio)


def encoder_from_state(encoder: dict[str, torch.Tensor], num_heads: int | None = None,
                       **overrides) -> VisionTransformer:
    """Our ViT with the weights of a timm / MAE encoder state_dict; a classifier head is dropped.

    A fine-tuned MAE / timm model with average pooling (fc_norm, no final norm) becomes a
    global_pool='avg' encoder, so its features are exactly those it was fine-tuned with.
    `overrides` replace what the state implies (e.g. img_size: the position table is then resized
    to the new grid, resize_pos_embed).
    """
    pool = "avg" if "fc_norm.weight" in encoder and "norm.weight" not in encoder else "token"
    arch = {**infer_encoder_arch(encoder, num_heads), "global_pool": pool}
    problem = vit_misfit(arch, {k: tuple(v.shape) for k, v in encoder.items()})
    if problem:  # judged before building: a tensor's shape sets a size (fc1: the MLP's width) of every block
        raise ValueError(f"does not hold the tensors of one ViT: it holds {problem} (the ViT its patch_embed, "
                         f"pos_embed and blocks.0.mlp.fc1 imply); give a whole ViT encoder's weights")
    model = VisionTransformer(**{**arch, **overrides})
    state = {k: v for k, v in encoder.items() if not k.startswith("head.")}
    if "pos_embed" in state and state["pos_embed"].shape != model.pos_embed.shape:
        state["pos_embed"] = resize_pos_embed(state["pos_embed"], model.patch_embed.grid_size)
    model.load_state_dict(state, strict=True)
    return model


def mae_from_official(path: str | Path, num_heads: int | None = None, decoder_heads: int = 16,
                      **mae_overrides) -> MAEObjective:
    """Our MAE objective (encoder + decoder) from an official MAE pretraining checkpoint."""
    encoder_state, decoder_state = split_official_mae(safe_load(path))
    if not decoder_state:
        raise ValueError(f"{path} has no decoder weights (an encoder-only or fine-tuned checkpoint); "
                         f"use encoder_from_state for those")
    try:
        encoder = encoder_from_state(encoder_state, num_heads)
        width, depth = _decoder_size(decoder_state, decoder_heads)
        cfg = MAEConfig(decoder_dim=width, decoder_depth=depth, decoder_heads=decoder_heads, **mae_overrides)
        if problem := _decoder_misfit(encoder, cfg, decoder_state):
            raise ValueError(f"does not hold the tensors of one MAE decoder: it holds {problem} (the decoder its "
                             f"decoder_embed and the encoder imply); {WHOLE_MAE}")
    except ValueError as e:
        raise ValueError(f"{path} {e}") from None
    objective = MAEObjective(encoder, cfg)
    objective.decoder.load_state_dict(decoder_state, strict=True)
    return objective


WHOLE_MAE = "give a whole MAE pretraining checkpoint"


def _decoder_size(decoder_state: dict[str, torch.Tensor], heads: int) -> tuple[int, int]:
    """(width, depth) of the MAE decoder an official checkpoint holds, read off its decoder_embed
    and the blocks it numbers, with `heads` attention heads; ValueError when they make no decoder."""
    width = _shape(decoder_state, "decoder_embed.weight", "(decoder width, encoder width)", "MAE decoder")[0]
    depth = _depth(decoder_state, "decoder_blocks", "an MAE decoder's", WHOLE_MAE)
    if not depth:
        raise ValueError(f"holds no decoder_blocks beside its decoder_embed: {WHOLE_MAE}")
    if width < 4 or width % 4:
        raise ValueError(f"holds a decoder_embed.weight {width} wide, not a positive multiple of 4 as an MAE decoder's "
                         f"2-D sin-cos position table needs: {WHOLE_MAE}")
    if width % heads:
        raise ValueError(f"holds a decoder {width} wide (decoder_embed.weight), which decoder_heads {heads} does not "
                         f"divide: pass the decoder_heads it was trained with (MAE's: 16)")
    return width, depth


def _decoder_misfit(encoder: VisionTransformer, cfg: MAEConfig, decoder_state: dict[str, torch.Tensor]) -> str:
    """vit_misfit for the MAE decoder `cfg` describes beside `encoder`: compared with a one-block
    build on the meta device, so no width or depth the file claims is allocated before it fits."""
    cfg.validate()
    pe = encoder.patch_embed
    with torch.device("meta"):
        template = MAEDecoder(pe.grid_size, pe.patch_size, pe.proj.in_channels, encoder.embed_dim, cfg.decoder_dim,
                              depth=1, num_heads=cfg.decoder_heads)
    theirs = {k: tuple(v.shape) for k, v in decoder_state.items()}
    return shapes_misfit(theirs, accepted_shapes(template), cfg.decoder_depth, blocks="decoder_blocks")


def resize_pos_embed(table: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(1, 1+n*n, D) position table of a square grid -> (1, 1+gh*gw, D) for `grid`. The fixed sin-cos
    table of pretraining becomes the target grid's own sin-cos table (exact); a learned one (after
    fine-tuning, which trains it) is interpolated bicubically with the cls entry kept, as MAE's
    util/pos_embed.py interpolate_pos_embed does."""
    if table.dim() != 3 or table.shape[0] != 1:
        raise ValueError(f"pos_embed of shape {tuple(table.shape)} is not a (1, 1 + grid, width) position table")
    n, dim = round((table.shape[1] - 1) ** 0.5), table.shape[2]
    if n * n != table.shape[1] - 1:
        raise ValueError(f"pos_embed of {table.shape[1]} entries is not 1 + a square grid")
    if torch.allclose(table.float(), sincos_2d(dim, (n, n), cls_token=True)[None], atol=5e-3):  # bf16 copies too
        return sincos_2d(dim, grid, cls_token=True)[None].to(table.dtype)
    patches = table[:, 1:].reshape(1, n, n, dim).permute(0, 3, 1, 2).float()  # (1, D, n, n)
    patches = torch.nn.functional.interpolate(patches, size=grid, mode="bicubic", align_corners=False)
    return torch.cat([table[:, :1], patches.permute(0, 2, 3, 1).flatten(1, 2).to(table.dtype)], dim=1)


def load_into_objective(objective: torch.nn.Module, path: str | Path,
                        state: dict[str, torch.Tensor] | None = None,
                        head: dict[str, torch.Tensor] | None = None) -> str:
    """Initialise an objective from an official MAE checkpoint, a timm/exported encoder state_dict
    or .safetensors (or an already loaded `state` with those names, read from `path`): the encoder
    always, the MAE decoder too when there is one and the objective owns an MAE decoder. A new
    classifier head (and fc_norm for average pooling) is allowed to stay fresh; `head` (`head.*`)
    is a classifier the caller found to fit the encoder's (same classes, same pooling), loaded
    into it. Returns a one-line summary for the log."""
    encoder_state, decoder_state = split_official_mae(safe_load(path) if state is None else state)
    encoder = objective.encoder
    if isinstance(encoder, TimmBackbone):
        return _load_timm_backbone(encoder, path, encoder_state)
    encoder_state = {k: v for k, v in encoder_state.items() if not k.startswith("head.")}
    fresh = {"head.weight", "head.bias"}  # a classifier is always trained anew
    if encoder.global_pool == "avg":  # MAE fine-tuning: fc_norm is new, the pretraining norm unused
        encoder_state = {k: v for k, v in encoder_state.items() if not k.startswith("norm.")}
        fresh |= {"fc_norm.weight", "fc_norm.bias"}
    pos = encoder_state.get("pos_embed")
    if pos is not None and pos.shape != encoder.pos_embed.shape:
        # Another resolution (MAE+ pretrains on 112 px crops, fine-tunes at 224): a sin-cos table
        # becomes the target grid's own, a fine-tuned (learned) one is interpolated.
        try:
            encoder_state = {**encoder_state, "pos_embed": resize_pos_embed(pos, encoder.patch_embed.grid_size)}
        except ValueError as e:
            raise ValueError(f"{path}: {e}: give the weights as a ViT's state_dict holds them") from None
    try:
        missing, unexpected = encoder.load_state_dict(encoder_state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"{path} does not fit the configured encoder: {e}") from None
    if unexpected or set(missing) - fresh:
        hint = ("; it pools by the mean (fc_norm, no final norm, as fine-tuning leaves it): give --model.global_pool "
                "avg" if "fc_norm.weight" in unexpected and encoder.global_pool == "token" else "")
        raise ValueError(f"{path} does not fit the configured encoder: missing {sorted(set(missing) - fresh)}, "
                         f"unexpected {sorted(unexpected)}{hint}")
    if head:
        encoder.head.load_state_dict({k.removeprefix("head."): v for k, v in head.items()})
        missing = [k for k in missing if not k.startswith("head.")]
    loaded = "encoder" + (" + classifier" if head else "") + (f" (new: {', '.join(sorted(missing))})" if missing else "")
    decoder = getattr(objective, "decoder", None)
    if decoder_state and decoder is not None:
        table = decoder_state.get("decoder_pos_embed")
        if table is not None and table.shape != decoder.decoder_pos_embed.shape:  # another image size: sin-cos anew
            grid = encoder.patch_embed.grid_size
            decoder_state = {**decoder_state, "decoder_pos_embed": resize_pos_embed(table, grid)}
        try:
            decoder.load_state_dict(decoder_state, strict=True)
        except RuntimeError as e:
            raise ValueError(f"{path} has a decoder that does not fit the configured one: {e}") from None
        loaded += " + decoder"
    return f"initialised {loaded} from {path}"


def _load_timm_backbone(encoder: TimmBackbone, path: str | Path, state: dict[str, torch.Tensor]) -> str:
    """A timm backbone (ConvNeXt, Swin, ...) takes its own export or run under timm's names, every
    tensor but a classifier (a timm checkpoint's `head.fc.*`; ConvNeXt's `head.norm` is the
    backbone's own): it has no pooling choice and no sin-cos table to adapt."""
    classifier = encoder.inner.pretrained_cfg.get("classifier") or "head"
    state = {k: v for k, v in state.items() if not k.startswith(classifier + ".")}
    try:
        encoder.load_state_dict(state, strict=True)
    except RuntimeError as e:  # missing / unexpected names, or shapes
        said = " ".join(line.strip() for line in str(e).strip().splitlines()[:3])
        raise ValueError(f"{path} does not fit timm model {encoder.name!r}: {said} (init_from takes weights of the "
                         f"same timm model, at the same img_size and in_chans)") from None
    return f"initialised timm {encoder.name} from {path}"
