"""train/configs/maeplus/variants/official_code.json (over the demo preset) reproduces what AdPE's
official code does; each claim it makes is pinned here on a tiny model."""
import json
from pathlib import Path

import torch

from model import create_model
from model.objectives import build_objective
from model.objectives.maeplus import MAEPlusConfig
from train.engine.optim import build_param_groups

CONFIGS = Path(__file__).resolve().parents[3] / "train" / "configs" / "maeplus"


def _overlay_config(**kw) -> MAEPlusConfig:
    section = {}
    for f in (CONFIGS / "demo.json", CONFIGS / "variants" / "official_code.json"):
        section.update(json.loads(f.read_text()).get("maeplus", {}))
    section.update(decoder_dim=32, decoder_depth=1, decoder_heads=2, **kw)  # tiny
    return MAEPlusConfig(**section)


def test_official_code_overlay_sets_each_official_behaviour():
    cfg = _overlay_config()
    torch.manual_seed(0)
    obj = build_objective("maeplus", create_model("vit_debug_patch4", rpe=cfg.rpe), cfg)
    assert obj.adversaries.update == "adam"  # Adam ascent then projection
    assert obj.replaces_mask_token and not obj.mask_token.requires_grad  # the adversary replaces the mask token
    groups, _ = build_param_groups(obj, weight_decay=0.05, layer_decay=1.0)
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(obj.encoder.cls_token) in decayed  # tokens decayed
    # the adversary token sits in the masked tokens' input: one step moves the loss
    images = torch.randn(2, 3, 28, 28)
    torch.manual_seed(5)
    loss = obj({"image": images})["loss"]
    loss.backward()
    assert obj.adversaries.tensors["ape"].grad.abs().sum() > 0
    # iRPE (when rpe is on): shared tables, decayed
    cfg = _overlay_config(rpe=True)
    obj = build_objective("maeplus", create_model("vit_debug_patch4", rpe=True), cfg)
    tables = [b.attn.rpe for b in (*obj.encoder.blocks, *obj.decoder.decoder_blocks)]
    assert all(t.shared_heads and t.decay_table for t in tables)
    groups, _ = build_param_groups(obj, weight_decay=0.05, layer_decay=1.0)
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert all(id(t.table) in decayed for t in tables)
    # rpe_coord over it: the official code's coordinate lookup, visible rows included
    cfg = _overlay_config(rpe=True, adversary="rpe_coord")
    assert cfg.coord_lookup == "official"
    obj = build_objective("maeplus", create_model("vit_debug_patch4", rpe=True), cfg)
    masked = torch.rand(2, 49) < 0.75
    hooks = obj.rpe_perturbations(masked, torch.float32, "enc", obj.encoder.blocks)
    assert all(h.every_row and h.corners[0].shape == (2, 49, 49, 4) for h in hooks)
