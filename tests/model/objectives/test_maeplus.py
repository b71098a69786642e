import pytest
import torch

from model import create_model
from model.objectives import build_objective
from model.objectives.adversary import Adversaries, RPEPerturbation, coordinate_corners
from model.objectives.maeplus import MAEPlusConfig


def _objective(seed=0, rpe=False, table_std=0.0, **kw):
    torch.manual_seed(seed)
    enc = create_model("vit_debug_patch4", rpe=rpe)  # 28 px, patch 4: a 7x7 grid like MAE+'s 112 px crops
    obj = build_objective("maeplus", enc, MAEPlusConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2, rpe=rpe, **kw))
    if table_std:  # iRPE tables start at 0; give them values so relative positions matter
        for module in obj.modules():
            if hasattr(module, "table"):
                torch.nn.init.normal_(module.table, std=table_std)
    return obj.double()


def _loss(obj, images, seed=5):
    torch.manual_seed(seed)  # the same masking every call
    return obj({"image": images})["loss"]


def test_multicrop_batch_is_k_crops_per_image_each_masked_75_percent():
    obj = _objective()
    images = torch.randn(2, 4, 3, 28, 28, dtype=torch.float64)
    torch.manual_seed(0)
    seen = {}
    obj.decoder.register_forward_hook(lambda m, a, out: seen.setdefault("pred", out))
    orig = obj.reconstruct
    obj.reconstruct = lambda crops, masked: (seen.setdefault("masked", masked), orig(crops, masked))[1]
    loss = obj({"image": images})["loss"]
    assert seen["masked"].shape == (8, 49) and torch.all(seen["masked"].sum(1) == 49 - 12)  # floor(49/4) kept
    assert torch.isfinite(loss)


@pytest.mark.parametrize("adversary", ["ape_embed", "ape_coord"])
def test_ape_perturbs_only_masked_tokens_positions(adversary):
    obj = _objective(adversary=adversary)
    obj.adversaries.tensors["ape"] = torch.full_like(obj.adversaries.tensors["ape"], 0.7).requires_grad_()
    masked = torch.zeros(2, 49, dtype=torch.bool)
    masked[0, :10] = True
    pos = obj.positions(masked, torch.float64)
    fixed = obj.encoder.pos_embed[0, 1:].double()
    assert torch.equal(pos[~masked], fixed.expand(2, -1, -1)[~masked])
    assert not torch.allclose(pos[masked], fixed.expand(2, -1, -1)[masked])
    (grad,) = torch.autograd.grad(pos.sum(), obj.adversaries.tensors["ape"])
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ["delta", "embed"])
def test_rpe_adversary_leaves_visible_query_rows_untouched(mode):
    obj = _objective(rpe=True, table_std=0.5)
    rpe = obj.encoder.blocks[0].attn.rpe
    q = torch.randn(2, 2, 50, 16, dtype=torch.float64)
    masked = torch.zeros(2, 49, dtype=torch.bool)
    masked[:, 5:20] = True
    value = torch.tensor([0.4, -1.3], dtype=torch.float64) if mode == "delta" else torch.randn(50, 2, 16, dtype=torch.float64)
    value.requires_grad_()
    clean = rpe(q)
    hook = (RPEPerturbation(masked, corners=coordinate_corners(rpe, value[None])[0]) if mode == "delta"
            else RPEPerturbation(masked, embed=value))
    attacked = rpe(q, hook)
    rows = torch.cat([torch.zeros(2, 1, dtype=torch.bool), masked], 1)  # (B, T) perturbed query rows
    assert torch.equal(attacked.transpose(1, 2)[~rows], clean.transpose(1, 2)[~rows])  # cls and visible rows
    assert not torch.allclose(attacked.transpose(1, 2)[rows], clean.transpose(1, 2)[rows])
    (grad,) = torch.autograd.grad(attacked.sum(), value)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("adversary, rpe", [("ape_embed", False), ("ape_coord", False), ("rpe_embed", True),
                                            ("rpe_coord", True)])
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_a_pgd_step_increases_the_loss_and_stays_within_eps(adversary, rpe, norm):
    obj = _objective(rpe=rpe, table_std=0.5, adversary=adversary, adv_norm=norm, adv_eps=0.05)
    images = torch.randn(2, 2, 3, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    before = _loss(obj, images)
    before.backward()
    obj.after_optimizer_step(1e-3, [{"image": images}])  # PGD step of 1e-3 in the constraint's steepest-ascent direction
    after = _loss(obj, images)
    assert after.item() > before.item()
    for _ in range(3):  # steps larger than eps: the projection keeps every adversary inside the ball / box
        _loss(obj, images).backward()
        obj.after_optimizer_step(0.2, [{"image": images}])
    for name, t in obj.adversaries.tensors.items():
        size = t.detach().abs().max() if norm == "linf" else t.detach().norm()
        assert size <= 0.05 * (1 + 1e-6), name  # fp32 adversaries
        assert size >= 0.05 - 1e-6, name  # it went to the boundary


def test_adversaries_are_checkpointed_and_not_in_the_encoder():
    obj = _objective(rpe=True, adversary="rpe_coord")
    for t in obj.adversaries.tensors.values():
        t.data.fill_(0.3)
    state = obj.state_dict()
    fresh = _objective(rpe=True, adversary="rpe_coord", seed=1)
    fresh.load_state_dict(state)
    assert all(torch.all(t == 0.3) for t in fresh.adversaries.tensors.values())
    assert not any("adv" in k for k in obj.encoder.state_dict())


def test_fgsm_perturbs_every_input_pixel_by_eps_over_std_against_the_loss():
    obj = _objective(adversary="fgsm", fgsm_eps=1e-3)
    crops = torch.randn(4, 3, 28, 28, dtype=torch.float64)
    masked = torch.zeros(4, 49, dtype=torch.bool)
    masked[:, ::2] = True
    target = obj.target(crops)
    adv = obj.fgsm(crops, masked, target)
    std = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64)[:, None, None]
    step = (adv - crops) * std / 1e-3  # (4, 3, 28, 28) in units of eps on [0, 1] pixels
    from model.objectives.patches import patchify

    per_patch = patchify(step, 4).abs()  # (4, 49, 48)
    assert torch.allclose(per_patch[~masked], torch.ones_like(per_patch[~masked]))  # visible patches: +-eps
    assert torch.all(per_patch[masked] == 0)  # masked patches are replaced by the mask token: no gradient
    from model.objectives.mae import masked_patch_loss

    clean = masked_patch_loss(obj.reconstruct(crops, masked), target, masked.double())
    attacked = masked_patch_loss(obj.reconstruct(adv, masked), target, masked.double())
    assert attacked > clean
    # the attacked loss is MIM's: the mean squared error over the masked patches only; each pixel
    # moves along the sign of that loss's gradient
    probe = crops.clone().requires_grad_()
    err = ((obj.reconstruct(probe, masked) - target) ** 2).mean(-1)  # (4, 49)
    (grad,) = torch.autograd.grad(err[masked].mean(), probe)
    assert torch.equal((adv - crops).sign(), grad.sign())


