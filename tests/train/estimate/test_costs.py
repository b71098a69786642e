"""FLOPs and activation memory from the objective's token counts (train/estimate/costs.py), against a hand
count and against the tensors autograd really keeps."""
import pytest
import torch

from model.objectives import build_objective
from model.objectives.mae import MAEConfig
from model.objectives.maeplus import MAEPlusConfig
from model.registry import create_model
from train.estimate.costs import DOUBLE_BACKWARD_FACTOR, profile


def debug_mae():
    return build_objective("mae", create_model("vit_debug_patch4", in_chans=1),
                           MAEConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2))


def test_flops_of_the_debug_mae_match_a_hand_count():
    B, D, N, p = 4, 32, 49, 4
    enc, dec = 1 + 49 // 4, 1 + N  # cls + floor(49 x 0.25) visible tokens; cls + every patch
    block = lambda T: 2 * T * (3 * D * D + D * D + 4 * D * D + 4 * D * D) + 4 * T * T * D  # noqa: E731 linears + QK^T, PV
    per_image = (2 * N * D * p * p  # patch embedding
                 + 2 * block(enc)  # 2 encoder blocks
                 + 2 * (enc) * D * D  # decoder_embed
                 + block(dec)  # 1 decoder block of width 32
                 + 2 * dec * D * p * p)  # decoder_pred (every token, cls dropped afterwards)
    with torch.device("meta"):
        prof = profile(debug_mae(), {"image": torch.zeros(B, 1, 28, 28)})
    assert prof.forward_flops == B * per_image
    assert prof.train_flops == 3 * B * per_image
    assert prof.tokens(32) == B * (2 * enc + dec)
    assert [(c.batch, c.tokens) for c in prof.blocks] == [(B, enc), (B, enc), (B, dec)]
    # each call knows its block and the FLOPs inside it (what train/estimate/scaling.py spreads over FSDP units)
    assert [c.module for c in prof.blocks] == ["encoder.blocks.0", "encoder.blocks.1", "decoder.decoder_blocks.0"]
    assert [c.forward_flops for c in prof.blocks] == [B * block(enc), B * block(enc), B * block(dec)]


