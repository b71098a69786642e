import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.data import Mixup

from model import create_model
from model.interop import load_into_objective
from model.objectives import build_objective
from model.objectives.finetune import FinetuneConfig
from train.engine.optim import build_param_groups


def _ft(**kw):
    torch.manual_seed(0)
    enc = create_model("vit_debug_patch4", global_pool="avg", drop_path_rate=0.1)
    return build_objective("finetune", enc, FinetuneConfig(num_classes=4, **kw))


def test_head_init_and_plain_label_smoothing():
    ft = _ft(mixup=0.0, cutmix=0.0, smoothing=0.1).train()
    w = ft.encoder.head.weight
    assert w.shape == (4, 32) and w.abs().max() < 1e-4 and torch.all(ft.encoder.head.bias == 0)
    # MAE's main_finetune.py: trunc_normal_(head.weight, std=2e-5); 128 draws, a 25% band is 4 sigma
    assert abs(w.std().item() / 2e-5 - 1) < 0.25
    images, labels = torch.randn(4, 3, 28, 28), torch.tensor([0, 1, 2, 3])
    torch.manual_seed(5)
    loss = ft({"image": images, "label": labels})["loss"]
    torch.manual_seed(5)  # same drop-path draws
    logp = F.log_softmax(ft.predict(images), -1)
    want = (0.9 * -logp.gather(1, labels[:, None])[:, 0] + 0.1 * -logp.mean(-1)).mean()
    assert torch.allclose(loss, want, atol=1e-6)


@pytest.mark.parametrize("mixup, cutmix", [(0.8, 1.0), (0.8, 0.0), (0.0, 1.0)])
def test_mixup_loss_is_soft_target_ce_of_timm_mixup(mixup, cutmix):
    """Either alpha alone turns mixing on (mixup only, or cutmix only, is a valid recipe)."""
    ft = _ft(mixup=mixup, cutmix=cutmix).train()
    assert ft.mixup is not None and ft.mixup.label_smoothing == 0.1  # the config's smoothing goes into the soft targets
    with torch.no_grad():  # logits away from 0, where the soft-target CE no longer ignores the targets
        ft.encoder.head.weight.normal_()
    images, labels = torch.randn(4, 3, 28, 28), torch.tensor([0, 1, 2, 3])
    np.random.seed(3)
    torch.manual_seed(5)
    loss = ft({"image": images.clone(), "label": labels})["loss"]  # timm's Mixup mixes its input in place
    np.random.seed(3)
    mixed, soft = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=0.1, num_classes=4)(images.clone(),
                                                                                                    labels)
    assert torch.allclose(soft.sum(1), torch.ones(4)) and (soft.max(1).values < 1).all()
    torch.manual_seed(5)
    want = (-soft * F.log_softmax(ft.predict(mixed), -1)).sum(-1).mean()
    assert torch.allclose(loss, want, atol=1e-6)
    with pytest.raises(ValueError, match="even micro-batch"):
        ft({"image": images[:3], "label": labels[:3]})
    ft.eval()  # no mixing at evaluation
    assert torch.isfinite(ft({"image": images[:3], "label": labels[:3]})["loss"])


def test_layer_decay_groups_cover_every_trainable_parameter_once():
    ft = _ft()
    groups, summary = build_param_groups(ft, 0.05, 0.65)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == sum(1 for p in ft.parameters() if p.requires_grad)
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    assert scale[id(ft.encoder.head.weight)] == 1.0
    assert scale[id(ft.encoder.patch_embed.proj.weight)] == pytest.approx(0.65 ** 3)
    assert summary["layer_groups"] >= 6


def test_mae_encoder_initialises_the_finetuning_model(tmp_path):
    torch.manual_seed(1)
    mae_encoder = create_model("vit_debug_patch4")
    torch.save(mae_encoder.state_dict(), tmp_path / "enc.pth")
    ft = _ft()
    summary = load_into_objective(ft, tmp_path / "enc.pth")
    assert "fc_norm.weight" in summary and "head.weight" in summary  # reported as new
    assert torch.equal(ft.encoder.blocks[1].mlp.fc2.weight, mae_encoder.blocks[1].mlp.fc2.weight)
    assert torch.all(ft.encoder.fc_norm.weight == 1)  # fresh, not the pretraining norm


