import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.data import Mixup

from model import create_model
from model.interop import load_into_objective
from model.objectives import build_objective
from model.objectives.finetune import FinetuneConfig
from train.optim import build_param_groups


def _ft(**kw):
    torch.manual_seed(0)
    enc = create_model("vit_debug_patch4", global_pool="avg", drop_path_rate=0.1)
    return build_objective("finetune", enc, FinetuneConfig(num_classes=4, **kw))


def test_head_init_and_plain_label_smoothing():
    ft = _ft(mixup=0.0, cutmix=0.0, smoothing=0.1).train()
    w = ft.encoder.head.weight
    assert w.shape == (4, 32) and w.abs().max() < 1e-4 and torch.all(ft.encoder.head.bias == 0)
    images, labels = torch.randn(4, 3, 28, 28), torch.tensor([0, 1, 2, 3])
    torch.manual_seed(5)
    loss = ft({"image": images, "label": labels})["loss"]
    torch.manual_seed(5)  # same drop-path draws
    logp = F.log_softmax(ft.predict(images), -1)
    want = (0.9 * -logp.gather(1, labels[:, None])[:, 0] + 0.1 * -logp.mean(-1)).mean()
    assert torch.allclose(loss, want, atol=1e-6)


def test_mixup_loss_is_soft_target_ce_of_timm_mixup():
    ft = _ft().train()
    images, labels = torch.randn(4, 3, 28, 28), torch.tensor([0, 1, 2, 3])
    np.random.seed(3)
    torch.manual_seed(5)
    loss = ft({"image": images, "label": labels})["loss"]
    np.random.seed(3)
    mixed, soft = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=4)(images.clone(), labels)
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
