import math
from types import SimpleNamespace

import pytest
import torch

from model import create_model
from model.objectives import build_objective
from model.objectives.mae import MAEConfig
from train.engine.optim import WarmupCosineSchedule, build_optimizer, param_groups, warmup_cosine


def test_param_groups_split():
    cfg = MAEConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2)
    obj = build_objective("mae", create_model("vit_debug_patch4"), cfg)
    groups, summary = param_groups(obj, 0.05)
    by_id = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    named = dict(obj.named_parameters())
    for name in ["encoder.cls_token", "decoder.mask_token", "encoder.blocks.0.norm1.weight",
                 "encoder.blocks.0.attn.qkv.bias", "encoder.patch_embed.proj.bias", "decoder.decoder_pred.bias"]:
        assert by_id[id(named[name])] == 0.0, name
    for name in ["encoder.blocks.0.attn.qkv.weight", "encoder.patch_embed.proj.weight", "decoder.decoder_embed.weight"]:
        assert by_id[id(named[name])] == 0.05, name
    # fixed sin-cos tables are not optimised at all
    assert id(named["encoder.pos_embed"]) not in by_id and id(named["decoder.decoder_pos_embed"]) not in by_id
    trainable = sum(p.numel() for p in obj.parameters() if p.requires_grad)
    assert summary["decay_params"] + summary["no_decay_params"] == trainable


def test_warmup_cosine_values():
    peak, total, warm = 1.0, 100, 10
    assert warmup_cosine(0, peak, 0.0, warm, total) == 0.0
    assert warmup_cosine(5, peak, 0.0, warm, total) == pytest.approx(0.5)
    assert warmup_cosine(10, peak, 0.0, warm, total) == pytest.approx(1.0)
    assert warmup_cosine(55, peak, 0.0, warm, total) == pytest.approx(0.5)  # half-way through the cosine
    assert warmup_cosine(100, peak, 0.1, warm, total) == pytest.approx(0.1)
    assert warmup_cosine(40, peak, 0.1, warm, total) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3)))
    # past total_steps the cosine does not rise again: the lr stays at min_lr
    assert warmup_cosine(150, peak, 0.1, warm, total) == pytest.approx(0.1)


def test_schedule_sets_every_group_and_resumes():
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [p1]}, {"params": [p2], "lr_scale": 0.5}], lr=0.0)
    s = WarmupCosineSchedule(opt, 2.0, 0.0, 4, 20)
    for _ in range(3):
        s.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.5, 0.75])
    opt2 = torch.optim.AdamW([{"params": [p1]}, {"params": [p2], "lr_scale": 0.5}], lr=0.0)
    s2 = WarmupCosineSchedule(opt2, 2.0, 0.0, 4, 20)
    s2.load_state_dict(s.state_dict())
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]


def test_layer_ids_and_decay_groups():
    from train.engine.optim import layer_decay_groups, layer_id

    assert [layer_id(n, 12) for n in ("cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight",
                                      "blocks.11.mlp.fc2.bias", "norm.weight", "fc_norm.bias", "head.weight")] == \
        [0, 0, 0, 1, 12, 13, 13, 13]
    enc = create_model("vit_debug_patch4", global_pool="avg", num_classes=10)  # depth 2
    groups = layer_decay_groups(enc, weight_decay=0.05, layer_decay=0.5, prefix="encoder.")
    by_name = {n: g for g in groups for n in g["names"]}
    assert by_name["encoder.patch_embed.proj.weight"]["lr_scale"] == 0.5 ** 3  # decay^(depth + 1 - 0)
    assert by_name["encoder.blocks.0.attn.qkv.weight"]["lr_scale"] == 0.5 ** 2
    assert by_name["encoder.blocks.1.attn.qkv.weight"]["lr_scale"] == 0.5
    assert by_name["encoder.head.weight"]["lr_scale"] == 1.0 and by_name["encoder.head.weight"]["weight_decay"] == 0.05
    assert by_name["encoder.head.bias"]["weight_decay"] == 0.0 and by_name["encoder.cls_token"]["weight_decay"] == 0.0
    assert "encoder.pos_embed" not in by_name  # frozen sin-cos table
    trainable = sum(p.numel() for p in enc.parameters() if p.requires_grad)
    assert sum(p.numel() for g in groups for p in g["params"]) == trainable
    # the schedule applies lr_scale
    opt = torch.optim.AdamW([{k: v for k, v in g.items() if k != "names"} for g in groups])
    WarmupCosineSchedule(opt, 1.0, 0.0, 0, 10)
    assert sorted({g["lr"] for g in opt.param_groups}) == [0.125, 0.25, 0.5, 1.0]
    # group by group, the no-decay groups (biases, norms, cls token) too: each layer's lr is peak x its lr_scale
    assert {g["weight_decay"] for g in groups} == {0.0, 0.05}
    assert [g["lr"] for g in opt.param_groups] == [1.0 * g["lr_scale"] for g in groups]


