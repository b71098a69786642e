import pytest
import torch

from kernels import BACKENDS, attention, math_attention, resolve_backend
from kernels.accelerators import has_flash_attn


def _qkv(dtype=torch.float64, B=2, H=3, N=5, d=8, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, N, d, generator=g, dtype=dtype).to(device).requires_grad_() for _ in range(3)]


def test_math_reference_hand_computed():
    # One query, two keys: logits q.k/sqrt(d) = [1, 0] -> weights [e/(1+e), 1/(1+e)]
    q = torch.tensor([[[[2.0, 0.0, 0.0, 0.0]]]])
    k = torch.tensor([[[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]]])
    v = torch.tensor([[[[1.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]]]])
    e = torch.e
    want = torch.tensor([e / (1 + e), 3 / (1 + e), 0.0, 0.0])
    assert torch.allclose(math_attention(q, k, v)[0, 0, 0], want)


def test_sdpa_matches_reference_forward_and_backward():
    q, k, v = _qkv()
    ref = math_attention(q, k, v)
    gref = torch.autograd.grad(ref.sum(), (q, k, v))
    out = attention(q, k, v, backend="sdpa")
    gout = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.allclose(out, ref, atol=1e-10)
    for a, b in zip(gout, gref):
        assert torch.allclose(a, b, atol=1e-10)


def test_math_path_is_twice_differentiable():
    q, k, v = _qkv(N=3, d=4)
    assert torch.autograd.gradgradcheck(math_attention, (q, k, v))


def test_resolve_backend():
    assert resolve_backend("auto") == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("flashy")
    if not has_flash_attn():
        with pytest.raises(ValueError, match="flash-attn package"):
            resolve_backend("flash_attn")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "math"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_backends_match_reference(backend, dtype):
    if backend == "flash_attn" and not has_flash_attn():
        pytest.skip("flash-attn not installed or GPU older than sm80")
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    q, k, v = _qkv(dtype=dtype, B=2, H=4, N=197, d=64, device="cuda")
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = math_attention(q32, k32, v32)
    out = attention(q, k, v, backend=backend)
    assert torch.allclose(out.float(), ref, atol=2e-2)
    grad_out = torch.randn_like(out)  # the backward too: the training step runs it
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)


def test_score_bias_sdpa_matches_reference_and_reaches_the_bias_gradient():
    q, k, v = _qkv()
    bias = torch.randn(2, 3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    ref = attention(q, k, v, backend="math", bias=bias)
    logits = q @ k.transpose(-2, -1) / 8**0.5 + bias
    assert torch.allclose(ref, logits.softmax(-1) @ v, atol=1e-12)
    out = attention(q, k, v, backend="sdpa", bias=bias)
    assert torch.allclose(out, ref, atol=1e-10)
    ga = torch.autograd.grad(out.sum(), (q, bias))
    gb = torch.autograd.grad(ref.sum(), (q, bias))
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, atol=1e-10)
    with pytest.raises(ValueError, match="cannot be combined"):
        from kernels import TopKMask

        attention(q, k, v, mask=TopKMask(2), bias=bias)


def test_topk_on_cpu_takes_the_reference_path_without_a_warning(monkeypatch):
    """The fallback warning is for a GPU whose fused kernels are refused; on CPU the PyTorch
    reference path is the only one, and every CPU TopK run warning about it is noise."""
    import importlib
    import warnings

    from kernels import TopKMask

    dispatch = importlib.import_module("kernels.attention")  # `kernels.attention` is also the function's name
    monkeypatch.setattr(dispatch, "_FALLBACKS_WARNED", set())  # nothing warned before this test
    q, k, v = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = attention(q, k, v, mask=TopKMask(2))
    assert out.shape == q.shape


def test_math_reference_in_bf16_computes_in_fp32_and_rounds_once():
    """bf16 inputs at a ViT-B head (197 tokens of 64): fp32 logits, softmax and sum, then one
    rounding to bf16, so each output is within bf16's unit roundoff (2^-8) of the exact result of
    the same inputs; bf16 logits and weights would be off by several units."""
    q, k, v = (t.detach() for t in _qkv(torch.bfloat16, B=1, H=2, N=197, d=64))
    out = math_attention(q, k, v)
    want = math_attention(q.double(), k.double(), v.double())
    assert out.dtype == torch.bfloat16
    assert ((out.double() - want).abs() <= 2**-8 * want.abs() + 1e-6).all()
