import math

import pytest
import torch

from model import create_model
from model.objectives import build_objective
from model.objectives.homocon import homologous_contrastive_loss
from model.objectives.mae import masked_patch_loss
from model.objectives.masking import gather_tokens, masking_from_mask, random_masking
from model.objectives.mixedae import MixedAEConfig
from model.objectives.mixing import mix_images
from model.objectives.patches import normalized_pixels, patchify
from model.pos_embed import sincos_1d


def _objective(seed=0, img_size=32, **kw):
    torch.manual_seed(seed)
    enc = create_model("vit_debug_patch4", in_chans=1, img_size=img_size)  # 8x8 patches at 32 px, 2 blocks
    cfg = MixedAEConfig(**{"cell_size": 8, "decoder_dim": 32, "decoder_depth": 1, "decoder_heads": 2,
                           "proj_dim": 16, **kw})
    return build_objective("mixedae", enc, cfg).double()


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _project(obj, tokens):
    """The projection head written out: Linear -> GELU -> Linear, l2-normalised (the reference for
    z, from the head's captured input, so a head that skips a step does not set its own reference)."""
    head = obj.projector
    hidden = torch.nn.functional.gelu(tokens @ head.fc1.weight.T + head.fc1.bias)
    return torch.nn.functional.normalize(hidden @ head.fc2.weight.T + head.fc2.bias, dim=-1)


def _identity_blocks(obj):
    for block in obj.encoder.blocks:  # residual branches output zero: every block passes its input on
        for lin in (block.attn.proj, block.mlp.fc2):
            torch.nn.init.zeros_(lin.weight)
            torch.nn.init.zeros_(lin.bias)


def test_homocon_matches_hand_computation():
    # 5 unit vectors, labels a a b b c, tau 0.5. Anchor 0's only positive is 1. Token 4 has no
    # positive: it is a negative of every other anchor but no anchor itself (skipped, not a 0 term).
    z = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [-1.0, 0.0], [0.8, -0.6]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1, 2])
    tau = 0.5
    total, anchors = 0.0, 0
    for i in range(5):
        sims = {a: float(z[i] @ z[a]) / tau for a in range(5) if a != i}
        log_den = math.log(sum(math.exp(s) for s in sims.values()))
        pos = [p for p in sims if labels[p] == labels[i]]
        if pos:
            total += -sum(sims[p] - log_den for p in pos) / len(pos)
            anchors += 1
    assert anchors == 4
    got = homologous_contrastive_loss(z, labels, tau)
    assert got.item() == pytest.approx(total / anchors, rel=1e-12)
    # Anchor 0 by hand: sims 0.6/.5=1.2, 0, -2, 0.8/.5=1.6 -> -(1.2 - log(e^1.2 + 1 + e^-2 + e^1.6))
    a0 = -(1.2 - math.log(math.exp(1.2) + 1 + math.exp(-2) + math.exp(1.6)))
    assert a0 == pytest.approx(-(float(z[0] @ z[1]) / tau - math.log(sum(math.exp(float(z[0] @ z[a]) / tau) for a in (1, 2, 3, 4)))))


def test_projection_head_is_linear_gelu_linear_with_unit_norm_output():
    obj = _objective()
    tokens = torch.randn(2, 5, 32, dtype=torch.float64, generator=_gen(0))
    z = obj.projector(tokens)
    assert torch.allclose(z.norm(dim=-1), torch.ones(2, 5, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(z, _project(obj, tokens), atol=1e-12)


def test_homocon_of_independent_sets_contrasts_each_set_among_itself():
    z = torch.nn.functional.normalize(torch.randn(3, 10, 4, dtype=torch.float64, generator=_gen(0)), dim=-1)
    labels = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 3]).expand(3, -1)
    each = [homologous_contrastive_loss(z[i], labels[i], 0.2) for i in range(3)]  # every anchor has a positive
    assert homologous_contrastive_loss(z, labels, 0.2).item() == pytest.approx(sum(each).item() / 3, rel=1e-12)


