"""MLO-MAE's level I (masking network, top-k, weighted loss), the level II/III schedule, state."""
import copy

import pytest
import torch

from model.objectives.masking_net import (
    MaskingNetwork,
    mask_statistics,
    top_masking,
    weighted_recon_loss,
)
from model.objectives.mlomae import Auxiliary, MLOMAEConfig, MLOMAEObjective
from model.registry import create_model


def objective(seed=0, **overrides) -> MLOMAEObjective:
    torch.manual_seed(seed)
    encoder = create_model("vit_debug_patch4", img_size=8, in_chans=1)  # 2x2 = 4 patches
    cfg = dict(decoder_dim=16, decoder_depth=1, decoder_heads=2, mask_hidden=8, num_classes=3, mask_ratio=0.5)
    return MLOMAEObjective(encoder, MLOMAEConfig(**{**cfg, **overrides}))


def batch(seed=0, val=True):
    g = torch.Generator().manual_seed(seed)
    out = {"image": torch.randn(4, 1, 8, 8, generator=g), "label": torch.randint(0, 3, (4,), generator=g)}
    if val:
        out |= {"val_image": torch.randn(4, 1, 8, 8, generator=g), "val_label": torch.randint(0, 3, (4,), generator=g)}
    return out


def test_masking_network_shapes_and_range():
    net = MaskingNetwork(num_patches=6, dim=5, hidden=7)
    assert [m.weight.shape for m in net.net if hasattr(m, "weight")] == [(7, 30), (6, 7)]  # Linear(N*D, 512), Linear(512, N)
    p = net(torch.randn(3, 6, 5))
    assert p.shape == (3, 6) and bool(((p > 0) & (p < 1)).all())


def test_top_k_masks_the_highest_probabilities():
    torch.manual_seed(0)
    probs = torch.rand(5, 16)
    masking = top_masking(probs, 0.75)  # 12 masked, 4 kept
    for b in range(5):
        highest = set(probs[b].topk(12).indices.tolist())
        assert set(masking.mask[b].nonzero().flatten().tolist()) == highest
        assert set(masking.ids_keep[b].tolist()) == set(range(16)) - highest


def test_weighted_loss_hand_computed():
    per_patch = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    probs = torch.tensor([[0.1, 0.5, 0.25, 0.9]], requires_grad=True)
    loss = weighted_recon_loss(per_patch, mask, probs, straight_through=False)
    assert loss.item() == pytest.approx((0.5 * 2 + 0.25 * 3) / 2)
    (g,) = torch.autograd.grad(loss, probs)
    torch.testing.assert_close(g, torch.tensor([[0.0, 1.0, 1.5, 0.0]]))  # l_j / #masked on masked patches only


def test_straight_through_is_plain_mae_loss_with_identity_backward():
    per_patch = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    probs = torch.tensor([[0.1, 0.5, 0.25, 0.9]], requires_grad=True)
    loss = weighted_recon_loss(per_patch, mask, probs, straight_through=True)
    assert loss.item() == pytest.approx((2 + 3) / 2)
    (g,) = torch.autograd.grad(loss, probs)
    torch.testing.assert_close(g, per_patch / 2)  # every patch, masked or not


def test_level1_trains_encoder_and_decoder_not_the_masking_network():
    obj = objective()
    out = obj(batch())
    out["loss"].backward()
    assert obj.encoder.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert obj.decoder.decoder_pred.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in obj.aux.mask_net.parameters())
    assert all(p.grad is None for p in obj.aux.head.parameters())
    # the logged loss parts: weighted loss <= plain loss on the masked patches (p < 1)
    assert out["loss"].item() < out["recon_loss"].item()


def level1_parts():
    """The objective, a batch, and level I's pieces of it: T's probabilities, the top-half
    masking they give, the per-patch reconstruction error."""
    obj, b = objective(), batch(val=False)
    _, probs = obj.mask_probabilities(b["image"])
    masking = top_masking(probs, 0.5)
    return obj, b, probs, masking, obj.reconstruct(b["image"], masking)


def test_level1_loss_equals_the_formula():
    obj, b, probs, masking, per_patch = level1_parts()
    expected = (masking.mask * probs * per_patch).sum() / masking.mask.sum()
    torch.testing.assert_close(obj(b)["loss"], expected)


def test_logged_recon_loss_is_the_plain_mse_over_the_masked_patches():
    """recon_loss: the unweighted per-patch MSE averaged over T's masked patches only."""
    obj, b, _, masking, per_patch = level1_parts()
    want = per_patch[masking.mask.bool()].mean()
    assert not torch.isclose(want, per_patch.mean())  # the visible patches would move it
    torch.testing.assert_close(obj(b)["recon_loss"], want)


