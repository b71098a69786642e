import pytest
import torch

from kernels import GLOBAL, SegmentMask, TopKMask, attention, math_attention
from kernels.masked import (
    same_source_share,
    segment_attention_reference,
    topk_attention_reference,
)


def _qkv(B=2, H=2, T=7, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3)]


def brute_force_topk(q, k, v, ks, num_global):
    """Row by row: keep logits >= the row's K-th largest (all of them for global rows), softmax, sum."""
    B, H, T, d = q.shape
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                row = torch.stack([q[b, h, i] @ k[b, h, j] for j in range(T)]) / d**0.5
                if i >= num_global:
                    kth = sorted(row.tolist(), reverse=True)[min(int(ks[b][i]), T) - 1]
                    keep = [j for j in range(T) if row[j].item() >= kth]
                else:
                    keep = list(range(T))
                w = torch.softmax(row[keep], dim=0)
                out[b, h, i] = sum(w[n] * v[b, h, j] for n, j in enumerate(keep))
    return out


@pytest.mark.parametrize("per_row", [False, True])
def test_topk_matches_brute_force_loop_forward_and_backward(per_row):
    q, k, v = _qkv()
    B, T = 2, 7
    ks = torch.randint(1, T + 1, (B, T), generator=torch.Generator().manual_seed(1)) if per_row else torch.full((B, T), 3)
    mask = TopKMask(ks if per_row else 3, num_global=1)
    out = attention(q, k, v, mask=mask)
    want = brute_force_topk(q, k, v, ks.tolist(), 1)
    assert torch.allclose(out, want, atol=1e-12)
    g_out = torch.autograd.grad((out * want.detach().cos()).sum(), (q, k, v))
    g_want = torch.autograd.grad((want * want.detach().cos()).sum(), (q, k, v))
    for a, b in zip(g_out, g_want):
        assert torch.allclose(a, b, atol=1e-10)


def test_topk_keeps_every_tie_at_the_threshold_deterministically():
    # One query row whose logits are [2, 1, 1, 1, 0] (q = e_0, keys carry the logit): K = 2 keeps 2 and all three 1s.
    d = 4
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0]) * d**0.5
    k = torch.zeros(1, 1, 5, d, dtype=torch.float64)
    k[0, 0, :, 0] = logits
    q = torch.zeros(1, 1, 5, d, dtype=torch.float64)
    q[0, 0, :, 0] = 1.0
    v = torch.eye(5, d, dtype=torch.float64)[None, None] + torch.arange(5.0, dtype=torch.float64)[:, None]
    out = attention(q, k, v, mask=TopKMask(2, num_global=0))
    w = torch.softmax(torch.tensor([2.0, 1.0, 1.0, 1.0]), 0).double()
    assert torch.allclose(out[0, 0, 1], (w[:, None] * v[0, 0, :4]).sum(0))
    assert torch.equal(out, attention(q, k, v, mask=TopKMask(2, num_global=0)))


def test_topk_with_every_key_kept_is_dense_attention():
    q, k, v = _qkv()
    assert torch.allclose(attention(q, k, v, mask=TopKMask(7)), math_attention(q, k, v), atol=1e-12)


def test_topk_reference_is_twice_differentiable():
    q, k, v = _qkv(B=1, H=1, T=4, d=3)
    assert torch.autograd.gradgradcheck(lambda q, k, v: topk_attention_reference(q, k, v, TopKMask(2)), (q, k, v))


def test_same_source_share_hand_case():
    # Tokens: cls, a, a, b. Query 1 (a) keeps {cls, a, b}: 1 of 3 is own; query 2 keeps {a, a}: 2/2;
    # query 3 (b) keeps {b}: 1/1. Total 4 own of 6 kept.
    segments = torch.tensor([[GLOBAL, 0, 0, 1]])
    allowed = torch.tensor([[[[1, 1, 1, 1], [1, 1, 0, 1], [0, 1, 1, 0], [0, 0, 0, 1]]]], dtype=torch.bool)
    assert same_source_share(allowed, segments, num_global=1).item() == pytest.approx(4 / 6)


def test_topk_records_sampling_accuracy_only_with_segments():
    q, k, v = _qkv()
    segments = torch.tensor([[GLOBAL, 0, 0, 0, 1, 1, 1]] * 2)
    mask = TopKMask(3, segments=segments)
    attention(q, k, v, mask=mask)
    assert 0.0 <= mask.same_source_share.item() <= 1.0
    unrecorded = TopKMask(3)
    attention(q, k, v, mask=unrecorded)
    assert unrecorded.same_source_share is None


