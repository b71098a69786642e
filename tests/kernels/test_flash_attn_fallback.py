"""Backend flash_attn hands flash-attn only what it takes (fp16/bf16, head dim <= 256, sm80+ GPU)
and SDPA the rest, wherever the inputs come from: MLO-MAE's level III runs fp32 inside a bf16 run.
The package and the GPU are faked (tests/fake_gpu.py): its flash_attn_func refuses fp32 like the
real one and records every call."""
import importlib
import sys

import pytest
import torch
from fake_gpu import fake_flash_attn, fake_gpu

from kernels import accelerators, attention, math_attention
from kernels.attention import flash_attn_refusal, resolve_backend
from model.objectives.mlomae import MLOMAEConfig, MLOMAEObjective
from model.registry import create_model


def _qkv(dtype, d=16, B=2, H=2, N=5):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, N, d, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _on_gpu(monkeypatch, capability):
    """CPU tensors stand for tensors on a GPU of this compute capability."""
    module = importlib.import_module("kernels.attention")  # `kernels.attention` is also the function's name
    monkeypatch.setattr(module, "_gpu_capability", lambda t: capability, raising=False)


@pytest.mark.parametrize("dtype,d,capability,to_flash_attn", [
    (torch.bfloat16, 16, (8, 0), True),
    (torch.float16, 16, (9, 0), True),
    (torch.float16, 20, (8, 6), True),  # flash-attn pads head dims that are not multiples of 8 itself
    (torch.bfloat16, 256, (8, 0), True),
    (torch.float32, 16, (8, 0), False),  # MLO-MAE level III, any fp32 part of a run
    (torch.float64, 16, (9, 0), False),
    (torch.bfloat16, 264, (8, 0), False),  # head dim > 256
    (torch.float16, 16, (7, 0), False),  # V100
    (torch.bfloat16, 16, None, False),  # not on a GPU
])
def test_flash_attn_gets_only_inputs_it_takes(monkeypatch, dtype, d, capability, to_flash_attn):
    calls = fake_flash_attn(monkeypatch)
    _on_gpu(monkeypatch, capability)
    q, k, v = _qkv(dtype, d)
    out = attention(q, k, v, backend="flash_attn")
    out.float().sum().backward()  # the fallback is differentiable as well
    assert calls == ([dtype] if to_flash_attn else [])
    assert (flash_attn_refusal(q, k, v) is None) == to_flash_attn
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    assert out.dtype == dtype and torch.allclose(out.float(), math_attention(q, k, v).float(), atol=tol)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_a_value_head_dim_over_256_goes_to_sdpa(monkeypatch):
    """flash-attn takes head dims up to 256 for the values as for the queries (mha_fwd checks both)."""
    calls = fake_flash_attn(monkeypatch)
    _on_gpu(monkeypatch, (8, 0))
    q, k, _ = _qkv(torch.bfloat16, d=64)
    v = torch.randn(2, 2, 5, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert flash_attn_refusal(q, k, v) == "head dim 512 > 256"
    out = attention(q, k, v, backend="flash_attn")
    assert calls == [] and out.shape == (2, 2, 5, 512)
    assert torch.allclose(out.float(), math_attention(q, k, v).float(), atol=2e-2)


def test_mixed_dtypes_are_refused_by_name():
    q, k, v = _qkv(torch.bfloat16)
    assert "flash-attn takes fp16 or bf16" in flash_attn_refusal(q, k.float(), v)
    said = flash_attn_refusal(q, k, v.float())  # v alone in fp32: refused as well, the dtypes named
    assert "torch.bfloat16/torch.bfloat16/torch.float32" in said and "flash-attn takes fp16 or bf16" in said


def test_mlomae_bf16_run_with_flash_attn_survives_its_fp32_level3(monkeypatch):
    """A bf16 MLO-MAE objective on an A100 (faked) with attn_backend flash_attn: levels I/II call
    flash-attn in bf16, level III's fp32 hypergradient goes to SDPA instead of crashing."""
    calls = fake_flash_attn(monkeypatch)
    _on_gpu(monkeypatch, (8, 0))
    torch.manual_seed(0)
    cfg = MLOMAEConfig(decoder_dim=16, decoder_depth=1, decoder_heads=2, mask_hidden=8, num_classes=3, mask_ratio=0.5)
    with fake_gpu("a100"):  # resolve_backend accepts flash_attn on an sm80 GPU with the package
        encoder = create_model("vit_debug_patch4", img_size=8, in_chans=1, attn_backend="flash_attn")
        obj = MLOMAEObjective(encoder, cfg)
    obj.bfloat16()  # what DeepSpeed's bf16 engine does; the head and masking network stay fp32 (obj.aux)
    g = torch.Generator().manual_seed(0)
    batch = {"image": torch.randn(4, 1, 8, 8, generator=g), "label": torch.randint(0, 3, (4,), generator=g),
             "val_image": torch.randn(4, 1, 8, 8, generator=g), "val_label": torch.randint(0, 3, (4,), generator=g)}
    batch = {k: v.bfloat16() if v.is_floating_point() else v for k, v in batch.items()}
    obj(batch)["loss"].float().backward()
    assert calls and set(calls) == {torch.bfloat16}
    calls.clear()
    stats = obj.after_optimizer_step(lr=1e-2, batches=[batch])  # levels II and III
    assert all(torch.isfinite(stats[key]) for key in ("level2_loss", "level3_loss", "hypergrad_norm"))
    assert stats["hypergrad_norm"] > 0
    assert torch.float32 not in calls  # level III's fp32 calls went to SDPA


def test_flash_attn_4_alone_is_not_taken_for_flash_attn_2(monkeypatch, tmp_path):
    """flash-attn-4 installs only flash_attn/cute, so `import flash_attn` succeeds (an empty namespace
    package) without flash-attn 2's flash_attn_func: the backend is refused at start, naming that,
    instead of failing at the first attention call."""
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("def flash_attn_func(*args, **kwargs): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    for gpu in ("a100", "h100"):  # sm80 and sm90 both run flash-attn 2: the refusal names the package
        with fake_gpu(gpu):
            assert importlib.import_module("flash_attn").__file__ is None  # a namespace package: it imports
            assert not accelerators.has_flash_attn()
            with pytest.raises(ValueError, match="flash-attn-4 installs only flash_attn.cute"):
                resolve_backend("flash_attn")
    fake_flash_attn(monkeypatch)  # flash-attn 2's module: taken
    with fake_gpu("a100"):
        assert accelerators.has_flash_attn() and resolve_backend("flash_attn") == "flash_attn"