def test_mask_statistics_by_hand():
    probs = torch.tensor([[0.005, 0.5, 0.999, 0.2],
                          [0.005, 0.7, 0.5, 0.2]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0],
                         [0.0, 1.0, 1.0, 0.0]])
    stats = mask_statistics(probs, mask)
    assert stats["mask_prob_mean"].item() == pytest.approx(3.109 / 8)
    assert stats["mask_prob_masked"].item() == pytest.approx((0.5 + 0.999 + 0.7 + 0.5) / 4)
    assert stats["mask_prob_saturated"].item() == pytest.approx(3 / 8)  # 0.005 twice, 0.999 once
    # per-patch std over the two images (population): 0, 0.1, 0.2495, 0
    assert stats["mask_prob_spread"].item() == pytest.approx((0.1 + 0.2495) / 4)
    assert mask_statistics(probs[:1], mask[:1])["mask_prob_spread"].item() == 0.0


def test_collapsed_masking_network_shows_in_the_logged_statistics():
    """At init T's probabilities differ between images; a T whose output is its bias alone (first
    layer zeroed, last bias +-20) gives every image the same saturated mask, and the level-I
    loss then reads only the patches with p ~ 1."""
    obj = objective()
    out = obj(batch())
    assert out["mask_prob_spread"].item() > 0 and out["mask_prob_saturated"].item() < 1
    first, last = obj.aux.mask_net.net[1], obj.aux.mask_net.net[3]
    with torch.no_grad():
        first.weight.zero_()
        first.bias.zero_()
        last.bias.copy_(torch.tensor([20.0, -20.0, -20.0, 20.0]))
    out = obj(batch())
    assert out["mask_prob_spread"].item() == 0.0
    assert out["mask_prob_saturated"].item() == 1.0
    assert out["mask_prob_masked"].item() == pytest.approx(1.0)  # patches 0 and 3 masked in every image


def snapshot(module):
    return [p.detach().clone() for p in module.parameters()]


def changed(module, before):
    return any(not torch.equal(p, b) for p, b in zip(module.parameters(), before))


def test_schedule_of_levels_two_and_three():
    """level1_steps 2, mask_every 2: the head moves every 2nd step, T every 4th."""
    obj = objective(level1_steps=2, mask_every=2)
    head, mask = snapshot(obj.aux.head), snapshot(obj.aux.mask_net)
    moves = []
    for step in range(1, 9):
        b = batch(step, val=step % 4 == 0)
        obj(b)
        obj.after_optimizer_step(lr=1e-2, batches=[b])
        moves.append((changed(obj.aux.head, head), changed(obj.aux.mask_net, mask)))
        head, mask = snapshot(obj.aux.head), snapshot(obj.aux.mask_net)
    assert moves == [(False, False), (True, False), (False, False), (True, True)] * 2
    assert obj.level1_done == 8 and obj.cycles_done == 4


def test_a_mask_cycle_without_val_batch_is_an_error():
    obj = objective()
    b = batch(val=False)
    obj(b)
    with pytest.raises(RuntimeError, match="val_image"):
        obj.after_optimizer_step(lr=1e-2, batches=[b])


def test_level3_restores_the_weights_and_logs():
    obj = objective()
    b = batch()
    obj(b)
    before = {n: p.detach().clone() for n, p in obj.named_parameters()}
    stats = obj.after_optimizer_step(lr=1e-2, batches=[b])
    assert all(torch.equal(p, before[n]) for n, p in obj.named_parameters())
    for key in ("level2_loss", "level2_train_top1", "level3_loss", "hypergrad_norm", "val_grad_norm"):
        assert key in stats and torch.isfinite(stats[key])
    assert stats["hypergrad_norm"] > 0


def test_half_precision_weights_are_untouched_and_hypergradient_is_fp32():
    """A bf16 objective (DeepSpeed's cast) runs the hypergradient on fp32 copies."""
    obj = objective()
    obj.bfloat16()
    b = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in batch().items()}
    obj(b)
    before = {n: p.detach().clone() for n, p in obj.named_parameters()}
    mask_before = snapshot(obj.aux.mask_net)
    obj.after_optimizer_step(lr=1e-2, batches=[b])
    assert all(torch.equal(p, before[n]) for n, p in obj.named_parameters())
    assert obj.aux.mask_net.net[1].weight.dtype == torch.float32 and changed(obj.aux.mask_net, mask_before)


def test_blo_lower_level_adds_the_classification_loss():
    obj = objective(variant="blo", blo_gamma=0.5)
    b = batch()
    out = obj(b)
    torch.testing.assert_close(out["loss"], 0.5 * objective()(b)["loss"] + out["blo_cls_loss"])
    out["loss"].backward()
    assert all(p.grad is None for p in obj.aux.head.parameters())  # C is held fixed in the engine's step