def _official_lrd_rule(name: str, p: torch.Tensor, depth: int, layer_decay: float, weight_decay: float):
    """MAE's util/lr_decay.py param_groups_lrd, written out: no decay for 1-d parameters and the
    model's no_weight_decay list (pos_embed, cls_token, dist_token); layer id 0 for cls_token,
    pos_embed and patch_embed, i + 1 for blocks.i, num_layers = depth + 1 for the rest; lr scale
    layer_decay^(num_layers - layer id). Names are the encoder's (timm's)."""
    num_layers = depth + 1
    no_decay = p.ndim == 1 or name in ("pos_embed", "cls_token", "dist_token")
    if name in ("cls_token", "pos_embed") or name.startswith("patch_embed"):
        lid = 0
    elif name.startswith("blocks"):
        lid = int(name.split(".")[1]) + 1
    else:
        lid = num_layers
    return layer_decay ** (num_layers - lid), 0.0 if no_decay else weight_decay


def test_param_groups_match_the_official_recipe_pos_embed_included():
    ft = _ft()
    groups, _ = build_param_groups(ft, 0.05, 0.75)
    ours = {id(p): (g["lr_scale"], g["weight_decay"]) for g in groups for p in g["params"]}
    depth = len(ft.encoder.blocks)
    # the recipe optimises every encoder parameter (pos_embed too) and the head, nothing else
    assert len(ours) == sum(1 for _ in ft.encoder.parameters()) == sum(1 for _ in ft.parameters())
    for name, p in ft.encoder.named_parameters():
        want = _official_lrd_rule(name, p, depth, 0.75, 0.05)
        assert ours[id(p)][0] == pytest.approx(want[0]) and ours[id(p)][1] == want[1], name
    assert ours[id(ft.encoder.pos_embed)] == pytest.approx((0.75 ** 3, 0.0))
    # without layer decay (the plain two groups) pos_embed still trains, undecayed
    plain, _ = build_param_groups(ft, 0.05, 1.0)
    assert {id(p): g["weight_decay"] for g in plain for p in g["params"]}[id(ft.encoder.pos_embed)] == 0.0


def test_pos_embed_trains_in_finetuning_from_the_loaded_table(tmp_path):
    torch.manual_seed(1)
    pretrained = create_model("vit_debug_patch4")
    with torch.no_grad():
        pretrained.pos_embed.add_(0.5)  # any table: fine-tuning starts from the one it loads
    torch.save(pretrained.state_dict(), tmp_path / "enc.pth")
    ft = _ft(mixup=0.0, cutmix=0.0)
    load_into_objective(ft, tmp_path / "enc.pth")
    assert ft.encoder.pos_embed.requires_grad and torch.equal(ft.encoder.pos_embed, pretrained.pos_embed)
    groups, _ = build_param_groups(ft, 0.05, 0.75)
    opt = torch.optim.AdamW([{**g, "lr": 1e-2 * g["lr_scale"]} for g in groups])
    ft({"image": torch.randn(4, 3, 28, 28), "label": torch.tensor([0, 1, 2, 3])})["loss"].backward()
    assert ft.encoder.pos_embed.grad is not None and ft.encoder.pos_embed.grad.abs().sum() > 0
    opt.step()
    assert not torch.equal(ft.encoder.pos_embed, pretrained.pos_embed)


def test_pretraining_and_linear_probe_keep_the_sincos_table_fixed():
    from model.objectives.linear_probe import LinearProbeConfig
    from model.objectives.mae import MAEConfig
    from train.engine.optim import build_param_groups as groups_of

    mae = build_objective("mae", create_model("vit_debug_patch4"), MAEConfig(decoder_dim=32, decoder_depth=1,
                                                                             decoder_heads=2))
    probe = build_objective("linprobe", create_model("vit_debug_patch4"), LinearProbeConfig(num_classes=4))
    for obj in (mae, probe):
        assert not obj.encoder.pos_embed.requires_grad
        for layer_decay in (1.0, 0.75):
            optimised = {id(p) for g in groups_of(obj, 0.05, layer_decay)[0] for p in g["params"]}
            assert id(obj.encoder.pos_embed) not in optimised