def test_bad_configs():
    with pytest.raises(ValueError, match="set maeplus.rpe true"):
        MAEPlusConfig(adversary="rpe_coord").validate()
    with pytest.raises(ValueError, match="adv_norm"):
        MAEPlusConfig(adv_norm="l1").validate()
    with pytest.raises(ValueError, match="built with rpe=False"):
        build_objective("maeplus", create_model("vit_debug_patch4"), MAEPlusConfig(rpe=True))
    with pytest.raises(ValueError, match="does not match"):
        Adversaries({"a": (2,)}, "linf", 1.0, 1.0).load_state_dict({"a": torch.zeros(3)})


def test_irpe_tables_are_shared_by_default_and_per_head_as_an_option():
    shared, per_head = _objective(rpe=True), _objective(rpe=True, irpe_shared_heads=False)
    for obj, heads in ((shared, 1), (per_head, None)):
        for block in (*obj.encoder.blocks, *obj.decoder.decoder_blocks):
            assert block.attn.rpe.table.shape[1] == (heads or block.attn.num_heads)
    n = lambda o: sum(p.numel() for name, p in o.named_parameters() if name.endswith("rpe.table"))
    # vit_debug_patch4: 2 encoder blocks of 2 heads x 16; the decoder: 1 block of 2 heads x 16
    assert n(per_head) == 3 * 50 * 2 * 16 and n(shared) == 3 * 50 * 16
    assert _objective(rpe=True, adversary="rpe_embed").adversaries.tensors["rpe_enc0"].shape == (50, 1, 16)


