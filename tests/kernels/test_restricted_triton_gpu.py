"""The fused Triton kernels compiled on a GPU (fp16/bf16) against the fp32 PyTorch references,
through the dispatch; skipped without CUDA. (Kept apart from the interpreter tests, which set
TRITON_INTERPRET while they run.)"""
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T", [197, 257])
def test_compiled_kernels_match_reference_on_gpu(dtype, T):
    from kernels import SegmentMask, attention
    from kernels.accelerators import has_triton_gpu

    if not has_triton_gpu():
        pytest.skip("needs Triton on an sm80+ GPU")
    (q, k, v), segments = _inputs(4, 4, T, 64, dtype)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    mask = TopKMask(round(0.25 * (T - 1)), segments=segments)
    out = attention(q, k, v, mask=mask)
    ref_mask = TopKMask(mask.k, segments=segments)
    ref = topk_attention_reference(qr, kr, vr, ref_mask)
    assert _close(out, ref, tol)
    assert mask.same_source_share.item() == pytest.approx(ref_mask.same_source_share.item(), abs=0.01)
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (qr, kr, vr))):
        assert _close(a, b, 5 * tol)
    out = attention(q, k, v, mask=SegmentMask(segments))
    ref = segment_attention_reference(qr, kr, vr, segments)
    assert _close(out, ref, tol)
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (qr, kr, vr))):
        assert _close(a, b, 5 * tol)