def saved_bytes(objective, batch) -> int:
    """Bytes of the non-parameter tensors autograd keeps for backward (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in objective.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        objective(batch)
    return sum(kept.values())


@pytest.mark.parametrize("name", ["mae", "maeplus"])
def test_activation_estimate_matches_what_autograd_keeps(name):
    """fp32 on CPU: SDPA keeps no T x T matrix here either, as flash kernels do on GPUs."""
    def build():
        if name == "mae":
            return build_objective("mae", create_model("vit_small_patch16", img_size=64), MAEConfig())
        return build_objective("maeplus", create_model("vit_small_patch16", img_size=32), MAEPlusConfig())

    shape = (4, 3, 64, 64) if name == "mae" else (4, 4, 3, 32, 32)
    with torch.device("meta"):
        estimate = profile(build(), {"image": torch.zeros(shape)}, value_bytes=4).activation_bytes(4)
    torch.manual_seed(0)
    measured = saved_bytes(build(), {"image": torch.randn(shape)})
    assert measured == pytest.approx(estimate, rel=0.1)


def kept_matrix_bytes(attn, x, mask=None) -> int:
    """Bytes of the (.., T, T) tensors autograd keeps from one attention call, buffers (the rpe's
    bucket ids, shared by every call) left out."""
    T = x.shape[1]
    buffers = {b.untyped_storage().data_ptr() for b in attn.buffers()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if t.shape[-2:] == (T, T) and storage.data_ptr() not in buffers:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(x, mask)
    return sum(kept.values())


@pytest.mark.parametrize("backend,mask,rpe", [("math", None, False), ("math", None, True), ("sdpa", None, False),
                                              ("sdpa", "topk", False)])
def test_the_attention_matrices_kept_per_element_are_what_autograd_keeps(backend, mask, rpe):
    """Per (batch x head x T x T) element, fp32 on CPU (no fused kernels): the math backend keeps
    fp32 probabilities (4), the relative-position bias adds its value (4), SDPA's flash kernel keeps
    none, TopK without the fused kernels the reference's probabilities and boolean keep-mask (5).
    (SDPA with a bias that needs a gradient falls back to math on CPU, unlike GPU kernels: not here.)"""
    from kernels.masked import TopKMask
    from model.vit import Attention
    from train.estimate.costs import _kept_matrix_bytes

    B, T, D, H = 2, 50, 32, 2
    torch.manual_seed(0)
    attn = Attention(D, H, backend=backend, rpe_grid=(7, 7) if rpe else None)
    m = TopKMask(10) if mask == "topk" else None
    measured = kept_matrix_bytes(attn, torch.randn(B, T, D, requires_grad=True), m)
    assert _kept_matrix_bytes(attn, m, rpe, False, 4) * B * H * T * T == measured


def test_a_segment_mask_is_kept_once_for_all_heads():
    """MixedAE's segment mask without the fused kernels: SDPA gets one (B, 1, T, T) boolean mask
    shared by the heads and keeps it as an additive mask of q's dtype, so per (batch x head)
    element the estimate counts a value's bytes over the heads; with the fused kernels (as TopK's)
    no T x T matrix is kept."""
    from kernels.masked import GLOBAL, SegmentMask, TopKMask
    from model.vit import Attention
    from train.estimate.costs import _kept_matrix_bytes

    B, T, D, H = 2, 50, 32, 8
    torch.manual_seed(0)
    attn = Attention(D, H)
    segments = torch.randint(0, 2, (B, T))
    segments[:, 0] = GLOBAL
    mask = SegmentMask(segments)
    measured = kept_matrix_bytes(attn, torch.randn(B, T, D, requires_grad=True), mask)  # the (B, 1, T, T) mask
    estimate = _kept_matrix_bytes(attn, mask, False, False, 4) * B * H * T * T
    assert estimate == measured == 4 * B * T * T
    assert _kept_matrix_bytes(attn, mask, False, True, 4) == _kept_matrix_bytes(attn, TopKMask(10), False, True, 4) == 0


def test_energy_double_backward_factor_matches_what_autograd_keeps():
    from model.objectives.energy import EnergyConfig

    def build():
        encoder = create_model("vit_small_patch16", img_size=64, attn_backend="math")
        return build_objective("energy", encoder, EnergyConfig(grid_cell=16, sr_scale=4))

    with torch.device("meta"):
        prof = profile(build(), {"image": torch.zeros(2, 3, 64, 64)}, value_bytes=4)
    torch.manual_seed(0)
    measured = saved_bytes(build(), {"image": torch.randn(2, 3, 64, 64)})
    assert prof.double_backward
    assert measured == pytest.approx(prof.activation_bytes(4), rel=0.2)
    assert measured > 1.5 * prof.activation_bytes(4) / DOUBLE_BACKWARD_FACTOR  # the backward graph is really kept


def test_checkpointed_blocks_keep_only_their_input():
    with torch.device("meta"):
        plain = profile(debug_mae(), {"image": torch.zeros(4, 1, 28, 28)})
        objective = debug_mae()
        objective.encoder.set_grad_checkpointing()
        objective.decoder.set_grad_checkpointing()
        ckpt = profile(objective, {"image": torch.zeros(4, 1, 28, 28)})
    assert ckpt.forward_flops == plain.forward_flops
    assert all(c.checkpointed for c in ckpt.blocks) and not any(c.checkpointed for c in plain.blocks)
    inputs = sum(2 * c.batch * c.tokens * c.dim for c in ckpt.blocks)
    one_block = max(2 * c.batch * c.tokens * (8 * c.dim + 2 * c.hidden) for c in ckpt.blocks)
    others = 2 * plain.other_values
    assert ckpt.activation_bytes(2) == pytest.approx(inputs + one_block + others)