def test_without_mixing_contrasts_the_images_of_each_group_of_g():
    """The ablation of Table A4c applies Eq. 7 "to patches across different images in groups of 4"
    (appendix C): each image's visible tokens are contrasted with its group's other images only."""
    obj = _objective(mixing="none", attention="global")
    captured = []
    obj.projector.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    torch.manual_seed(3)
    out = obj(dict(image=torch.randn(8, 1, 32, 32, dtype=torch.float64)))
    z = _project(obj, captured[0])  # (8 images, L visible tokens, proj_dim)
    L = z.shape[1]
    assert L == int(64 * 0.25)  # MAE masking at ratio 1 - r: r N tokens visible
    labels = torch.arange(4).repeat_interleave(L)  # image index within its group
    groups = [homologous_contrastive_loss(z[i:i + 4].flatten(0, 1), labels, obj.cfg.temperature) for i in (0, 4)]
    assert out["loss_homocon"].item() == pytest.approx((groups[0] + groups[1]).item() / 2, rel=1e-12)
    whole = homologous_contrastive_loss(z.flatten(0, 1), torch.arange(8).repeat_interleave(L), obj.cfg.temperature)
    assert abs(whole.item() - out["loss_homocon"].item()) > 1e-3  # the whole micro-batch: other negatives


@pytest.mark.parametrize("mixing", ["compose", "full"])
def test_homocon_of_mixed_images_is_the_reference_loss_over_the_micro_batch(mixing):
    """Positives: tokens of the same source in the same mixed image; negatives: every other token of
    the micro-batch (METHODS.md). A label that forgot the mixed image (segment alone) made tokens
    of different mixed images positives and passed every other test."""
    obj = _objective(mixing=mixing)
    captured = []
    obj.projector.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    images = torch.randn(8, 1, 32, 32, dtype=torch.float64, generator=_gen(1))
    mixing_draw = obj.draw_mixing(8, torch.device("cpu"), _gen(2))
    out = obj.forward_mixed(images, mixing_draw)
    z = _project(obj, captured[0])  # (mixed images, N, proj_dim)
    labels = torch.stack([m * obj.g + mixing_draw.segment[m] for m in range(len(z))])  # (mixed images, N)
    want = homologous_contrastive_loss(z.flatten(0, 1), labels.flatten(), obj.cfg.temperature)
    assert out["loss_homocon"].item() == pytest.approx(want.item(), rel=1e-12)
    segment_only = homologous_contrastive_loss(z.flatten(0, 1), mixing_draw.segment.flatten(), obj.cfg.temperature)
    assert abs(segment_only.item() - want.item()) > 1e-4


def test_masked_self_attention_never_lets_information_cross_images():
    obj = _objective(attention="masked").eval()
    images = torch.randn(4, 1, 32, 32, dtype=torch.float64, generator=_gen(1))
    mixing = obj.draw_mixing(4, torch.device("cpu"), _gen(2))
    a = mixing.segment[0] == 0  # positions of image 0 in the mixed image
    latent, _ = obj.encode_mixed(mix_images(images, mixing, 4), mixing.segment)
    perturbed = images.clone()
    perturbed[1:] += torch.randn(3, 1, 32, 32, dtype=torch.float64, generator=_gen(3))  # images B, C, D
    latent2, _ = obj.encode_mixed(mix_images(perturbed, mixing, 4), mixing.segment)
    assert torch.allclose(latent2[0, 1:][a], latent[0, 1:][a], atol=1e-12)
    assert not torch.allclose(latent2[0, 1:][~a], latent[0, 1:][~a])
    # Global attention (the naive baseline) does leak: the same perturbation moves image 0's tokens.
    leaky = _objective(attention="global").eval()
    l1, _ = leaky.encode_mixed(mix_images(images, mixing, 4), mixing.segment)
    l2, _ = leaky.encode_mixed(mix_images(perturbed, mixing, 4), mixing.segment)
    assert not torch.allclose(l2[0, 1:][a], l1[0, 1:][a])


