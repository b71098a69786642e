import math

import pytest
import torch

from model.irpe import (
    axis_size,
    bilinear_corners,
    bucket_ids,
    grid_coords,
    num_buckets,
    piecewise_index,
    relaxed_index,
)


def _far(x):  # alpha + ln(|x|/alpha) / ln(gamma/alpha) * (beta - alpha) with the defaults
    return 1.9 + math.log(abs(x) / 1.9) / math.log(15.2 / 1.9) * 1.9


@pytest.mark.parametrize("x, want", [
    (0.0, 0), (1.4, 1), (-1.6, -2), (1.9, 2), (-1.9, -2),  # |x| <= alpha: round(x)
    (3.0, 2), (8.0, 3), (-8.0, -3),  # log zone: round(far(x)) = round(2.317) / round(3.214)
    (15.2, 3), (100.0, 3), (-100.0, -3),  # far(x) >= 3.5 rounds to 4, clipped at beta 3.8, truncated to 3
])
def test_piecewise_index_hand_values(x, want):
    assert piecewise_index(torch.tensor([x])).item() == want


@pytest.mark.parametrize("x, want", [
    (0.7, 0.7), (-1.9, -1.9), (3.0, _far(3.0)), (-8.0, -_far(8.0)), (15.2, 3.8), (100.0, 3.8), (-100.0, -3.8),
])
def test_relaxed_index_hand_values(x, want):
    assert relaxed_index(torch.tensor([x], dtype=torch.float64)).item() == pytest.approx(want, abs=1e-12)
    assert _far(3.0) == pytest.approx(2.3174, abs=1e-4)


def test_bucket_ids_count_and_cls_bucket():
    assert axis_size() == 7 and num_buckets() == 50
    ids = bucket_ids(grid_coords((7, 7)))
    assert ids.shape == (50, 50)
    assert torch.all(ids[0] == 49) and torch.all(ids[:, 0] == 49)
    assert torch.all(ids[1:, 1:].diagonal() == 3 * 7 + 3)  # offset (0, 0) is the centre bucket
    assert ids[1:, 1:].max() == 48 and ids[1:, 1:].min() == 0
    # query (0, 0) vs key (0, 1): offset (0, -1) -> row bucket 3, column bucket 2
    assert ids[1, 2] == 3 * 7 + 2


def test_bilinear_lookup_at_integer_indices_is_the_table_row():
    table = torch.randn(49, 5, dtype=torch.float64)
    rel = torch.tensor([[0.0, 0.0], [1.0, -1.0], [-1.0, 0.0], [100.0, -100.0], [0.0, 100.0]], dtype=torch.float64)
    corners, weights = bilinear_corners(rel)
    looked_up = (table[corners] * weights[..., None]).sum(-2)
    rows = (piecewise_index(rel) + 3)
    want = table[rows[:, 0] * 7 + rows[:, 1]]
    assert torch.allclose(looked_up, want, atol=1e-12)


def test_bilinear_weights_are_differentiable_in_the_offset():
    table = torch.randn(49, 3, dtype=torch.float64)
    delta = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    rel = torch.tensor([[2.0, -5.0], [0.5, 1.2]], dtype=torch.float64) + delta
    corners, weights = bilinear_corners(rel)
    assert torch.allclose(weights.sum(-1), torch.ones(2, dtype=torch.float64))
    value = (table[corners] * weights[..., None]).sum()
    (grad,) = torch.autograd.grad(value, delta)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_bias_hooks_reach_each_blocks_relative_position_bias():
    """forward_tokens passes each block's hook to its iRPE bias, with the module, q, the per-bucket
    scores and the bias; what the hook returns is the bias used. Without rpe a hook is refused."""
    from model.registry import create_model

    torch.manual_seed(0)
    enc = create_model("vit_debug_patch4", in_chans=1, rpe=True).eval()
    for block in enc.blocks:
        torch.nn.init.normal_(block.attn.rpe.table, std=0.5)
    x = enc.add_cls_token(enc.embed_patches(torch.randn(2, 1, 28, 28)))  # (B, T, D), T = 50
    seen = []

    def identity(rpe, q, scores, bias):
        seen.append((rpe, q.shape, scores.shape, bias.shape))
        return bias

    def no_positions(rpe, q, scores, bias):
        return torch.zeros_like(bias)

    heads, d = enc.blocks[0].attn.num_heads, enc.embed_dim // enc.blocks[0].attn.num_heads
    plain = enc.forward_tokens(x)
    assert torch.equal(enc.forward_tokens(x, bias_hooks=[identity] * len(enc.blocks)), plain)
    assert [s[0] for s in seen] == [b.attn.rpe for b in enc.blocks]
    assert seen[0][1:] == ((2, heads, 50, d), (2, heads, 50, num_buckets()), (2, heads, 50, 50))
    hooked = enc.forward_tokens(x, bias_hooks=[None] * (len(enc.blocks) - 1) + [no_positions])
    assert not torch.allclose(hooked, plain)
    with pytest.raises(ValueError, match="entries for"):
        enc.forward_tokens(x, bias_hooks=[identity])
    with pytest.raises(ValueError, match="rpe=True"):
        create_model("vit_debug_patch4", in_chans=1).forward_tokens(x, bias_hooks=[identity] * len(enc.blocks))


def test_per_block_lists_of_another_length_than_the_blocks_are_refused():
    """attn_masks and bias_hooks give one entry per block: a list longer or shorter than the
    encoder is deep is an error, not silently truncated."""
    from model.registry import create_model

    torch.manual_seed(0)
    enc = create_model("vit_debug_patch4", in_chans=1, rpe=True).eval()
    depth = len(enc.blocks)
    x = enc.add_cls_token(enc.embed_patches(torch.randn(2, 1, 28, 28)))
    for n in (depth - 1, depth + 1, depth + 3):
        with pytest.raises(ValueError, match=f"attn_masks has {n} entries for {depth} blocks"):
            enc.forward_tokens(x, attn_masks=[None] * n)
        with pytest.raises(ValueError, match=f"bias_hooks has {n} entries for {depth} blocks"):
            enc.forward_tokens(x, bias_hooks=[None] * n)
    assert enc.forward_tokens(x, attn_masks=[None] * depth, bias_hooks=[None] * depth).shape == x.shape


def test_decoder_bias_hooks_of_another_length_than_its_blocks_are_refused():
    """The MAE decoder takes one bias hook per decoder block, as the encoder does."""
    from model.mae_decoder import MAEDecoder

    torch.manual_seed(0)
    dec = MAEDecoder((7, 7), patch_size=4, in_chans=1, encoder_dim=32, decoder_dim=16, depth=2, num_heads=2,
                     rpe=True).eval()
    x = torch.randn(2, 50, 16)  # (B, 1 + 7*7, Dd)
    for n in (1, 3, 5):
        with pytest.raises(ValueError, match=f"bias_hooks has {n} entries for 2 blocks"):
            dec.decode(x, bias_hooks=[None] * n)
    assert torch.equal(dec.decode(x, bias_hooks=[None, None]), dec.decode(x))
