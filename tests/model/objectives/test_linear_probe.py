import pytest
import torch
import torch.nn.functional as F

from model import create_model
from model.objectives import build_objective
from model.objectives.linear_probe import LinearProbeConfig


def _probe(**kw):
    torch.manual_seed(0)
    return build_objective("linprobe", create_model("vit_debug_patch4"), LinearProbeConfig(num_classes=5, **kw))


def test_only_the_head_trains_and_bn_has_no_affine():
    probe = _probe()
    trainable = {n for n, p in probe.named_parameters() if p.requires_grad}
    assert trainable == {"head.1.weight", "head.1.bias"}
    assert abs(probe.head[1].weight.std().item() - 0.01) < 0.003 and torch.all(probe.head[1].bias == 0)
    assert probe.head[0].eps == 1e-6  # official MAE: BatchNorm1d(affine=False, eps=1e-6); features of
    # post-LayerNorm tokens rarely vary as little as that, so the loss test below cannot tell it from 1e-5
    probe.train()
    assert probe.training and not probe.encoder.training  # frozen features, no drop path


def test_loss_is_cross_entropy_of_bn_linear_on_cls_features():
    probe = _probe().train()
    images, labels = torch.randn(6, 3, 28, 28), torch.tensor([0, 1, 2, 3, 4, 0])
    out = probe({"image": images, "label": labels})
    feats = probe.encoder.forward_features(images)[:, 0]
    normed = (feats - feats.mean(0)) / torch.sqrt(feats.var(0, unbiased=False) + 1e-6)  # batch statistics
    want = F.cross_entropy(normed @ probe.head[1].weight.T + probe.head[1].bias, labels)
    assert torch.allclose(out["loss"], want, atol=1e-5)
    out["loss"].backward()
    assert probe.head[1].weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in probe.encoder.parameters())


def test_bn_running_statistics_are_an_exponential_average_with_momentum_0_1():
    """MAE's probe: BatchNorm1d(affine=False, eps=1e-6), torch's default momentum 0.1: running
    = 0.9 running + 0.1 batch statistic (the variance unbiased), from mean 0 and variance 1."""
    probe = _probe().train()
    g = torch.Generator().manual_seed(1)
    mean, var = torch.zeros(32, dtype=torch.float64), torch.ones(32, dtype=torch.float64)
    for _ in range(3):
        images = torch.randn(6, 3, 28, 28, generator=g) + 0.5
        probe({"image": images, "label": torch.tensor([0, 1, 2, 3, 4, 0])})
        feats = probe.encoder.forward_features(images)[:, 0].double()  # the frozen cls features
        mean = 0.9 * mean + 0.1 * feats.mean(0)
        var = 0.9 * var + 0.1 * feats.var(0, unbiased=True)
    bn = probe.head[0]
    torch.testing.assert_close(bn.running_mean.double(), mean, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(bn.running_var.double(), var, rtol=1e-4, atol=1e-6)


def test_train_top1_is_the_percentage_of_the_batch_the_probe_gets_right():
    probe = _probe().train()
    images = torch.randn(6, 3, 28, 28)
    labels = probe.predict(images).argmax(1)  # all right (batch statistics: the same in the forward below)
    labels[:2] = (labels[:2] + 1) % 5  # then 2 of the 6 wrong
    assert probe({"image": images, "label": labels})["train_top1"].item() == pytest.approx(100 * 4 / 6)


def test_avg_pool_option_uses_patch_tokens():
    a, b = _probe(), _probe(pool="avg")
    x = torch.randn(2, 3, 28, 28)
    assert torch.equal(a.features(x), a.encoder.forward_features(x)[:, 0])
    assert torch.allclose(b.features(x), b.encoder.forward_features(x)[:, 1:].mean(1))


def test_the_probe_trains_in_fp16_through_the_engine_as_in_fp32():
    """fp16 on ZeRO-0 with LARS is a configuration the checks accept (docs/EVALUATION.md): the engine
    casts the head and the BatchNorm's statistics to fp16, and the features must follow them."""
    from types import SimpleNamespace

    from train.engine import EngineConfig, build
    from train.engine.optim import WarmupCosineSchedule, build_optimizer, build_param_groups

    images, labels = torch.randn(8, 3, 28, 28), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    losses = {}
    for precision in ("fp32", "fp16"):
        probe = _probe()
        groups, _ = build_param_groups(probe, 0.0, 1.0)
        engine = build(probe, groups, lambda g: build_optimizer(g, SimpleNamespace(name="lars")),
                       lambda o: WarmupCosineSchedule(o, 0.1, 0.0, 0, 10), EngineConfig(0, precision, 1, 0.0),
                       torch.device("cpu"))
        probe.train()
        dtype = torch.float16 if precision == "fp16" else torch.float32
        losses[precision] = engine({"image": images.to(dtype), "label": labels})["loss"].float()
        assert probe.head[1].weight.dtype == probe.head[0].running_mean.dtype == dtype
    assert torch.isfinite(losses["fp16"]) and torch.allclose(losses["fp16"], losses["fp32"], rtol=2e-2)


def test_an_avg_pooled_encoder_is_probed_through_its_fc_norm():
    """model.global_pool avg (a fine-tuned encoder, or the official --global_pool probe) has no final
    norm: the probe read the raw patch mean, not the fc_norm'd one its classifier sees."""
    torch.manual_seed(0)
    encoder = create_model("vit_debug_patch4", global_pool="avg")
    with torch.no_grad():
        encoder.fc_norm.weight.uniform_(0.5, 2.0)
        encoder.fc_norm.bias.normal_()
    probe = build_objective("linprobe", encoder, LinearProbeConfig(num_classes=5, pool="avg"))
    x = torch.randn(2, 3, 28, 28)
    tokens = encoder.forward_features(x)
    assert torch.allclose(probe.features(x), encoder.fc_norm(tokens[:, 1:].mean(1)), atol=1e-6)
    assert not torch.allclose(probe.features(x), tokens[:, 1:].mean(1), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_loss_is_fp32_when_the_probe_is_cast_to_16_bits(dtype):
    """The engine multiplies the loss by the fp16 loss scale (2**16 by default, inf in fp16)."""
    probe = _probe().to(dtype).train()
    out = probe({"image": torch.randn(6, 3, 28, 28, dtype=dtype), "label": torch.tensor([0, 1, 2, 3, 4, 0])})
    assert out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])


def test_fp16_steps_at_the_default_loss_scale_are_not_skipped():
    """fp16's dynamic scale starts at 2**16: the first steps must train, not overflow, and the scale stays."""
    from types import SimpleNamespace

    from train.engine import EngineConfig, build
    from train.engine.optim import WarmupCosineSchedule, build_optimizer, build_param_groups

    probe = _probe()
    groups, _ = build_param_groups(probe, 0.0, 1.0)
    engine = build(probe, groups, lambda g: build_optimizer(g, SimpleNamespace(name="lars")),
                   lambda o: WarmupCosineSchedule(o, 0.1, 0.0, 0, 10), EngineConfig(0, "fp16", 1, 0.0),
                   torch.device("cpu"))
    probe.train()
    before = probe.head[1].weight.detach().clone()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        images, labels = torch.randn(8, 3, 28, 28, generator=g), torch.randint(0, 5, (8,), generator=g)
        batch = {"image": images.half(), "label": labels}
        engine.backward(engine(batch)["loss"])
        engine.step()
    state = engine.device_state()
    assert state["skipped_steps"].item() == 0 and state["loss_scale"].item() == 2.0 ** 16
    assert torch.isfinite(state["grad_norm"]) and not torch.equal(probe.head[1].weight, before)