def test_segment_embeddings_are_added_to_every_block_input():
    obj = _objective(attention="global")
    _identity_blocks(obj)
    seen = []
    for block in obj.encoder.blocks:
        block.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    images = torch.randn(4, 1, 32, 32, dtype=torch.float64, generator=_gen(1))
    mixing = obj.draw_mixing(4, torch.device("cpu"), _gen(2))
    mixed = mix_images(images, mixing, 4)
    obj.encode_mixed(mixed, mixing.segment)
    x0 = obj.encoder.add_cls_token(obj.encoder.embed_patches(mixed)).detach()
    se = sincos_1d(32, torch.arange(4))[mixing.segment]  # (1, N, D): sin-cos of the source index
    for i, block_input in enumerate(seen):
        assert torch.allclose(block_input[:, 0], x0[:, 0])  # cls gets no segment embedding
        assert torch.allclose(block_input[:, 1:], x0[:, 1:] + (i + 1) * se, atol=1e-6)  # fp32 table


def test_without_mixing_segment_embeddings_are_each_images_index_in_its_group():
    obj = _objective(mixing="none", attention="global")
    _identity_blocks(obj)
    seen = []
    for block in obj.encoder.blocks:
        block.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    images = torch.randn(8, 1, 32, 32, dtype=torch.float64, generator=_gen(1))
    torch.manual_seed(4)
    obj.forward_unmixed(images)
    torch.manual_seed(4)
    masking = random_masking(8, 64, 0.75, torch.device("cpu"))  # the masking the forward drew
    x0 = obj.encoder.add_cls_token(gather_tokens(obj.encoder.embed_patches(images), masking.ids_keep)).detach()
    se = sincos_1d(32, torch.arange(4))[torch.arange(8) % 4][:, None]  # (8, 1, D): images 0..3, 0..3
    assert len(seen) == 2
    for i, block_input in enumerate(seen):
        assert torch.allclose(block_input[:, 0], x0[:, 0])  # cls gets no segment embedding
        assert torch.allclose(block_input[:, 1:], x0[:, 1:] + (i + 1) * se, atol=1e-6)


@pytest.mark.parametrize("mixing", ["compose", "none"])
def test_the_loss_is_the_weighted_sum_of_reconstruction_and_homocon(mixing):
    # L = recon_weight * L_recon + homocon_weight * L_HomoCon
    obj = _objective(mixing=mixing, attention="global" if mixing == "none" else "topk",
                     recon_weight=0.5, homocon_weight=2.0)
    out = obj(dict(image=torch.randn(8, 1, 32, 32, dtype=torch.float64, generator=_gen(1))))
    assert out["loss"].item() == pytest.approx(0.5 * out["loss_recon"].item() + 2.0 * out["loss_homocon"].item(),
                                               rel=1e-12)


def test_without_mixing_reconstruction_is_maes_loss_at_ratio_1_minus_r():
    obj = _objective(mixing="none", attention="global")
    images = torch.randn(8, 1, 32, 32, dtype=torch.float64, generator=_gen(1))
    torch.manual_seed(4)
    out = obj(dict(image=images))
    torch.manual_seed(4)
    masking = random_masking(8, 64, 1 - 0.25, torch.device("cpu"))  # keeps int(64 * 0.25) = 16
    x = obj.encoder.add_cls_token(gather_tokens(obj.encoder.embed_patches(images), masking.ids_keep))
    seg = torch.zeros(8, 17, 32, dtype=torch.float64)
    seg[:, 1:] = sincos_1d(32, torch.arange(4)).float()[torch.arange(8) % 4][:, None]  # the fp32 table
    pred = obj.decoder(obj.encoder.forward_tokens(x, seg), masking.ids_restore)
    want = masked_patch_loss(pred, normalized_pixels(patchify(images, 4)), masking.mask)
    assert masking.mask.sum(1).eq(48).all()
    assert out["loss_recon"].item() == pytest.approx(want.item(), rel=1e-10)


