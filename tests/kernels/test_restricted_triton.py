"""The fused Triton kernels against the PyTorch references on CPU, in Triton's interpreter.

Triton decides interpreted vs compiled when it is first imported, so the checks
(triton_interpreted_checks.py) run with pytest in a fresh process with TRITON_INTERPRET=1 and no
visible GPU. The compiled kernels are checked in test_restricted_triton_gpu.py, what they need on
sm_80 / sm_90 in test_compile_gate.py. Below: the dispatch's decision per GPU, with a faked compute
capability."""
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from kernels.attention import _fused_or_warn, _fused_reason, describe_paths  # noqa: E402
from kernels.restricted_triton import plan, supports  # noqa: E402

CHECKS = Path(__file__).with_name("triton_interpreted_checks.py")


def test_triton_kernels_match_references_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CHECKS)],
                          cwd=CHECKS.parents[2], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == 10 and "skipped" not in proc.stdout, proc.stdout[-2000:]


# --- the dispatch's decision per GPU, with a faked compute capability (no GPU needed) -----------
SHAPES = [(197, 64), (257, 80), (577, 64), (1024, 128)]  # ViT-B/L, ViT-H/14, 384 px, declared limits
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _probe(tokens, head_dim, dtype=torch.bfloat16):
    return torch.empty(1, 1, tokens, head_dim, dtype=dtype, device="meta")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, head_dim", SHAPES)
def test_v100_takes_the_pytorch_path_and_a100_h100_the_fused_kernels(tokens, head_dim, dtype):
    assert "sm_70 < sm_80" in supports(_probe(tokens, head_dim, dtype), capability=(7, 0))
    for capability in [(8, 0), (9, 0)]:
        assert supports(_probe(tokens, head_dim, dtype), capability=capability) is None
        assert _fused_reason(_probe(tokens, head_dim, dtype), capability) is None


def test_dispatch_names_the_path_per_capability():
    v100 = describe_paths("sdpa", torch.device("cuda"), torch.float16, 197, 64, capability=(7, 0))
    assert v100["topk"].startswith("PyTorch reference composition (compute capability sm_70")
    for capability in [(8, 0), (9, 0)]:
        gpu = describe_paths("sdpa", torch.device("cuda"), torch.bfloat16, 257, 80, capability=capability)
        assert gpu["topk"] == "triton fused kernel"
    # segment masks go to SDPA on every GPU: it measured 2x faster than the fused segment kernel (H100)
    assert v100["segment"] == gpu["segment"] == "torch SDPA with a boolean mask"
    math = describe_paths("math", torch.device("cuda"), torch.bfloat16, 197, 64, capability=(9, 0))
    assert math["topk"] == "PyTorch reference composition (backend math)"


def test_unsupported_inputs_name_the_limit():
    assert "1024" in supports(_probe(1025, 64), capability=(9, 0))
    assert "head dim 256 > 128" in supports(_probe(197, 256), capability=(9, 0))
    assert "dtype torch.float64" in supports(_probe(197, 64, torch.float64), capability=(9, 0))
    assert supports(torch.empty(1, 1, 197, 64)) == "not on a GPU"


def test_shared_memory_need_is_checked_against_the_device_limit(monkeypatch):
    from kernels import restricted_triton

    need = plan(1024, 128, torch.float32).shared_bound(4)
    monkeypatch.setitem(restricted_triton.OPT_IN_SHARED, (8, 6), need - 1)
    reason = supports(_probe(1024, 128, torch.float32), capability=(8, 6))
    assert f"need up to {need} B of shared memory" in reason and f"sm_86 allows {need - 1} B" in reason
    monkeypatch.setitem(restricted_triton.OPT_IN_SHARED, (8, 6), need)  # exactly the need: it fits
    assert supports(_probe(1024, 128, torch.float32), capability=(8, 6)) is None
    assert supports(_probe(197, 64), capability=(8, 6)) is None


def test_logit_tiles_stay_on_mma_sync_so_the_kept_set_is_bit_identical():
    # wgmma (sm_90) takes tiles of >= 64 rows; the logit tiles of every kernel stay below, so
    # every kernel rounds a logit the same way (see kernels/restricted_triton.py).
    for tokens, head_dim in SHAPES:
        for dtype in DTYPES:
            cfg = plan(tokens, head_dim, dtype)
            assert max(cfg.threshold[0], cfg.forward[0], cfg.dkdv[0], cfg.dq[0]) <= 32


class _FakeCudaTensor:
    """What the dispatch reads of a CUDA tensor, on a machine without one."""
    is_cuda = True
    device = torch.device("cuda", 0)
    shape = (2, 12, 197, 64)
    dtype = torch.float16


def test_fallback_on_a_v100_warns_once_per_reason(monkeypatch):
    dispatch = importlib.import_module("kernels.attention")  # the module, not the function kernels exports
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(dispatch, "_FALLBACKS_WARNED", set())
    with pytest.warns(UserWarning, match="falls back to the PyTorch path on this GPU: compute capability sm_70") as seen:
        assert _fused_or_warn(_FakeCudaTensor()) is False
        assert _fused_or_warn(_FakeCudaTensor()) is False  # the next layers: no second warning
    assert len(seen) == 1
