"""Import weights from other formats into our modules (plain PyTorch, safe loading only).

- Official MAE checkpoints (facebookresearch/mae release): `{"model": state_dict}` with timm-style
  encoder names at the top level (cls_token, pos_embed, patch_embed.*, blocks.*, norm.*) and, in
  pretraining checkpoints, the decoder (mask_token, decoder_embed.*, decoder_pos_embed,
  decoder_blocks.*, decoder_norm.*, decoder_pred.*). Fine-tuned ones carry fc_norm/head instead
  of norm; the encoder part is what we import from them.
- timm VisionTransformer state_dicts: our encoder uses timm's names, so they load as they are.

Files are read with `torch.load(weights_only=True)` (or safetensors): nothing but tensors and
plain containers is ever unpickled.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from model.objectives.mae import MAEConfig, MAEObjective
from model.pos_embed import sincos_2d
from model.vit import VisionTransformer

DECODER_PREFIXES = ("mask_token", "decoder_")
HEADS_BY_WIDTH = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}  # ViT-Ti/S/B/L/H; heads are not in the weights


def safe_load(path: str | Path) -> dict[str, torch.Tensor]:
    """A .safetensors file or a torch file holding tensors in plain containers; never arbitrary objects."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError (or RuntimeError) for anything beyond tensors
        raise ValueError(
            f"{path} holds objects other than tensors and plain containers, which are not unpickled for "
            f"safety ({type(e).__name__}); re-save it as a state_dict or .safetensors"
        ) from None


def split_official_mae(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """-> (encoder state, decoder state) with our names (decoder keys as MAEDecoder's)."""
    state = state.get("model", state)
    encoder = {k: v for k, v in state.items() if not k.startswith(DECODER_PREFIXES)}
    decoder = {k: v for k, v in state.items() if k.startswith(DECODER_PREFIXES)}
    return encoder, decoder


def _depth(state: dict, prefix: str) -> int:
    ids = {int(m.group(1)) for k in state if (m := re.match(rf"{prefix}\.(\d+)\.", k))}
    return max(ids) + 1 if ids else 0


def infer_encoder_arch(encoder: dict[str, torch.Tensor], num_heads: int | None = None) -> dict:
    """Architecture kwargs of VisionTransformer read off an encoder state_dict."""
    w = encoder["patch_embed.proj.weight"]  # (D, C, p, p)
    dim, chans, patch = w.shape[0], w.shape[1], w.shape[2]
    grid = round((encoder["pos_embed"].shape[1] - 1) ** 0.5)
    heads = num_heads or HEADS_BY_WIDTH.get(dim)
    if heads is None:
        raise ValueError(f"cannot infer the number of heads of a {dim}-wide ViT; pass num_heads")
    mlp_ratio = encoder["blocks.0.mlp.fc1.weight"].shape[0] / dim
    return dict(img_size=grid * patch, patch_size=patch, in_chans=chans, embed_dim=dim,
                depth=_depth(encoder, "blocks"), num_heads=heads, mlp_ratio=mlp_ratio)


def encoder_from_state(encoder: dict[str, torch.Tensor], num_heads: int | None = None,
                       **overrides) -> VisionTransformer:
    """Our ViT with the weights of a timm / MAE encoder state_dict; a classifier head is dropped.

    A fine-tuned MAE / timm model with average pooling (fc_norm, no final norm) becomes a
    global_pool='avg' encoder, so its features are exactly those it was fine-tuned with.
    """
    pool = "avg" if "fc_norm.weight" in encoder and "norm.weight" not in encoder else "token"
    model = VisionTransformer(**infer_encoder_arch(encoder, num_heads), global_pool=pool, **overrides)
    model.load_state_dict({k: v for k, v in encoder.items() if not k.startswith("head.")}, strict=True)
    return model


def mae_from_official(path: str | Path, num_heads: int | None = None, decoder_heads: int = 16,
                      **mae_overrides) -> MAEObjective:
    """Our MAE objective (encoder + decoder) from an official MAE pretraining checkpoint."""
    encoder_state, decoder_state = split_official_mae(safe_load(path))
    if not decoder_state:
        raise ValueError(f"{path} has no decoder weights (an encoder-only or fine-tuned checkpoint); "
                         f"use encoder_from_state for those")
    cfg = MAEConfig(decoder_dim=decoder_state["decoder_embed.weight"].shape[0],
                    decoder_depth=_depth(decoder_state, "decoder_blocks"), decoder_heads=decoder_heads,
                    **mae_overrides)
    objective = MAEObjective(encoder_from_state(encoder_state, num_heads), cfg)
    objective.decoder.load_state_dict(decoder_state, strict=True)
    return objective


def resize_pos_embed(table: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(1, 1+n*n, D) position table of a square grid -> (1, 1+gh*gw, D) for `grid`. The fixed sin-cos
    table of pretraining becomes the target grid's own sin-cos table (exact); a learned one (after
    fine-tuning, which trains it) is interpolated bicubically with the cls entry kept, as MAE's
    util/pos_embed.py interpolate_pos_embed does."""
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
    encoder_state = {k: v for k, v in encoder_state.items() if not k.startswith("head.")}
    fresh = {"head.weight", "head.bias"}  # a classifier is always trained anew
    if encoder.global_pool == "avg":  # MAE fine-tuning: fc_norm is new, the pretraining norm unused
        encoder_state = {k: v for k, v in encoder_state.items() if not k.startswith("norm.")}
        fresh |= {"fc_norm.weight", "fc_norm.bias"}
    pos = encoder_state.get("pos_embed")
    if pos is not None and pos.shape != encoder.pos_embed.shape:
        # Another resolution (MAE+ pretrains on 112 px crops, fine-tunes at 224): a sin-cos table
        # becomes the target grid's own, a fine-tuned (learned) one is interpolated.
        encoder_state = {**encoder_state, "pos_embed": resize_pos_embed(pos, encoder.patch_embed.grid_size)}
    try:
        missing, unexpected = encoder.load_state_dict(encoder_state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"{path} does not fit the configured encoder: {e}") from None
    if unexpected or set(missing) - fresh:
        raise ValueError(f"{path} does not fit the configured encoder: missing {sorted(set(missing) - fresh)}, "
                         f"unexpected {sorted(unexpected)}")
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