def stepped_and_restored():
    """(an objective after one step that ran levels II and III, a fresh one given its extra state)."""
    a = objective(seed=0)
    data = batch()
    a(data)
    a.after_optimizer_step(lr=1e-2, batches=[data])
    b = objective(seed=1)
    b.set_extra_state(a.get_extra_state())
    return a, b


def test_extra_state_round_trip():
    a, b = stepped_and_restored()
    for x, y in zip([*a.aux.mask_net.parameters(), *a.aux.head.parameters()],
                    [*b.aux.mask_net.parameters(), *b.aux.head.parameters()]):
        assert torch.equal(x, y)
    assert b.level1_done == 1 and b.cycles_done == 1
    assert b.aux.mask_opt.state_dict()["state"][0]["step"] == a.aux.mask_opt.state_dict()["state"][0]["step"]


def test_resumed_optimizers_follow_their_networks_to_the_device():
    """A resume loads T's and C's AdamW moments while the networks are on CPU; the first forward
    on the accelerator (meta stands in) must take the moments along and keep each optimizer bound to
    its network's parameters (meta's .to() replaces the Parameter objects; CUDA's keeps them)."""
    a, b = stepped_and_restored()
    assert all(s["step"] == 1 for opt in (b.aux.mask_opt, b.aux.head_opt) for s in opt.state.values())
    b.aux.follow(torch.device("meta"))
    for net, opt in ((b.aux.mask_net, b.aux.mask_opt), (b.aux.head, b.aux.head_opt)):
        params = [p for group in opt.param_groups for p in group["params"]]
        assert {id(p) for p in params} == {id(p) for p in net.parameters()}
        for p in params:
            state = opt.state[p]
            # the resumed moments and step count (a fresh optimizer has no state before its first step),
            # the step on the device too (fused AdamW keeps it there)
            assert {state[k].device.type for k in ("exp_avg", "exp_avg_sq", "step")} == {p.device.type} == {"meta"}
    assert b.aux.mask_opt.param_groups[0]["eps"] == a.aux.mask_opt.param_groups[0]["eps"] == 1e-16


def test_config_checks():
    MLOMAEConfig().check_engine(3, 1)  # every stage: the engine gathers the weights for levels II-III
    with pytest.raises(ValueError, match="level2_steps"):
        MLOMAEConfig(level2_steps=3, level1_steps=1).check_engine(2, 2)
    with pytest.raises(ValueError, match="num_classes 10"):
        MLOMAEConfig(num_classes=1000).check_labels(10)
    assert MLOMAEConfig(level1_steps=2, mask_every=3).val_every(accum=4) == 24


