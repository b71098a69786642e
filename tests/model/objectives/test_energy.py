"""Energy-based pretraining: the weights learn through the input gradient, alpha learns, restoration
works on a tiny case, the same objective drives timm ConvNeXt and Swin."""
from functools import partial

import pytest
import timm
import torch
import torch.nn.functional as F

from model.objectives import corruptions as C
from model.objectives.energy import EnergyConfig, EnergyObjective
from model.registry import create_model


def vit_objective(seed=0, **cfg):
    torch.manual_seed(seed)
    encoder = create_model("vit_debug_patch4", img_size=16, in_chans=3, attn_backend="math")
    return EnergyObjective(encoder, EnergyConfig(**{"grid_cell": 4, "sr_scale": 4, **cfg}))


def batch(b=4, s=16, seed=0):
    return {"image": torch.randn(b, 3, s, s, generator=torch.Generator().manual_seed(seed))}


def backbone_grads(obj):
    """Gradients of every trainable backbone weight except the final norm's bias: it shifts the
    energy by a constant, which has no input gradient, so no restoration loss can reach it."""
    return [p.grad for n, p in obj.encoder.named_parameters() if p.requires_grad and n != "norm.bias"]


def test_the_backbone_learns_through_the_input_gradient():
    obj = vit_objective()
    before = [p.detach().clone() for p in obj.encoder.parameters()]
    torch.manual_seed(1)
    out = obj(batch())
    out["loss"].backward()
    assert all(g is not None and torch.isfinite(g).all() for g in backbone_grads(obj))
    assert sum(g.abs().sum() for g in backbone_grads(obj)) > 0
    assert obj.head.weight.grad.abs().sum() > 0
    torch.optim.SGD(obj.parameters(), lr=0.1).step()
    assert any(not torch.equal(p, b) for p, b in zip(obj.encoder.parameters(), before))


def test_without_create_graph_only_alpha_would_train():
    """The same restoration without create_graph leaves the backbone without gradient: the test
    above would fail for such an implementation."""
    obj = vit_objective()
    torch.manual_seed(1)
    x = batch()["image"]
    corrupted, _ = obj.corrupt(x)
    chain = obj.restore(corrupted, create_graph=False)
    loss = torch.stack([F.smooth_l1_loss(c, x) for c in chain]).mean()
    loss.backward()
    assert all(g is None for g in backbone_grads(obj)) and obj.head.weight.grad is None
    assert obj.log_alpha.grad is not None and obj.log_alpha.grad != 0


def test_alpha_is_log_parameterised_and_gets_a_gradient():
    obj = vit_objective(alpha_init=0.5)
    assert obj.log_alpha.item() == pytest.approx(torch.log(torch.tensor(0.5)).item())
    torch.manual_seed(1)
    obj(batch())["loss"].backward()
    assert obj.log_alpha.grad is not None and torch.isfinite(obj.log_alpha.grad) and obj.log_alpha.grad != 0
    assert "log_alpha" in obj.no_weight_decay()


def test_one_step_by_hand():
    """N = 1: x1 = x0 - alpha dE/dx0 (the gradient of the summed energy), checked against the objective."""
    obj = vit_objective(steps=1, corruption="denoise")
    torch.manual_seed(3)
    x = batch(b=2)["image"]
    corrupted, _ = obj.corrupt(x)
    (x1,) = obj.restore(corrupted)
    probe = corrupted.clone().requires_grad_()
    (g,) = torch.autograd.grad(obj.energy(probe).sum(), probe)
    torch.testing.assert_close(x1, corrupted - obj.log_alpha.exp() * g)


