import pytest
import torch

from model import create_model
from model.objectives import build_objective
from model.objectives.mae import MAEConfig, masked_patch_loss, per_patch_mse
from model.objectives.patches import normalized_pixels, patchify, unpatchify

SMALL = MAEConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2)


def _objective(**cfg):
    torch.manual_seed(0)
    return build_objective("mae", create_model("vit_debug_patch4"), MAEConfig(**{**SMALL.__dict__, **cfg}))


def test_patchify_layout_and_inverse():
    img = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    p = patchify(img, 2)  # (2, 4, 12)
    assert p.shape == (2, 4, 12)
    # first patch = pixels (0:2, 0:2), flattened as (row, col, channel)
    want = torch.stack([img[0, :, r, c] for r in range(2) for c in range(2)]).flatten()
    assert torch.equal(p[0, 0], want)
    assert torch.equal(unpatchify(p, 2, (2, 2), 3), img)


def test_normalized_pixels_hand_computed():
    t = torch.tensor([[1.0, 2.0, 3.0, 6.0]])  # mean 3, unbiased var (4+1+0+9)/3 = 14/3
    want = (t - 3.0) / (14 / 3 + 1e-6) ** 0.5
    assert torch.allclose(normalized_pixels(t), want)


def test_normalized_pixels_of_a_near_flat_patch_add_eps_to_the_variance():
    """Official MAE: (t - mean) / (var + 1e-6) ** .5 with the unbiased variance. On a patch whose
    variance (1.67e-6) is of the order of eps, eps's value and where it is added both show."""
    t = torch.tensor([[0.0, 1e-3, 2e-3, 3e-3]])
    ref = t.double()
    mean = ref.mean()
    var = ((ref - mean) ** 2).sum() / 3  # unbiased: 5e-6 / 3
    want = (ref - mean) / (var + 1e-6) ** 0.5  # about +-0.92, +-0.31
    torch.testing.assert_close(normalized_pixels(t).double(), want, rtol=1e-4, atol=0)


def test_per_patch_mse_of_bf16_inputs_is_computed_and_returned_in_fp32():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(2, 4, 48, generator=g).bfloat16(), torch.randn(2, 4, 48, generator=g).bfloat16()
    got = per_patch_mse(pred, target)
    assert got.dtype == torch.float32
    want = ((pred.float() - target.float()) ** 2).mean(-1)  # the same bf16 values, squared and averaged in fp32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_the_target_of_bf16_images_is_the_fp32_target_of_the_same_pixels():
    """Normalising in bf16 would round the target to 8 bits of mantissa (errors ~2e-3)."""
    obj = _objective()
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = obj.target(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, obj.target(x.float()))


def test_loss_hand_computed():
    pred = torch.tensor([[[1.0, 1.0], [0.0, 2.0], [3.0, 0.0]]])  # (1, 3 patches, 2)
    target = torch.zeros(1, 3, 2)
    mask = torch.tensor([[1.0, 0.0, 1.0]])  # patches 0 and 2 removed
    # per-patch MSE: [1, 2, 4.5]; mean over removed = (1 + 4.5) / 2
    assert torch.isclose(masked_patch_loss(pred, target, mask), torch.tensor(2.75))


def test_visible_targets_never_change_the_loss():
    pred, target = torch.randn(2, 6, 5), torch.randn(2, 6, 5)
    mask = torch.tensor([[1, 0, 1, 0, 1, 1], [0, 1, 1, 1, 0, 1]], dtype=torch.float32)
    changed = target.clone()
    changed[mask == 0] += 100 * torch.randn_like(changed[mask == 0])
    assert torch.equal(masked_patch_loss(pred, target, mask), masked_patch_loss(pred, changed, mask))
    # ...and the loss sends no gradient to visible predictions
    pred.requires_grad_()
    masked_patch_loss(pred, target, mask).backward()
    assert torch.all(pred.grad[mask == 0] == 0) and torch.all(pred.grad[mask == 1].abs().sum(-1) > 0)


def test_objective_loss_equals_manual_pipeline():
    obj = _objective()
    x = torch.randn(2, 3, 28, 28)
    noise = torch.rand(2, 49)
    out = obj({"image": x, "mask_noise": noise})
    # recompute by hand from the pieces
    keep = int(49 * 0.25)
    ids_shuffle = torch.argsort(noise, dim=1)
    tokens = obj.encoder.patch_embed(x) + obj.encoder.pos_embed[:, 1:]
    kept = torch.gather(tokens, 1, ids_shuffle[:, :keep, None].expand(-1, -1, 32))
    latent = obj.encoder.forward_tokens(obj.encoder.add_cls_token(kept))
    pred = obj.decoder(latent, torch.argsort(ids_shuffle, dim=1))
    mask = torch.ones(2, 49)
    mask.scatter_(1, ids_shuffle[:, :keep], 0.0)
    target = normalized_pixels(patchify(x, 4))
    want = (((pred - target) ** 2).mean(-1) * mask).sum() / mask.sum()
    assert torch.allclose(out["loss"], want, atol=1e-6)
    assert torch.equal(out["mask"], mask)


def test_supplied_mask_and_noise_are_reproducible():
    obj = _objective()
    x = torch.randn(2, 3, 28, 28)
    noise = torch.rand(2, 49)
    a, b = obj({"image": x, "mask_noise": noise}), obj({"image": x, "mask_noise": noise})
    assert torch.equal(a["loss"], b["loss"])
    c = obj({"image": x, "mask": a["mask"]})
    assert torch.allclose(c["loss"], a["loss"], atol=1e-6)  # same removed set, same loss


