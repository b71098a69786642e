"""MLO-MAE's knobs for the released code's behaviour (unroll rates, the masking network's input, level II's batch) and the official_code overlay."""
import json
from pathlib import Path

import pytest
import torch

from model.objectives.masking_net import top_masking, weighted_recon_loss
from model.objectives.mlomae import MLOMAEConfig, MLOMAEObjective
from model.registry import create_model

OVERLAY = Path(__file__).parents[3] / "train/configs/mlomae/variants/official_code.json"


def objective(**overrides) -> MLOMAEObjective:
    torch.manual_seed(0)
    encoder = create_model("vit_debug_patch4", img_size=8, in_chans=1)  # 2x2 = 4 patches
    cfg = {"decoder_dim": 16, "decoder_depth": 1, "decoder_heads": 2, "mask_hidden": 8, "num_classes": 3,
           "mask_ratio": 0.5}
    return MLOMAEObjective(encoder, MLOMAEConfig(**{**cfg, **overrides}))


def batch(seed, val=True):
    g = torch.Generator().manual_seed(seed)
    out = {"image": torch.randn(4, 1, 8, 8, generator=g), "label": torch.randint(0, 3, (4,), generator=g)}
    if val:
        out |= {"val_image": torch.randn(4, 1, 8, 8, generator=g), "val_label": torch.randint(0, 3, (4,), generator=g)}
    return out


def patch_embed_grad(obj, b):
    obj.zero_grad(set_to_none=True)
    obj(b)["loss"].backward()
    return obj.encoder.patch_embed.proj.weight.grad.clone()


def test_mask_input_grad_off_is_the_detached_formula_and_on_adds_the_masking_path():
    b = batch(0, val=False)
    off, on = objective(), objective(mask_input_grad=True)
    g_off, g_on = patch_embed_grad(off, b), patch_embed_grad(on, b)
    # off: T's input is data, exactly the formula with detached probabilities
    off.zero_grad(set_to_none=True)
    tokens = off.encoder.embed_patches(b["image"])
    probs = off.aux.mask_net(tokens.detach()).detach()
    masking = top_masking(probs, 0.5)
    weighted_recon_loss(off.reconstruct(b["image"], masking, tokens), masking.mask, probs, False).backward()
    assert torch.equal(g_off, off.encoder.patch_embed.proj.weight.grad)
    # on: the same loss value, a patch-embedding gradient that includes dL1/dp dp/dtokens
    assert torch.equal(off(b)["loss"], on(b)["loss"])
    assert (g_on - g_off).norm() / g_off.norm() > 1e-3
    assert all(p.grad is None for p in on.aux.mask_net.parameters())  # T is still stepped by level III only


def test_mask_input_grad_moves_the_hypergradient():
    stats = {}
    for flag in (False, True):
        obj = objective(mask_input_grad=flag)
        b = batch(1)
        stats[flag] = obj.after_optimizer_step(lr=1e-2, batches=[b])
    assert torch.equal(stats[False]["level3_loss"], stats[True]["level3_loss"])  # same weights, same D_val
    assert not torch.isclose(stats[False]["hypergrad_norm"], stats[True]["hypergrad_norm"], rtol=1e-4)


def seen_by_levels_2_and_3(obj, steps):
    """Per cycle: (images level I stepped on last, the images levels II/III read through cls_features)."""
    seen, out = [], []
    real = obj.cls_features
    obj.cls_features = lambda images: (seen.append(images), real(images))[1]
    for s in steps:
        seen.clear()
        obj.after_optimizer_step(lr=1e-2, batches=s)
        out.append(([b["image"] for b in s], list(seen)))
    return out


def contains(tensors, x):
    return any(t.shape == x.shape and torch.equal(t, x) for t in tensors)