def test_build_optimizer_gives_adamw_the_configured_betas():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([{"params": [p], "weight_decay": 0.05}], SimpleNamespace(name="adamw", betas=(0.9, 0.95)))
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["betas"] for g in opt.param_groups] == [(0.9, 0.95)]  # not torch's default (0.9, 0.999)


def test_build_optimizer_gives_lars_maes_linear_probe_momentum_and_trust_coefficient():
    """MAE's linear probe LARS (util/lars.py): momentum 0.9, trust_coefficient 0.001."""
    from train.engine.optim import LARS

    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([{"params": [p], "weight_decay": 0.0}], SimpleNamespace(name="lars"))
    assert isinstance(opt, LARS)
    assert [(g["momentum"], g["trust_coefficient"]) for g in opt.param_groups] == [(0.9, 0.001)]


def test_lars_step_hand_computed():
    from train.engine.optim import LARS

    w = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))  # ||w|| = 5
    b = torch.nn.Parameter(torch.tensor([1.0]))
    opt = LARS([w, b], lr=0.1, weight_decay=0.5, momentum=0.9, trust_coefficient=0.001)
    w.grad, b.grad = torch.tensor([[1.0, 2.0]]), torch.tensor([2.0])
    opt.step()
    g = torch.tensor([[1.0, 2.0]]) + 0.5 * torch.tensor([[3.0, 4.0]])  # [[2.5, 4]]
    g = g * 0.001 * 5.0 / g.norm()
    assert torch.allclose(w, torch.tensor([[3.0, 4.0]]) - 0.1 * g)
    assert torch.allclose(b, torch.tensor([1.0 - 0.1 * 2.0]))  # 1-D: no decay, no trust ratio
    w.grad, b.grad = torch.zeros(1, 2), torch.tensor([2.0])
    opt.step()  # momentum carries: mu = 0.9 * 2 + 2 = 3.8
    assert torch.allclose(b, torch.tensor([0.8 - 0.1 * 3.8]))


def test_lars_leaves_a_weight_with_a_zero_gradient_as_it_is():
    """No weight decay and an all-zero gradient: ||g|| = 0 takes the trust ratio 1, not
    trust * ||w|| / 0 = inf, which times the zero gradient would write NaN into the weight."""
    from train.engine.optim import LARS

    p = torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
    before = p.detach().clone()
    opt = LARS([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.zeros(3, 4)
    opt.step()
    assert torch.equal(p.detach(), before)


def test_lars_moves_an_all_zero_weight_with_trust_ratio_one():
    """||w|| = 0 takes the trust ratio 1 (MAE's LARS), not trust * 0 / ||g|| = 0, which would keep a
    zero-initialised weight at zero for ever."""
    from train.engine.optim import LARS

    p = torch.nn.Parameter(torch.zeros(2, 3))
    opt = LARS([p], lr=0.1, weight_decay=0.0, momentum=0.9, trust_coefficient=0.001)
    p.grad = torch.ones(2, 3)
    opt.step()  # ratio 1: mu = 1, w = -0.1 * 1
    assert torch.allclose(p.detach(), torch.full((2, 3), -0.1))
    opt.step()  # now ||w|| / ||g|| = 0.1: ratio 0.001 * 0.1, mu = 0.9 * 1 + 1e-4, w = -0.1 - 0.1 * mu
    assert torch.allclose(p.detach(), torch.full((2, 3), -0.1 - 0.1 * (0.9 + 0.001 * 0.1)))