def test_a_learned_pos_embed_is_interpolated_for_another_resolution_and_sincos_rebuilt(tmp_path):
    from model.interop import resize_pos_embed
    from model.pos_embed import sincos_2d

    small = create_model("vit_debug_patch4", img_size=16)  # 4x4 grid, sin-cos table
    assert torch.equal(resize_pos_embed(small.pos_embed.data, (7, 7)), sincos_2d(32, (7, 7), cls_token=True)[None])
    with torch.no_grad():  # a fine-tuned table: learned, no longer sin-cos
        small.pos_embed.add_(torch.randn_like(small.pos_embed))
    torch.save(small.state_dict(), tmp_path / "ft16.pth")
    ft = _ft()  # 28 px: 7x7 grid
    load_into_objective(ft, tmp_path / "ft16.pth")
    grid = small.pos_embed.data[:, 1:].reshape(1, 4, 4, 32).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(7, 7), mode="bicubic", align_corners=False).permute(0, 2, 3, 1).reshape(1, 49, 32)
    assert torch.allclose(ft.encoder.pos_embed[:, 1:], want, atol=1e-6)
    assert torch.equal(ft.encoder.pos_embed[:, :1], small.pos_embed[:, :1]) and ft.encoder.pos_embed.requires_grad


def test_a_table_near_sincos_but_fine_tuned_is_interpolated_not_replaced():
    """Only a table that IS sin-cos (to bf16 rounding) is rebuilt: one fine-tuning moved by ~0.02
    is learned, and throwing it away for a fresh sin-cos table loses what fine-tuning learned."""
    from model.interop import resize_pos_embed
    from model.pos_embed import sincos_2d

    torch.manual_seed(0)
    learned = sincos_2d(32, (4, 4), cls_token=True)[None] + 0.02 * torch.randn(1, 17, 32)
    out = resize_pos_embed(learned, (7, 7))
    grid = learned[:, 1:].reshape(1, 4, 4, 32).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(7, 7), mode="bicubic", align_corners=False).permute(0, 2, 3, 1).reshape(1, 49, 32)
    assert torch.allclose(out[:, 1:], want, atol=1e-6) and torch.equal(out[:, :1], learned[:, :1])
    assert not torch.allclose(out, sincos_2d(32, (7, 7), cls_token=True)[None], atol=1e-3)


def test_an_odd_micro_batch_with_mixup_is_refused_before_start():
    """It passed every check, wrote the run folder and ended in a traceback at the first forward."""
    from conftest import CPU_DS, DEBUG_PRESET

    from train.config.errors import ConfigError
    from train.config.objective_fits import check_objective_fits
    from train.config.parsing import parse_args

    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--objective", "finetune",
                      "--finetune.num_classes", "10"])
    with pytest.raises(ConfigError, match=r"finetune.mixup / finetune.cutmix need an even micro-batch, the ds_config "
                                          r"gives 7: give an even train_micro_batch_size_per_gpu, or --finetune.mixup "
                                          r"0 --finetune.cutmix 0"):
        check_objective_fits(cfg, micro_batch=7)
    check_objective_fits(cfg, micro_batch=8)
    for mixup, cutmix in ((0.8, 0.0), (0.0, 1.0)):  # either one alone mixes: refused too
        cfg.finetune.mixup, cfg.finetune.cutmix = mixup, cutmix
        with pytest.raises(ConfigError, match="need an even micro-batch, the ds_config gives 7"):
            check_objective_fits(cfg, micro_batch=7)
    cfg.finetune.mixup = cfg.finetune.cutmix = 0.0
    check_objective_fits(cfg, micro_batch=7)


@pytest.mark.parametrize("mix", [0.0, 0.8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_loss_is_fp32_when_the_model_is_cast_to_16_bits(dtype, mix):
    """The engine multiplies the loss by the fp16 loss scale (2**16 by default, inf in fp16)."""
    ft = _ft(mixup=mix, cutmix=mix).to(dtype).train()
    loss = ft({"image": torch.randn(4, 3, 28, 28, dtype=dtype), "label": torch.tensor([0, 1, 2, 3])})["loss"]
    assert loss.dtype == torch.float32 and torch.isfinite(loss * 2**16)