def test_unmixing_loss_equals_a_per_source_mae_decoder_loop():
    obj = _objective()
    images = torch.randn(8, 1, 32, 32, dtype=torch.float64, generator=_gen(1))
    mixing = obj.draw_mixing(8, torch.device("cpu"), _gen(2))
    out = obj.forward_mixed(images, mixing)
    latent, _ = obj.encode_mixed(mix_images(images, mixing, 4), mixing.segment)
    sq_sum, count = 0.0, 0.0
    for m in range(2):
        for s in range(4):
            src = m * 4 + s
            others = (mixing.segment[m] != s).double()[None]  # 1 = the decoder must fill these in
            masking = masking_from_mask(others)
            kept = latent[m : m + 1, 1:][:, masking.ids_keep[0]]
            pred = obj.decoder(torch.cat([latent[m : m + 1, :1], kept], 1), masking.ids_restore)  # MAE's path
            target = normalized_pixels(patchify(images[src : src + 1], 4))
            sq_sum += masked_patch_loss(pred, target, others).item() * float(others.sum())
            count += float(others.sum())
    assert out["loss_recon"].item() == pytest.approx(sq_sum / count, rel=1e-10)
    assert out["loss"].item() == pytest.approx(out["loss_recon"].item() + out["loss_homocon"].item(), rel=1e-12)


def test_topk_accuracy_is_logged_for_the_chosen_blocks_and_is_perfect_when_images_are_separable():
    obj = _objective(homologous_blocks="1")
    out = obj(dict(image=torch.randn(8, 1, 32, 32, dtype=torch.float64)))
    assert {k for k in out if k.startswith("topk_acc")} == {"topk_acc", "topk_acc_block1"}
    # Queries and keys of image i point along axis i (q = k per segment, margin large): the top
    # r*N = 16 keys of every patch query are exactly its own image's 16 patches.
    from kernels import GLOBAL, TopKMask, attention

    seg = obj.draw_mixing(4, torch.device("cpu"), _gen(0)).segment
    segments = torch.cat([torch.full((1, 1), GLOBAL), seg], 1)
    qk = torch.nn.functional.one_hot(segments.clamp_min(0), 4).double()[:, None] * 10  # (1, 1, 65, 4)
    qk[:, :, 0] = 0  # cls: logit 0 with every patch
    mask = TopKMask(obj.topk, segments=segments)
    attention(qk, qk, torch.randn_like(qk), mask=mask)
    assert obj.topk == 16 and mask.same_source_share.item() == 1.0


