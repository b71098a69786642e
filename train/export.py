"""Export a pretrained encoder to timm: `<out>.safetensors` (fp32 weights, timm names) and
`<out>.json` (the timm VisionTransformer kwargs that rebuild it).

    python -m train.export --checkpoint runs/x [--out runs/x/encoder.safetensors]

--checkpoint takes a run folder (its latest complete checkpoint) or one checkpoint tag folder.
Rebuild in timm:
    kw = json.load(open("encoder.json"))["timm_kwargs"]
    m = timm.models.vision_transformer.VisionTransformer(**kw)
    m.load_state_dict(safetensors.torch.load_file("encoder.safetensors"))
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from train.checkpoint import find_resume, read_meta, verify_safe

ENCODER_PREFIX = "encoder."
# Our registry name at 224 px -> timm's model name, for users who prefer timm.create_model.
TIMM_NAMES = {
    "vit_tiny_patch16": "vit_tiny_patch16_224", "vit_small_patch16": "vit_small_patch16_224",
    "vit_base_patch16": "vit_base_patch16_224", "vit_large_patch16": "vit_large_patch16_224",
    "vit_huge_patch14": "vit_huge_patch14_224",
}


def _module_state(tag_dir: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """Full-precision module weights. ZeRO-1/2 mixed-precision and ZeRO-3 runs keep the fp32
    master weights only in the optimizer shards, so those are consolidated through DeepSpeed
    (ZeRO-3 writes no whole-model file at all)."""
    half = False
    if zero_stage < 3:
        states = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)["module"]
        # objectives' extra state (e.g. AdPE adversaries under `_extra_state`) is not weights
        states = {k: v for k, v in states.items() if isinstance(v, torch.Tensor)}
        half = any(v.dtype in (torch.float16, torch.bfloat16) for v in states.values())
    if zero_stage == 3 or (zero_stage >= 1 and half):
        from deepspeed.utils.zero_to_fp32 import (
            get_fp32_state_dict_from_zero_checkpoint,
        )

        verify_safe(tag_dir)  # DeepSpeed's reader unpickles without restriction

        return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    return states


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The fp32 tensors under `prefix`, with the prefix removed."""
    return {k[len(prefix):]: v.float().contiguous() for k, v in state.items() if k.startswith(prefix)}


def encoder_state(tag_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The encoder's fp32 weights (timm names) from a checkpoint tag, and its complete.json."""
    meta = read_meta(tag_dir)
    encoder = _strip(_module_state(tag_dir, meta["zero_stage"]), ENCODER_PREFIX)
    if not encoder:
        raise ValueError(f"{tag_dir} holds no '{ENCODER_PREFIX}*' weights")
    return encoder, meta


def pretrained_state(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Encoder (timm names) and, when the run had one, its MAE decoder (official MAE names:
    decoder_embed, decoder_blocks, ...) in fp32: what continued pretraining starts from."""
    encoder, meta = encoder_state(tag_dir)
    return {**encoder, **_strip(_module_state(tag_dir, meta["zero_stage"]), "decoder.")}


def export_checkpoint(tag_dir: Path, out: Path) -> Path:
    encoder, meta = encoder_state(tag_dir)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(encoder, str(out), metadata={"format": "pt"})
    kwargs = meta["encoder_timm_kwargs"]
    info = {
        "timm_kwargs": kwargs,
        "model_name": meta["model_name"],
        "timm_model_name": TIMM_NAMES.get(meta["model_name"]) if kwargs["img_size"] == 224 else None,
        "objective": meta["objective"],
        "step": meta["step"],
        "source": str(tag_dir),
    }
    out.with_suffix(".json").write_text(json.dumps(info, indent=2))
    return out


def load_timm_encoder(path: Path):
    """Rebuild the exported encoder as a timm VisionTransformer (strict load)."""
    from timm.models.vision_transformer import VisionTransformer

    path = Path(path)
    kwargs = json.loads(path.with_suffix(".json").read_text())["timm_kwargs"]
    model = VisionTransformer(**kwargs)
    model.load_state_dict(load_file(str(path)), strict=True)
    return model


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="run folder or checkpoint tag folder")
    parser.add_argument("--out", help="output .safetensors (default: <run folder>/encoder.safetensors)")
    args = parser.parse_args(argv)
    tag_dir = find_resume(args.checkpoint, Path(args.checkpoint))
    out = Path(args.out) if args.out else tag_dir.parent.parent / "encoder.safetensors"
    path = export_checkpoint(tag_dir, out)
    print(f"wrote {path} and {path.with_suffix('.json')} from {tag_dir}")
    return path


if __name__ == "__main__":
    main()