def test_segment_mask_sdpa_matches_reference_and_blocks_other_sources():
    q, k, v = _qkv()
    segments = torch.tensor([[GLOBAL, 0, 1, 0, 1, 1, 0], [GLOBAL, 1, 1, 0, 0, 1, 0]])
    ref = segment_attention_reference(q, k, v, segments)
    out = attention(q, k, v, backend="sdpa", mask=SegmentMask(segments))
    assert torch.allclose(out, ref, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        assert torch.allclose(a, b, atol=1e-10)
    # Changing the values of source 1 and of cls leaves every source-0 query's output unchanged.
    v2 = v.detach().clone()
    v2[segments[:, None, :, None].expand_as(v2) != 0] += 5.0
    out2 = attention(q, k, v2, backend="math", mask=SegmentMask(segments))
    own0 = (segments == 0)[:, None, :, None].expand_as(out)
    assert torch.allclose(out2[own0], ref[own0], atol=1e-12)
    assert not torch.allclose(out2[~own0], ref[~own0])


def test_unknown_mask_type_is_rejected():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="unknown attention mask"):
        attention(q, k, v, mask="topk")


def test_dispatch_reports_the_path_each_kind_of_call_takes():
    from kernels.attention import describe_paths

    cpu = describe_paths("sdpa", torch.device("cpu"), torch.float32, 197, 64)
    assert cpu["topk"] == "PyTorch reference composition (not on a GPU)"
    assert cpu["segment"].startswith("torch SDPA with a boolean mask")
    assert describe_paths("math", torch.device("cpu"), torch.float32, 197, 64)["segment"] == "math reference"


def test_segment_masked_math_attention_is_twice_differentiable():
    # Backend math is the path for double backward (energy-based pretraining), masks included.
    q, k, v = _qkv(B=1, H=1, T=4, d=3)
    mask = SegmentMask(torch.tensor([[GLOBAL, 0, 1, 0]]))
    assert torch.autograd.gradgradcheck(lambda q, k, v: attention(q, k, v, backend="math", mask=mask), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_paths_return_the_inputs_dtype_within_one_rounding_of_float64(dtype):
    q, k, v = (t.detach().to(dtype) for t in _qkv())
    segments = torch.tensor([[GLOBAL, 0, 1, 0, 1, 1, 0], [GLOBAL, 1, 1, 0, 0, 1, 0]])
    for mask in (TopKMask(3), SegmentMask(segments)):
        out = attention(q, k, v, backend="math", mask=mask)
        want = attention(q.double(), k.double(), v.double(), backend="math", mask=mask)  # the same inputs, exact
        assert out.dtype == dtype
        # fp32 inside, then one rounding of the output: relative error <= the unit roundoff (2^-8 bf16, 2^-11 fp16)
        unit = torch.finfo(dtype).eps / 2
        assert ((out.double() - want).abs() <= unit * want.abs() + 1e-6).all()


def test_topk_of_zero_keys_keeps_one_as_a_per_query_zero_does():
    # K is clamped to [1, T] whether it is one int or one value per query.
    q, k, v = _qkv()
    out = attention(q, k, v, mask=TopKMask(0))
    assert torch.equal(out, attention(q, k, v, mask=TopKMask(1)))
    assert torch.equal(out, attention(q, k, v, mask=TopKMask(torch.zeros(2, 7, dtype=torch.long))))


@pytest.fixture
def fused_topk(monkeypatch):
    """The fused TopK kernels as stand-ins (the tests run without a GPU): each call is recorded and
    returns the reference output with a same-source share of 0.75."""
    pytest.importorskip("triton")
    import importlib

    dispatch = importlib.import_module("kernels.attention")  # `kernels.attention` is also the function's name
    restricted = importlib.import_module("kernels.restricted_triton")
    ran = []

    def stand_in(name):
        def run(q, k, v, rows, num_global, segments):
            ran.append(name)
            return topk_attention_reference(q, k, v, TopKMask(rows, num_global)), torch.tensor(0.75)
        return run

    monkeypatch.setattr(dispatch, "_fused_or_warn", lambda q: True)
    for name in ("topk_attention", "topk_attention_masked_sdpa"):
        monkeypatch.setattr(restricted, name, stand_in(name))
    return ran


def test_math_backend_topk_takes_the_reference_even_where_the_fused_kernels_run(fused_topk):
    # The fused kernels have no double backward; backend math must stay on the reference.
    q, k, v = _qkv(B=1, H=1, T=4, d=3)
    math_topk = lambda q, k, v: attention(q, k, v, backend="math", mask=TopKMask(2))  # noqa: E731
    assert torch.autograd.gradgradcheck(math_topk, (q, k, v))
    assert fused_topk == []
    attention(q, k, v, backend="sdpa", mask=TopKMask(2))
    assert len(fused_topk) == 1  # the stand-ins do stand in for the fused path


def test_fused_topk_records_the_same_source_share_it_returns(fused_topk):
    q, k, v = _qkv()
    mask = TopKMask(3, segments=torch.tensor([[GLOBAL, 0, 0, 0, 1, 1, 1]] * 2))
    attention(q, k, v, mask=mask)
    assert fused_topk and mask.same_source_share.item() == 0.75