def _topk_share_after_training(segment_scale: float, steps: int = 300, seed: int = 0) -> tuple[float, float]:
    """One attention layer with homologous TopK (16 tokens from 4 sources, K = 4) trained to output,
    for each token, the mean of the OTHER tokens of its source: only keys of its own source help.
    Contents are random, so the source shows only through the segment embeddings added to the
    input (x `segment_scale`). TopK sampling accuracy (mean of the first and of the last 20 steps)."""
    from kernels import GLOBAL, TopKMask
    from model.pos_embed import sincos_segments
    from model.vit import Attention

    torch.manual_seed(seed)
    D, g, N, B = 32, 4, 16, 16
    attn, table, readout = Attention(D, 2), sincos_segments(D, g), torch.randn(D, D) / D**0.5
    opt = torch.optim.Adam(attn.parameters(), lr=3e-3)
    shares = []
    for _ in range(steps):
        content = 0.5 * torch.randn(B, N, D)
        segments = (torch.arange(N) % g)[torch.randperm(N)].expand(B, N)  # 4 tokens per source
        x = torch.cat([torch.zeros(B, 1, D), content + segment_scale * table[segments]], 1)  # cls first
        mask = TopKMask(N // g, num_global=1, segments=torch.cat([torch.full((B, 1), GLOBAL), segments], 1))
        others = (segments[:, :, None] == segments[:, None, :]).float() * (1 - torch.eye(N))  # (B, N, N)
        target = others / others.sum(-1, keepdim=True) @ (content @ readout)
        loss = (attn(x, mask)[:, 1:] - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        shares.append(mask.same_source_share.item())
    return sum(shares[:20]) / 20, sum(shares[-20:]) / 20


def test_homologous_topk_attention_learns_to_pick_its_own_source_from_segment_embeddings():
    # Gradients reach the selection only through the kept keys' logits; this checks that they still
    # teach q and k to prefer keys of the query's own source (chance: 4 of 17 keys, 0.235).
    start, end = _topk_share_after_training(segment_scale=1.0)
    assert start < 0.28 and end > 0.33
    # the control: without segment embeddings nothing tells the sources apart, and it stays at chance
    start, end = _topk_share_after_training(segment_scale=0.0)
    assert start < 0.28 and end < 0.26


def test_topk_per_source_gives_each_query_its_own_image_patch_count():
    # 49 cells over 4 images: counts 12 or 13, so a per-query K differs from the global round(r N)
    obj = _objective(img_size=28, topk_per_source=True, exact_counts=False, cell_size=4)
    seg = obj.draw_mixing(4, torch.device("cpu"), _gen(0)).segment
    segments = torch.cat([torch.full((1, 1), -1), seg], 1)
    k = obj.attention_masks(segments)[0].k
    counts = torch.bincount(seg[0], minlength=4)
    assert sorted(counts.tolist()) == [12, 12, 12, 13]
    assert torch.equal(k[0, 1:], counts[seg[0]])
    assert k[0, 1:].unique().numel() == 2


def test_default_topk_is_r_times_n_rounded_half_up():
    assert _objective(img_size=28, mix_ratio=0.5, cell_size=4).topk == int(0.5 * 49 + 0.5) == 25  # 24.5
    assert _objective(img_size=28, mix_ratio=0.2, cell_size=4).topk == 10  # 9.8
    assert _objective().topk == 16  # 0.25 * 64


@pytest.mark.parametrize("mixing, n", [("compose", 4), ("full", 8)])  # full: 2 groups of 4 mixed images
def test_unmixing_figure_pastes_each_images_own_cells_over_the_denormalised_prediction(mixing, n):
    obj = _objective(mixing=mixing).eval()
    images = torch.randn(n, 1, 32, 32, dtype=torch.float64, generator=_gen(1))
    rows = obj.visualizations(images, None)["mixedae_unmixing"]
    draw = obj.draw_mixing(n, torch.device("cpu"), _gen(0))  # the figure's fixed mixing
    mixed = mix_images(images, draw, 4)
    latent, _ = obj.encode_mixed(mixed, draw.segment)
    pred, keep, source = obj.unmix_predictions(latent, draw)  # (Bm, g, N, P), (Bm, g, N), (Bm, g)
    target = patchify(images, 4)  # (n, N, P)
    for i in range(n):
        m, s = (source == i).nonzero()[0].tolist()  # the first mixed image holding image i, its decoding
        own = (draw.source[m] == i)[:, None]  # (N, 1): image i's cells in that mixed image
        assert own.any() and torch.equal(own[:, 0], keep[m, s])
        assert torch.allclose(rows[1][i].double(), mixed[m], atol=1e-6)  # the mixed image it sits in
        p = pred[m, s] * (target[i].var(-1, keepdim=True) + 1e-6) ** 0.5 + target[i].mean(-1, keepdim=True)
        got = patchify(rows[3][i : i + 1].double(), 4)[0]
        assert torch.allclose(got, torch.where(own, target[i], p), atol=1e-5)
        assert torch.allclose(patchify(rows[2][i : i + 1].double(), 4)[0], torch.where(own, target[i], 0.0), atol=1e-6)


def test_the_reconstruction_target_is_fp32_for_bf16_images():
    # bf16 pixels normalised in bf16 lose about 1e-2; the target is the fp32 normalisation of the same pixels
    obj = _objective().float()
    images = (torch.randn(4, 1, 32, 32, generator=_gen(1)) * 3 + 5).bfloat16()
    got = obj.target(images)
    assert got.dtype == torch.float32
    assert torch.equal(got, normalized_pixels(patchify(images.float(), 4)))


def test_every_ablation_runs_forward_and_backward():
    for kw in [dict(), dict(mixing="full"), dict(attention="masked", segment_embed=False, homocon_weight=0.0),
               dict(attention="global", segment_embed=False, homocon_weight=0.0), dict(recon_weight=0.0),
               dict(homocon_weight=0.0), dict(mixing="none", attention="global"), dict(segment_embed=False)]:
        obj = _objective(**kw)
        out = obj(dict(image=torch.randn(8, 1, 32, 32, dtype=torch.float64)))
        out["loss"].backward()
        grads = [p.grad for p in obj.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads), kw  # no unused parameters
        assert ("loss_recon" in out) == (obj.cfg.recon_weight > 0) and ("loss_homocon" in out) == (obj.cfg.homocon_weight > 0)


@pytest.mark.parametrize("kw, match", [
    (dict(mix_ratio=0.3), "1/g"),
    (dict(mixing="none", attention="topk"), "attention global"),
    (dict(recon_weight=0.0, homocon_weight=0.0), "not both 0"),
    (dict(homologous_blocks="0,x"), "comma-separated"),
    (dict(homologous_blocks="5"), r"0\.\.1"),
    (dict(cell_size=6), "multiple of the patch size"),
    (dict(cell_size=4, exact_counts=True, mix_ratio=0.2), "exact_counts false"),
])
def test_bad_configs_are_rejected_with_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        _objective(**kw)


def test_a_cell_size_that_does_not_divide_the_image_is_told_one_that_does():
    """At 28 px (patch 4) the hint said "e.g. 8", the very size it refused."""
    cfg = MixedAEConfig(cell_size=8)
    with pytest.raises(ValueError, match=r"divide the image size 28 \(e.g. 4\)"):
        cfg.check_fits(28, 4, 2, 8)
    with pytest.raises(ValueError, match=r"divide the image size 224 \(e.g. 32\)"):
        MixedAEConfig(cell_size=48).check_fits(224, 16, 12, 8)
    MixedAEConfig(cell_size=4).check_fits(28, 4, 2, 8)


def test_a_layout_of_exactly_g_cells_gives_each_image_one_cell():
    # 64 px in 32 px cells: 4 cells for g = 4, one each (also an exact split); 1 cell of 64 px is too few
    for exact in (False, True):
        MixedAEConfig(cell_size=32, exact_counts=exact).check_fits(64, 16, 12, 8)
    with pytest.raises(ValueError, match="do not split into g = 4"):
        MixedAEConfig(cell_size=64).check_fits(64, 16, 12, 8)
    obj = _objective(img_size=16, cell_size=8)  # the same layout at patch 4: 4 cells of 2x2 patches
    seg = obj.draw_mixing(4, torch.device("cpu"), _gen(0)).segment
    assert torch.equal(torch.bincount(seg[0], minlength=4), torch.full((4,), 4))  # one 4-patch cell each


def test_micro_batch_must_be_a_multiple_of_the_group_size():
    with pytest.raises(ValueError, match="multiple of 4"):
        MixedAEConfig().check_fits(224, 16, 12, micro_batch=6)
    MixedAEConfig().check_fits(224, 16, 12, micro_batch=8)  # ViT-B: 49 cells of 32 px -> not exact