def test_a_checkpoint_of_torchs_default_adamw_resumes_into_the_fused_one():
    """Extra state written when C and T stepped with torch's single-tensor AdamW (step count on the
    host, `fused: False` in the groups) loads into the fused optimizers and stays fused, the
    moments and the count carried over: the next update is the one the old optimizer would make."""
    a = objective(seed=0)
    state = a.get_extra_state()
    for key, net in (("mask_opt", a.aux.mask_net), ("head_opt", a.aux.head)):  # rewrite as the old optimizer saved it
        old = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95))
        for p in net.parameters():
            p.grad = torch.randn_like(p)
        old.step()
        saved = old.state_dict()
        groups = state["aux"][key]["param_groups"]
        saved["param_groups"] = [{**g, "fused": None, "foreach": None} for g in groups]
        saved["state"] = {i: saved["state"][i] for i in range(sum(len(g["params"]) for g in groups))}
        assert all(s["step"].device.type == "cpu" for s in saved["state"].values())
        state["aux"][key] = saved
    b = objective(seed=1)
    b.set_extra_state(state)
    for opt in (b.aux.mask_opt, b.aux.head_opt):
        assert all(g["fused"] for g in opt.param_groups)
        assert all(s["step"].dtype == torch.float32 and s["step"].item() == 1 for s in opt.state.values())
    # the next step: fused from the carried-over state equals torch's default AdamW from it
    net, opt = b.aux.head, b.aux.head_opt
    ref_net = copy.deepcopy(net)
    ref = torch.optim.AdamW([{"params": [ref_net.weight], **{k: v for k, v in opt.param_groups[0].items() if k != "params"},
                              "fused": None},
                             {"params": [ref_net.bias], **{k: v for k, v in opt.param_groups[1].items() if k != "params"},
                              "fused": None}])
    ref.load_state_dict(copy.deepcopy(state["aux"]["head_opt"]))
    grads = [torch.randn_like(p) for p in net.parameters()]
    for p, g, q in zip(net.parameters(), grads, ref_net.parameters()):
        p.grad, q.grad = g.clone(), g.clone()
    for group in (*opt.param_groups, *ref.param_groups):
        group["lr"] = 1e-2
    opt.step()
    ref.step()
    for p, q in zip(net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mask_input_grad", [False, True])
@pytest.mark.parametrize("variant", ["mlo", "blo"])
def test_level3_hands_the_hypergradient_its_rates_paths_and_batches(monkeypatch, variant, mask_input_grad):
    """One cycle (level1_steps 2, level2_steps 2; the second step of 2 micro-batches) read through
    recorders: Eq. 9's eta_E (times gamma for BLO, Eq. 5) and eta_C = lr * head_lr_scale, the head
    path for MLO only, T's input as data (or recomputed with mask_input_grad), L1 and L2 on the
    latest D_tr micro-batch, T stepped at lr * mask_lr_scale after level2_steps head steps at
    lr * head_lr_scale."""
    import model.objectives.mlomae as mlomae_module

    lr = 1e-2
    obj = objective(variant=variant, blo_gamma=0.5, head_lr_scale=0.3, mask_lr_scale=0.7, level1_steps=2,
                    level2_steps=2, mask_input_grad=mask_input_grad)
    seen, steps, t_ins, l1_images, class_images = {}, [], [], [], []
    real_hypergradient, real_step = mlomae_module.mask_hypergradient, Auxiliary.step
    real_level1, real_class = obj.level1_loss, obj.class_loss

    def hypergradient(**kw):
        seen.update(kw)
        return real_hypergradient(**kw)

    def step(module, opt, grads, step_lr):
        steps.append((module, step_lr))
        real_step(module, opt, grads, step_lr)

    def level1_loss(state, images, t_in, masking, track_encoder=False):
        t_ins.append(t_in)
        l1_images.append(images)
        return real_level1(state, images, t_in, masking, track_encoder)

    def class_loss(state, head, images, labels):
        class_images.append(images)
        return real_class(state, head, images, labels)

    monkeypatch.setattr(mlomae_module, "mask_hypergradient", hypergradient)
    monkeypatch.setattr(Auxiliary, "step", staticmethod(step))
    monkeypatch.setattr(obj, "level1_loss", level1_loss)
    monkeypatch.setattr(obj, "class_loss", class_loss)
    older, middle, latest = batch(0, val=False), batch(2, val=False), batch(1)
    assert obj.after_optimizer_step(lr=lr, batches=[older]) == {}
    obj.after_optimizer_step(lr=lr, batches=[middle, latest])  # gradient accumulation: 2 micro-batches

    assert seen["lr_enc"] == pytest.approx(lr * (0.5 if variant == "blo" else 1.0))
    assert seen["lr_head"] == pytest.approx(lr * 0.3)
    assert seen["through_head"] is (variant == "mlo")
    assert [(m is obj.aux.head, m is obj.aux.mask_net) for m, _ in steps] == [(True, False)] * 2 + [(False, True)]
    assert [s for _, s in steps] == pytest.approx([lr * 0.3, lr * 0.3, lr * 0.7])
    assert all(s["step"].item() == 2 for s in obj.aux.head_opt.state.values())  # level2_steps AdamW steps of C
    assert t_ins and all((t is None) == mask_input_grad for t in t_ins)
    assert l1_images and all(torch.equal(x, latest["image"]) for x in l1_images)  # the step's last micro-batch
    # L3 on D_val; L2 (read only on MLO's head path) on the latest D_tr micro-batch, not an earlier one
    assert any(torch.equal(x, latest["val_image"]) for x in class_images)
    l2_images = [x for x in class_images if not torch.equal(x, latest["val_image"])]
    assert len(l2_images) == (2 if variant == "mlo" else 0)
    assert all(torch.equal(x, latest["image"]) for x in l2_images)


def test_the_level2_classifier_reads_the_cls_token_with_adamw_eps_1e8():
    """C is a linear layer on the encoder's cls token (not the patch mean); its AdamW keeps the
    default eps 1e-8 (only T's takes mask_adam_eps)."""
    obj = objective()
    images = batch()["image"]
    with torch.no_grad():
        obj.aux.head.weight.normal_()  # logits of order 1, far above assert_close's atol
        want = obj.aux.head(obj.encoder.forward_features(images)[:, 0])
        torch.testing.assert_close(obj.predict(images), want)
    assert all(g["eps"] == 1e-8 for g in obj.aux.head_opt.param_groups)
    assert all(g["eps"] == obj.cfg.mask_adam_eps == 1e-16 for g in obj.aux.mask_opt.param_groups)
