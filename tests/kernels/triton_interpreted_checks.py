"""Checks of the fused Triton kernels against the PyTorch references in Triton's interpreter, on CPU.

Not collected directly (Triton reads TRITON_INTERPRET when it is first imported): 
test_restricted_triton.py runs this file with pytest in a fresh process that sets the flag."""
import os

import pytest
import torch

from kernels.masked import (
    GLOBAL,
    TopKMask,
    segment_attention_reference,
    topk_attention_reference,
)

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run through test_restricted_triton.py (needs TRITON_INTERPRET=1 before triton is imported)")
    import kernels.restricted_triton as module

    return module


def _inputs(B=2, H=2, T=21, d=8, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(B, H, T, d, generator=g).to(device, dtype).requires_grad_() for _ in range(3)]
    segments = torch.randint(0, 3, (B, T), generator=g)
    segments[:, 0] = GLOBAL
    return qkv, segments.to(device)


def _grads(out, inputs, seed=1):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return torch.autograd.grad((out.float() * weight.float()).sum(), inputs)


def _close(a, b, atol) -> bool:
    return torch.allclose(a.float(), b.float(), atol=atol, rtol=0)


def _assert_topk_matches_reference(interpreted, q, k, v, ks, segments, num_global, grad_atol):
    out, share = interpreted.topk_attention(q, k, v, ks, num_global, segments)
    mask = TopKMask(ks, num_global=num_global, segments=segments)
    ref = topk_attention_reference(q, k, v, mask)
    assert _close(out, ref, 1e-5)
    assert share.item() == pytest.approx(mask.same_source_share.item())
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert _close(a, b, grad_atol)


def _assert_segment_matches_reference(interpreted, q, k, v, segments, grad_atol):
    out = interpreted.segment_attention(q, k, v, segments)
    ref = segment_attention_reference(q, k, v, segments)
    assert _close(out, ref, 1e-5)
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert _close(a, b, grad_atol)


@pytest.mark.parametrize("per_row", [False, True])
def test_interpreted_topk_matches_reference(interpreted, per_row):
    (q, k, v), segments = _inputs()
    B, _, T, _ = q.shape
    ks = torch.randint(1, T + 1, (B, T), generator=torch.Generator().manual_seed(2)) if per_row else torch.full((B, T), 5)
    _assert_topk_matches_reference(interpreted, q, k, v, ks, segments, num_global=1, grad_atol=1e-5)


def test_interpreted_segment_attention_matches_reference(interpreted):
    (q, k, v), segments = _inputs(T=37, d=16)  # more than one query block, padded key row
    _assert_segment_matches_reference(interpreted, q, k, v, segments, grad_atol=1e-5)


def test_interpreted_topk_ties_keep_the_whole_tie_deterministically(interpreted):
    # Logits on a coarse grid (integers / sqrt(d) after scaling) are full of exact ties.
    B, H, T, d = 1, 2, 19, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-2, 3, (B, H, T, d), generator=g).float().requires_grad_()
    k = torch.randint(-2, 3, (B, H, T, d), generator=g).float().requires_grad_()
    v = torch.randn(B, H, T, d, generator=g).requires_grad_()
    out1, _ = interpreted.topk_attention(q, k, v, torch.full((B, T), 4), 1)
    out2, _ = interpreted.topk_attention(q, k, v, torch.full((B, T), 4), 1)
    ref = topk_attention_reference(q, k, v, TopKMask(4))
    assert torch.equal(out1, out2)
    assert _close(out1, ref, 1e-5)
    for a, b in zip(_grads(out1, (q, k, v)), _grads(ref, (q, k, v))):
        assert _close(a, b, 1e-4)


def test_interpreted_kernel_refuses_double_backward(interpreted):
    (q, k, v), _ = _inputs(T=8)
    out, _ = interpreted.topk_attention(q, k, v, torch.full((2, 8), 3), 1)
    with pytest.raises(RuntimeError, match="not twice differentiable; use model.attn_backend math"):
        torch.autograd.grad(out.sum(), (q,), create_graph=True)
    (gq,) = torch.autograd.grad(out.sum(), (q,))  # a plain backward works
    assert torch.isfinite(gq).all()


@pytest.mark.parametrize("T, d, slice_bytes", [(70, 8, None), (45, 40, 16 * 64 * 4)])
def test_interpreted_streams_key_blocks_and_head_dim_chunks(interpreted, monkeypatch, request, T, d, slice_bytes):
    # T = 70: 5 threshold blocks of 16 rows, 3 query and 3 key blocks of 32 in the other kernels.
    # d = 40 with a 4 KiB threshold slice: the logits are summed over head-dim chunks of 16 (the
    # way shapes up to 1024 tokens fit shared memory), padded from 40 to 64.
    if slice_bytes is not None:
        monkeypatch.setattr(interpreted, "THRESHOLD_SLICE_BYTES", slice_bytes)
        interpreted.plan.cache_clear()  # plans are cached per shape: none made with the other slice
        request.addfinalizer(interpreted.plan.cache_clear)
    cfg = interpreted.plan(T, d, torch.float32)
    assert cfg.forward[1] < T and cfg.dkdv[1] < T and cfg.dq[1] < T
    assert (cfg.d_chunk < cfg.block_d) == (slice_bytes is not None)
    (q, k, v), segments = _inputs(B=1, H=2, T=T, d=d, seed=5)
    ks = torch.randint(1, T + 1, (1, T), generator=torch.Generator().manual_seed(6))
    _assert_topk_matches_reference(interpreted, q, k, v, ks, segments, num_global=2, grad_atol=1e-4)
    _assert_segment_matches_reference(interpreted, q, k, v, segments, grad_atol=1e-4)


def test_interpreted_gradients_are_deterministic(interpreted):
    # The FlashAttention-2 split writes every gradient element from one program: no atomics.
    (q, k, v), segments = _inputs(T=37, d=16, seed=7)
    runs = [_grads(interpreted.topk_attention(q, k, v, torch.full((2, 37), 9), 1, segments)[0], (q, k, v))
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T, d, per_row", [(21, 8, False), (70, 8, True)])
def test_interpreted_topk_mask_is_the_references_kept_set_and_sdpa_over_it_matches(interpreted, T, d, per_row):
    """The threshold kernel writing the kept set (TopK through SDPA with that mask): the mask is the
    reference's `topk_allowed` exactly, the same-source share is the reference's, and the output and
    gradients match the reference's (T = 70: several row blocks; per-row K)."""
    from kernels.masked import _logits, topk_allowed

    (q, k, v), segments = _inputs(T=T, d=d, seed=8)
    B = q.shape[0]
    g = torch.Generator().manual_seed(9)
    ks = torch.randint(1, T + 1, (B, T), generator=g) if per_row else torch.full((B, T), 6)
    mask, share = interpreted.topk_mask(q, k, ks, 2, segments)
    assert mask.dtype == torch.bool and torch.equal(mask, topk_allowed(_logits(q, k), ks, 2))
    out, share = interpreted.topk_attention_masked_sdpa(q, k, v, ks, 2, segments)
    ref_mask = TopKMask(ks, num_global=2, segments=segments)
    ref = topk_attention_reference(q, k, v, ref_mask)
    assert _close(out, ref, 1e-5) and share.item() == pytest.approx(ref_mask.same_source_share.item())
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert _close(a, b, 1e-5)
    fused, _ = interpreted.topk_attention(q, k, v, ks, 2, segments)
    assert _close(out, fused, 1e-5)  # one kept set, two ways of attending over it