@pytest.mark.parametrize("mode", ["shared", "own"])
def test_level2_batch(mode):
    obj = objective(level2_batch=mode, level1_steps=2, mask_every=1)
    steps = [[batch(10 * i + j, val=(i % 2 == 1 and j == 1)) for j in range(2)] for i in range(6)]  # accum 2
    cycles = seen_by_levels_2_and_3(obj, steps)
    for i, (level1, read) in enumerate(cycles):
        if i % 2 == 0:
            assert read == []  # mid-cycle: no level II
            continue
        tr = [b["image"] for b in steps[i]]
        val = steps[i][1]["val_image"]
        assert contains(read, val)  # level III reads D_val
        read_tr = [x for x in read if not torch.equal(x, val)]
        if mode == "shared":
            assert contains(read_tr, tr[-1])  # level II's batch is level I's latest micro-batch
        else:
            assert read_tr and not any(contains(read_tr, x) for x in tr)  # none of the last level-I step's
            assert contains(read_tr, steps[i - 1][-1]["image"])  # the latest one before it


def test_level2_batch_own_skips_the_first_cycle_without_a_batch_of_its_own():
    obj = objective(level2_batch="own")
    head = [p.detach().clone() for p in obj.aux.head.parameters()]
    assert obj.after_optimizer_step(lr=1e-2, batches=[batch(0)]) == {}
    assert all(torch.equal(a, p) for a, p in zip(head, obj.aux.head.parameters()))
    stats = obj.after_optimizer_step(lr=1e-2, batches=[batch(1)])
    assert "level3_loss" in stats and obj.cycles_done == 2


def test_level2_batch_is_checked():
    with pytest.raises(ValueError, match="level2_batch"):
        objective(level2_batch="mine").cfg.validate()


def test_official_code_overlay():
    """Every knob the overlay claims, pinned on a tiny model: unit unroll rates (the hypergradient
    does not scale with the encoder's lr), T's input carries gradient, level II draws other
    micro-batches, AdamW weight decay 0.01 on all of C and T, T's Adam eps 1e-8."""
    knobs = json.loads(OVERLAY.read_text())["mlomae"]
    assert knobs == {"unroll_lr": "unit", "mask_input_grad": True, "level2_batch": "own", "aux_weight_decay": 0.01,
                     "aux_decay_biases": True, "mask_adam_eps": 1e-8}
    norms = {}
    for unroll in ("unit", "schedule"):
        for lr in (1e-2, 1e-4):  # the head held still (head_lr_scale 0) so that only the unroll rates differ
            obj = objective(**{**knobs, "unroll_lr": unroll, "head_lr_scale": 0.0})
            obj.after_optimizer_step(lr=lr, batches=[batch(0)])
            norms[unroll, lr] = obj.after_optimizer_step(lr=lr, batches=[batch(1)])["hypergrad_norm"]
    torch.testing.assert_close(norms["unit", 1e-2], norms["unit", 1e-4])
    assert norms["schedule", 1e-2] > 10 * norms["schedule", 1e-4]
    obj = objective(**knobs)
    for module, opt in ((obj.aux.mask_net, obj.aux.mask_opt), (obj.aux.head, obj.aux.head_opt)):
        decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.01 for p in g["params"]}
        assert decayed == {id(p) for p in module.parameters()}  # biases included, as torch's AdamW default
    assert obj.aux.mask_opt.param_groups[0]["eps"] == 1e-8  # torch's default, not the project's 1e-16
    b = batch(2, val=False)
    assert (patch_embed_grad(obj, b) - patch_embed_grad(objective(), b)).norm() > 0


def test_official_code_overlay_parses_over_a_preset():
    """The overlay's keys are config fields with valid values (over the debug preset, which needs no data)."""
    from train.config.parsing import parse_args

    repo = OVERLAY.parents[4]
    cfg = parse_args(["--config", str(repo / "train/configs/mlomae/debug.json"), "--config", str(OVERLAY),
                      "--ds_config", str(repo / "ds_configs/cpu_debug.json")]).mlomae
    assert (cfg.unroll_lr, cfg.mask_input_grad, cfg.level2_batch, cfg.aux_decay_biases) == ("unit", True, "own", True)
