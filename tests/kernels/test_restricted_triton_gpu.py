"""The fused Triton kernels compiled on a GPU (fp16/bf16/fp32, the preset shapes and the declared
limits) against the fp32 PyTorch references; skipped without CUDA. (Kept
apart from the interpreter tests, which set TRITON_INTERPRET while they run.)"""
import pytest
import torch

from kernels.masked import (
    GLOBAL,
    TopKMask,
    segment_attention_reference,
    topk_attention_reference,
)


def _inputs(B, H, T, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(B, H, T, d, generator=g).to("cuda", dtype).requires_grad_() for _ in range(3)]
    segments = torch.randint(0, 4, (B, T), generator=g)
    segments[:, 0] = GLOBAL
    return qkv, segments.cuda()


def _grads(out, inputs, seed=1):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return torch.autograd.grad((out.float() * weight.float()).sum(), inputs)


def _close(a, b, atol) -> bool:
    return torch.allclose(a.float(), b.float(), atol=atol, rtol=0)


def _needs_fused_kernels(q):
    from kernels.attention import _fused_reason

    if (reason := _fused_reason(q)) is not None:
        pytest.skip(f"the fused kernels do not run here: {reason}")


def _exact_dot_qk(q, k):
    """q, k rounded to multiples of 1/4 in [-1, 1]: every product is a multiple of 1/16 and every
    sum over the head dim is exact in fp32, so the kernel's and the reference's logits are equal
    bit for bit whatever their summation order, and so are their TopK kept sets. (With random
    inputs a logit within fp32 rounding of its row's threshold flips in or out: at 1,024 tokens,
    head dim 128, fp16, seen on an H100 as an output error above 5e-3 in one of 8,192 rows.)"""
    with torch.no_grad():
        return [(t.float() * 4).round().clamp(-4, 4).div(4).to(t.dtype).requires_grad_() for t in (q, k)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T, d", [(197, 64), (257, 80), (577, 64), (1024, 128)])
def test_compiled_kernels_match_reference_on_gpu(dtype, T, d):
    from kernels import attention
    from kernels.restricted_triton import segment_attention

    (q, k, v), segments = _inputs(2, 4, T, d, dtype)
    _needs_fused_kernels(q)
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}[dtype]
    # Segment mode (no threshold): random inputs, the fused kernel called directly (the dispatch
    # sends segment masks to SDPA, which measured faster).
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = segment_attention(q, k, v, segments)
    ref = segment_attention_reference(qr, kr, vr, segments)
    assert _close(out, ref, tol)
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (qr, kr, vr))):
        assert _close(a, b, 5 * tol)
    # TopK mode through the dispatch, on logits both sides compute exactly.
    q, k = _exact_dot_qk(q, k)
    qr, kr = (t.detach().float().requires_grad_() for t in (q, k))
    mask = TopKMask(round(0.25 * (T - 1)), segments=segments)
    out = attention(q, k, v, mask=mask)
    ref_mask = TopKMask(mask.k, segments=segments)
    ref = topk_attention_reference(qr, kr, vr, ref_mask)
    assert _close(out, ref, tol)
    assert mask.same_source_share.item() == pytest.approx(ref_mask.same_source_share.item(), abs=1e-6)
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (qr, kr, vr))):
        assert _close(a, b, 5 * tol)


@pytest.mark.gpu
def test_compiled_gradients_are_deterministic():
    # The FlashAttention-2 split writes each gradient element from one program: no atomics.
    (q, k, v), segments = _inputs(4, 4, 197, 64, torch.bfloat16)
    _needs_fused_kernels(q)
    from kernels.restricted_triton import topk_attention

    ks = torch.full((4, 197), 49, device="cuda")
    runs = [_grads(topk_attention(q, k, v, ks, 1, segments)[0], (q, k, v)) for _ in range(3)]
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T, d", [(197, 64), (257, 80)])
def test_masked_sdpa_path_keeps_the_references_set_and_matches_it_on_gpu(dtype, T, d):
    """TopK through the threshold kernel's mask and SDPA: the mask is the reference's kept set
    exactly (exact logits), and output, gradients and same-source share match the reference's."""
    from kernels.masked import _logits, topk_allowed
    from kernels.restricted_triton import topk_attention_masked_sdpa, topk_mask

    (q, k, v), segments = _inputs(2, 4, T, d, dtype, seed=3)
    _needs_fused_kernels(q)
    q, k = _exact_dot_qk(q, k)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ks = torch.full((2, T), round(0.25 * (T - 1)), device="cuda")
    mask, _ = topk_mask(q, k, ks, 1, segments)
    assert torch.equal(mask, topk_allowed(_logits(qr, kr), ks, 1))
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    out, share = topk_attention_masked_sdpa(q, k, v, ks, 1, segments)
    ref_mask = TopKMask(ks, segments=segments)
    ref = topk_attention_reference(qr, kr, vr, ref_mask)
    assert _close(out, ref, tol) and share.item() == pytest.approx(ref_mask.same_source_share.item(), abs=1e-6)
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (qr, kr, vr))):
        assert _close(a, b, 5 * tol)