@pytest.mark.parametrize("layer_decay", [1.0, 0.65])  # the split into decayed or not is the same under layer decay
@pytest.mark.parametrize("decay_tokens", [False, True])
def test_weight_decay_of_tokens_and_irpe_tables_follows_decay_tokens(decay_tokens, layer_decay):
    from train.engine.optim import build_param_groups

    obj = _objective(rpe=True, decay_tokens=decay_tokens)
    groups, summary = build_param_groups(obj, weight_decay=0.05, layer_decay=layer_decay)
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {n for n, p in obj.named_parameters() if id(p) in decayed}
    tokens = {"encoder.cls_token", "mask_token"} | {n for n, _ in obj.named_parameters() if n.endswith("rpe.table")}
    assert len(tokens) == 5  # cls, mask token, 3 tables
    assert (tokens <= names) if decay_tokens else not (tokens & names)
    assert "decoder.mask_token" not in {n for n, p in obj.named_parameters() if p.requires_grad}  # unused: frozen
    assert {"encoder.blocks.0.attn.qkv.weight", "decoder.decoder_pred.weight"} <= names  # matrices decay either way


def test_ape_replace_mode_puts_the_adversary_where_add_mode_puts_mask_token_plus_perturbation():
    """Both modes share every weight; at masked positions the encoder input is mask_token + pos + a
    (add) or a + pos (replace, the official code); visible tokens are identical."""
    images = torch.randn(2, 3, 28, 28, dtype=torch.float64)
    objs = {m: _objective(adversary="ape_embed", ape_mode=m) for m in ("add", "replace")}
    a = torch.randn(32, dtype=torch.float64) * 0.1
    seen = {}
    for mode, obj in objs.items():
        obj.adversaries.tensors["ape"] = a.clone().requires_grad_()
        orig = obj.encoder.forward_tokens
        obj.encoder.forward_tokens = lambda x, orig=orig, mode=mode, **kw: (seen.setdefault(mode, x), orig(x, **kw))[1]
        torch.manual_seed(5)
        obj({"image": images})
    torch.manual_seed(5)
    from model.objectives.masking import random_masking
    masked = random_masking(2, 49, 0.75, images.device).mask.bool()
    add, rep = seen["add"][:, 1:], seen["replace"][:, 1:]  # drop cls
    pos = objs["add"].encoder.pos_embed[:, 1:]
    torch.testing.assert_close(rep[masked], (a + pos.expand(2, -1, -1))[masked])
    torch.testing.assert_close(add[masked], (objs["add"].mask_token[0] + a + pos.expand(2, -1, -1))[masked])
    assert torch.equal(add[~masked], rep[~masked])
    assert not objs["replace"].mask_token.requires_grad and objs["add"].mask_token.requires_grad


def test_ape_coord_places_masked_tokens_at_their_shifted_grid_positions():
    """The sin-cos embedding at a coordinate shifted by a whole patch is the fixed table's entry of
    the neighbouring patch: a zero shift gives the table itself, (1, 0) the next row's entries and
    (0, 1) the next column's. (The test above saw only that masked positions change, which
    transposed or doubled coordinates pass too.)"""
    obj = _objective(adversary="ape_coord")
    masked = torch.ones(1, 49, dtype=torch.bool)
    table = obj.encoder.pos_embed[0, 1:].double().reshape(7, 7, -1)  # (row, col, D)
    for shift, rows, cols in (((0.0, 0.0), slice(0, 7), slice(0, 7)), ((1.0, 0.0), slice(1, 7), slice(0, 7)),
                              ((0.0, 1.0), slice(0, 7), slice(1, 7)), ((-2.0, 3.0), slice(0, 5), slice(3, 7))):
        obj.adversaries.tensors["ape"] = torch.tensor(shift)
        pos = obj.positions(masked, torch.float64)[0].reshape(7, 7, -1)
        shifted = table[rows, cols]  # where each token lands, for the tokens whose target is on the grid
        source = pos[slice(rows.start - int(shift[0]), rows.stop - int(shift[0])),
                     slice(cols.start - int(shift[1]), cols.stop - int(shift[1]))]
        torch.testing.assert_close(source, shifted, atol=1e-6, rtol=0)


def test_loss_is_the_mse_averaged_over_masked_patches_only():
    # the encoder sees every token, visible ones unmasked: their (easy) errors must not dilute the loss
    obj = _objective()
    images = torch.randn(2, 2, 3, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    crops = images.flatten(0, 1)
    from model.objectives.masking import random_masking
    from model.objectives.patches import normalized_pixels, patchify

    torch.manual_seed(5)
    mask = random_masking(4, 49, 0.75, crops.device).mask.double()  # what the forward below draws
    err = ((obj.reconstruct(crops, mask.bool()) - normalized_pixels(patchify(crops, 4))) ** 2).mean(-1)  # (4, 49)
    want = (err * mask).sum() / mask.sum()
    assert _loss(obj, images).item() == pytest.approx(want.item(), rel=1e-10)
    assert abs(err.mean().item() - want.item()) > 1e-3  # averaging every patch would differ