def test_the_loss_is_the_mean_over_steps_of_smooth_l1_to_the_original():
    """Algorithm 1 by a plain loop: each step starts from the previous one without its gradient,
    x_n = sg(x_{n-1}) - alpha dE/dx, and the loss is the mean over the N steps of SmoothL1 (beta 1)
    to the clean image; inputs scaled so that |x_n - x| > 1 occurs (beta matters)."""
    obj = vit_objective(steps=2, corruption="denoise").double()
    x = 3 * batch(b=2)["image"].double()
    torch.manual_seed(1)
    out = obj({"image": x})
    torch.manual_seed(1)
    corrupted, _ = obj.corrupt(x)
    step, losses, alpha = corrupted, [], obj.log_alpha.exp()
    for _ in range(2):
        step = step.detach().requires_grad_()
        (g,) = torch.autograd.grad(obj.energy(step).sum(), step, create_graph=True)
        step = step - alpha * g
        d = (step - x).abs()
        assert (d > 1).any()
        losses.append(torch.where(d < 1, 0.5 * d ** 2, d - 0.5).mean())
    want = torch.stack(losses).mean()
    torch.testing.assert_close(out["loss"].double(), want, rtol=1e-6, atol=0)  # an fp32 loss
    # the same gradients too: the stop-gradient between steps shows only there, not in the loss value
    params = [obj.log_alpha, obj.head.weight, obj.encoder.blocks[0].attn.qkv.weight]
    for got, ref in zip(torch.autograd.grad(out["loss"], params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("pool", ["avg", "cls"])
def test_the_energy_reads_the_configured_pooling(pool):
    """E(x) = h(patch-token mean) for avg, h(cls token) for cls, on the blocks' normed tokens."""
    obj = vit_objective(pool=pool)
    x = batch(b=2)["image"]
    tokens = obj.encoder.forward_features(x)
    feats = obj.encoder.fc_norm(tokens[:, 1:].mean(1)) if pool == "avg" else tokens[:, 0]
    torch.testing.assert_close(obj.energy(x), (feats @ obj.head.weight.T)[:, 0])


@pytest.mark.parametrize("name", ["grid", "blank_small", "blank_large", "sr", "denoise", "colorize"])
def test_a_single_corruption_is_its_configured_function_drawn_from_the_generator(name):
    """--energy.corruption NAME applies that corruption with its own settings (the small blanks'
    count and area for blank_small, the large ones' for blank_large), its randomness from the
    generator given (figures draw one fixed corruption per call)."""
    settings = dict(grid_cell=4, grid_ratio=0.5, small_blanks=9, small_area=(0.01, 0.02), large_blanks=3,
                    large_area=(0.1, 0.2), sr_scale=2)
    reference = {"grid": partial(C.grid_mask, cell=4, ratio=0.5),
                 "blank_small": partial(C.random_blanks, count=9, area=(0.01, 0.02)),
                 "blank_large": partial(C.random_blanks, count=3, area=(0.1, 0.2)),
                 "sr": partial(C.super_resolution, scale=2), "denoise": C.denoise, "colorize": C.colorize}[name]
    obj = vit_objective(corruption=name, **settings)
    x = batch(b=8)["image"] + 3.0
    torch.manual_seed(7)  # the global RNG differs from the generator's stream
    corrupted, choice = obj.corrupt(x, torch.Generator().manual_seed(0))
    assert choice is None and not torch.equal(corrupted, x)
    assert torch.equal(corrupted, reference(x, generator=torch.Generator().manual_seed(0)))


def test_blank_areas_may_be_a_fixed_size_but_not_reversed():
    # low == high: every blank has the same area (a valid U(a, a)); only low > high is meaningless
    for name in ("small_area", "large_area"):
        EnergyConfig(**{name: (0.02, 0.02)}).validate()
        with pytest.raises(ValueError, match=f"energy.{name} must be low,high with low <= high"):
            EnergyConfig(**{name: (0.03, 0.02)}).validate()


def test_the_figure_rows_are_corrupted_first_step_last_step_original():
    """Rows of energy_restoration: the generator-0 corruption, x~1 (one step by hand), x~N, x."""
    obj = vit_objective(steps=3, corruption="denoise")
    x = batch(b=2)["image"]
    rows = obj.visualizations(x, None)["energy_restoration"]
    corrupted, _ = obj.corrupt(x, torch.Generator().manual_seed(0))
    probe = corrupted.clone().requires_grad_()
    (g,) = torch.autograd.grad(obj.energy(probe).sum(), probe)
    first = corrupted - obj.log_alpha.exp().detach() * g
    last = first
    for _ in range(2):
        probe = last.clone().requires_grad_()
        (g,) = torch.autograd.grad(obj.energy(probe).sum(), probe)
        last = last - obj.log_alpha.exp().detach() * g
    assert torch.equal(rows[0], corrupted) and torch.equal(rows[3], x)
    torch.testing.assert_close(rows[1], first)
    torch.testing.assert_close(rows[2], last)
    assert not torch.allclose(rows[1], rows[2])


def test_the_fp16_inner_scale_is_divided_back_out():
    """Under fp16 the inner gradient is of E * fp16_inner_scale; dividing it back gives the fp32
    step (to fp16 rounding), not one fp16_inner_scale times larger."""
    obj = vit_objective(steps=1, corruption="denoise")
    x = batch(b=2)["image"]
    step32 = obj.restore(x, create_graph=False)[0] - x
    x16 = x.half()
    step16 = obj.half().restore(x16, create_graph=False)[0].float() - x16.float()
    assert step32.norm() > 0
    assert (step16 - step32).norm() < 0.1 * step32.norm()


def test_restoration_beats_the_corruption_after_training():
    """A tiny ViT learns to fill grid-masked cells of 8 smooth images: after 200 steps the restored
    images are much closer to the originals than the corrupted inputs (on fresh corruptions)."""
    torch.manual_seed(0)
    encoder = create_model("vit_debug_patch4", img_size=8, in_chans=3, attn_backend="math", embed_dim=32, depth=1)
    obj = EnergyObjective(encoder, EnergyConfig(corruption="grid", grid_cell=2, grid_ratio=0.5, steps=2))
    images = F.interpolate(torch.randn(8, 3, 2, 2, generator=torch.Generator().manual_seed(0)), size=8,
                           mode="bilinear", align_corners=False)  # (8, 3, 8, 8), smooth
    opt = torch.optim.AdamW(obj.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(200):
        loss = obj({"image": images})["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.manual_seed(123)
    corrupted, _ = obj.corrupt(images)
    restored = obj.restore(corrupted, create_graph=False)[-1]
    before, after = F.smooth_l1_loss(corrupted, images).item(), F.smooth_l1_loss(restored, images).item()
    assert after < 0.5 * before, (before, after)


def test_bf16_runs_and_the_loss_is_fp32():
    obj = vit_objective().bfloat16()
    torch.manual_seed(1)
    out = obj({"image": batch()["image"].bfloat16()})
    assert out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])
    out["loss"].backward()
    assert all(torch.isfinite(g).all() for g in backbone_grads(obj))


def test_the_vit_must_use_a_twice_differentiable_attention():
    assert EnergyConfig().encoder_overrides() == {"attn_backend": "math"}
    encoder = create_model("vit_debug_patch4", img_size=16, in_chans=3, attn_backend="sdpa")
    with pytest.raises(ValueError, match="double backward"):
        EnergyObjective(encoder, EnergyConfig(grid_cell=4, sr_scale=4))


def test_a_timm_backbone_on_fused_attention_is_refused():
    """timm builds its attention on fused SDPA, which has no double backward; pretrain.py passes
    the objective's attn_backend (math), which turns it off in every module, and anything else is
    refused before the first step."""
    fused = create_model("timm/vit_tiny_patch16_224", img_size=32, in_chans=3)
    assert fused.attn_backend == "sdpa" and all(fused.attention_modules().values())
    with pytest.raises(ValueError, match="use fused SDPA, which has none; build it with attn_backend 'math'"):
        EnergyObjective(fused, EnergyConfig(grid_cell=8, sr_scale=4))
    explicit = create_model("timm/vit_tiny_patch16_224", img_size=32, in_chans=3, **EnergyConfig().encoder_overrides())
    assert explicit.attn_backend == "math" and len(explicit.attention_modules()) == 12
    assert not any(explicit.attention_modules().values())
    explicit.load_state_dict(fused.state_dict())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(explicit.eval()(x), fused.eval()(x), rtol=1e-5, atol=1e-5)  # the same function


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["swin_tiny_patch4_window7_224", "vit_tiny_patch16_224"])
def test_timm_attention_backbones_double_backward_on_cuda_in_bf16(name):
    """On CUDA, fused SDPA takes the flash / memory-efficient kernels (Swin's masked windows too),
    none with a double backward; the backbone as pretrain.py builds it trains there in bf16."""
    torch.manual_seed(0)
    backbone = create_model(f"timm/{name}", img_size=32, in_chans=3, **EnergyConfig().encoder_overrides())
    obj = EnergyObjective(backbone, EnergyConfig(grid_cell=8, sr_scale=4)).cuda().bfloat16()
    out = obj({"image": torch.randn(4, 3, 32, 32, device="cuda", dtype=torch.bfloat16)})
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    grads = [p.grad for p in backbone.parameters()]
    assert sum(1 for g in grads if g is not None and g.float().abs().sum() > 0) > 0.9 * len(grads)


@pytest.mark.gpu
def test_the_vit_trains_through_the_double_backward_on_cuda_in_fp16():
    """The V100 path: the model cast to fp16 as an fp16 ds_config casts it, with the default inner
    scale. CPU cannot show it: its LayerNorm keeps the saved reciprocal std in fp16, whose cube in
    the double backward overflows, where CUDA's LayerNorm keeps it in fp32."""
    torch.manual_seed(0)
    encoder = create_model("vit_debug_patch4", in_chans=1, **EnergyConfig().encoder_overrides())
    obj = EnergyObjective(encoder, EnergyConfig(grid_cell=4, sr_scale=4, mixture="grid,sr,denoise")).cuda().half()
    out = obj({"image": torch.randn(8, 1, 28, 28, device="cuda", dtype=torch.float16)})
    out["loss"].backward()
    assert out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])
    assert all(torch.isfinite(p.grad).all() for p in obj.parameters() if p.grad is not None)
    grads = [p.grad for p in encoder.parameters()]
    assert sum(1 for g in grads if g is not None and g.float().abs().sum() > 0) > 0.9 * len(grads)


@pytest.mark.parametrize("name", ["convnext_atto", "swin_tiny_patch4_window7_224", "vit_tiny_patch16_224"])
def test_timm_backbones_train_through_the_same_objective(name):
    torch.manual_seed(0)
    backbone = create_model(f"timm/{name}", img_size=32, in_chans=3, **EnergyConfig().encoder_overrides())
    obj = EnergyObjective(backbone, EnergyConfig(grid_cell=8, sr_scale=4))
    torch.manual_seed(1)
    obj({"image": torch.randn(2, 3, 32, 32)})["loss"].backward()
    grads = [p.grad for p in backbone.parameters()]
    assert sum(1 for g in grads if g is not None and g.abs().sum() > 0) > 0.9 * len(grads)
    # timm's own names: the backbone's weights load into timm's model as they are
    reference = timm.create_model(name, pretrained=False, num_classes=0, **({} if "convnext" in name else {"img_size": 32}))
    reference.load_state_dict(backbone.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    backbone.eval(), reference.eval()
    torch.testing.assert_close(reference(x), backbone.pooled_features(x))