@pytest.mark.parametrize("key, shape, says", [
    ("mask", (1, 49), r"batch\['mask'\] must have shape \(images, patches\) = \(2, 49\), got \(1, 49\)"),
    ("mask_noise", (1, 49), r"batch\['mask_noise'\] must have shape .* = \(2, 49\), got \(1, 49\)"),
    ("mask", (2, 48), r"got \(2, 48\)"),
    ("mask_noise", (3, 49), r"got \(3, 49\)"),
])
def test_a_supplied_mask_or_noise_of_another_shape_is_refused(key, shape, says):
    """A 1-row mask for 2 images encoded image 0 only and broadcast its prediction against both
    targets (a loss of 2.90 where image 0 alone gives 1.42); a shorter row failed deep inside."""
    obj, x = _objective(), torch.randn(2, 3, 28, 28)
    given = (torch.rand(shape) < 0.75).float() if key == "mask" else torch.rand(shape)
    with pytest.raises(ValueError, match=says):
        obj({"image": x, key: given})


@pytest.mark.parametrize("fill, says", [(0.0, "removing 0 of 49"), (1.0, "removing 49 of 49")])
def test_a_supplied_mask_that_removes_nothing_or_everything_is_refused(fill, says):
    """An all-kept mask gave a NaN loss (0 / 0); an all-removed one left the encoder its cls token."""
    obj = _objective()
    with pytest.raises(ValueError, match=f"must remove at least one patch and keep at least one, got one {says}"):
        obj({"image": torch.randn(2, 3, 28, 28), "mask": torch.full((2, 49), fill)})


def test_gradients_reach_the_encoder():
    obj = _objective()
    obj({"image": torch.randn(2, 3, 28, 28)})["loss"].backward()
    for name, p in obj.encoder.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert obj.decoder.mask_token.grad.abs().sum() > 0


def test_unnormalized_target_option():
    obj = _objective(norm_pix_loss=False)
    x = torch.randn(1, 3, 28, 28)
    assert torch.equal(obj.target(x), patchify(x, 4))


def test_overfits_a_fixed_batch():
    # With the masking fixed, encoder + decoder can memorise one batch: the loss must fall far
    # below the 15/16 that predicting zeros scores on normalized 4x4 patches.
    obj = _objective()
    torch.manual_seed(1)
    batch = {"image": torch.randn(4, 3, 28, 28), "mask_noise": torch.rand(4, 49)}
    opt = torch.optim.AdamW(obj.parameters(), lr=3e-3)
    first = None
    for _ in range(300):
        loss = obj(batch)["loss"]
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.25 * first and loss.item() < 0.5


def test_a_method_built_on_maes_config_names_its_own_section(monkeypatch):
    """A config deriving MAEConfig, registered under another name, reports the options its user set."""
    from model.objectives import base
    from model.objectives.mae import MAEObjective

    monkeypatch.setattr(base, "OBJECTIVES", dict(base.OBJECTIVES))  # leave the registry the other tests see as it was

    class OtherConfig(MAEConfig):
        pass

    base.register_objective("mae_other", OtherConfig)(type("MAEOther", (MAEObjective,), {}))
    with pytest.raises(ValueError, match=r"^mae_other\.decoder_dim 30 is not divisible by mae_other\.decoder_heads 4$"):
        OtherConfig(decoder_dim=30, decoder_heads=4).validate()
    with pytest.raises(ValueError, match=r"^mae_other\.mask_ratio 0\.99 keeps no patch of the 49"):
        OtherConfig(mask_ratio=0.99).check_fits(img_size=28, patch_size=4, depth=2, micro_batch=8)
    with pytest.raises(ValueError, match=r"^mae\.decoder_dim 30 is not divisible by mae\.decoder_heads 4$"):
        MAEConfig(decoder_dim=30, decoder_heads=4).validate()  # MAE's own section stays its own


def test_a_supplied_mask_wins_over_supplied_noise():
    # make_masking: "mask" takes precedence; the noise would remove another set of patches
    obj = _objective()
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 49)
    mask[:, 12:] = 1  # keeps the first 12 patches
    noise = torch.linspace(1, 0, 49).expand(2, -1)  # alone it keeps the last 12
    out = obj({"image": x, "mask": mask, "mask_noise": noise})
    assert torch.equal(out["mask"], mask)
    assert torch.equal(out["loss"], obj({"image": x, "mask": mask})["loss"])


def test_reconstruction_figure_maps_predictions_back_with_each_patchs_mean_and_unbiased_std():
    # MAE's demo: pred * sqrt(var + 1e-6) + mean, var unbiased as in the normalised target
    obj = _objective().eval()
    gen = torch.Generator().manual_seed(1)
    x, noise = torch.randn(2, 3, 28, 28, generator=gen), torch.rand(2, 49, generator=gen)
    rows = obj.visualizations(x, noise)["mae_reconstruction"]
    with torch.no_grad():
        pred = obj({"image": x, "mask_noise": noise})["pred"]  # the same masking
    target = patchify(x, 4)
    mean = target.mean(-1, keepdim=True)
    var = ((target - mean) ** 2).sum(-1, keepdim=True) / (target.shape[-1] - 1)
    want = unpatchify(pred * (var + 1e-6) ** 0.5 + mean, 4, (7, 7), 3)
    assert torch.allclose(rows[2], want, atol=1e-5)
