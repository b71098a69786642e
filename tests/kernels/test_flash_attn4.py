"""flash-attn-4 as a kernel of the attention table (kernels/flash_attn4.py): the custom ops against
the math reference (through a stand-in package that computes what flash-attn-4's functions
return), compiled blocks tracing them without a break, the table routing a shape to it only where
it trains, the refusals, and, where flash-attn-4 is installed, its kernels compiled ahead of time
for sm90 at ViT-B/L's attention shapes from the projection's own layout, on CPU."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
from fake_gpu import fake_gpu

from kernels import attention_choice, flash_attn4
from kernels.attention import math_attention, sdpa_attention

REPO = Path(__file__).resolve().parents[2]


def _reference_forward(q, k, v, return_lse=False):
    """What flash-attn-4's _flash_attn_fwd returns, from (B, N, H, d): out, lse (B, H, N) fp32, and
    three more values (None here)."""
    qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))  # (B, H, N, d)
    logits = qt @ kt.transpose(-2, -1) * q.shape[-1] ** -0.5
    out = (logits.softmax(-1) @ vt).transpose(1, 2).to(q.dtype)
    return out, logits.logsumexp(-1), None, None, None


def _reference_backward(q, k, v, out, dout, lse):
    """The attention gradients in closed form (a custom op's body runs below autograd):
    P = exp(S - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO * O)), dQ = dS K s, dK = dS^T Q s."""
    scale = q.shape[-1] ** -0.5
    qt, kt, vt, ot, dot = (t.transpose(1, 2).float() for t in (q, k, v, out, dout))  # (B, H, N, d)
    p = torch.exp(qt @ kt.transpose(-2, -1) * scale - lse[..., None])
    ds = p * (dot @ vt.transpose(-2, -1) - (dot * ot).sum(-1, keepdim=True))
    grads = ds @ kt * scale, ds.transpose(-2, -1) @ qt * scale, p.transpose(-2, -1) @ dot
    return tuple(g.transpose(1, 2).to(q.dtype) for g in grads)


@pytest.fixture
def fake_fa4(monkeypatch):
    """A stand-in flash-attn-4 recording its calls: ("fwd" | "bwd", q's shape and strides)."""
    calls: list[tuple] = []
    interface = ModuleType("flash_attn.cute.interface")

    def fwd(q, k, v, return_lse=False):
        calls.append(("fwd", tuple(q.shape), q.stride()))
        return _reference_forward(q, k, v, return_lse)

    def bwd(q, k, v, out, dout, lse):
        calls.append(("bwd", tuple(q.shape), q.stride()))
        return _reference_backward(q, k, v, out, dout, lse)

    interface._flash_attn_fwd, interface._flash_attn_bwd = fwd, bwd
    for name, module in (("flash_attn", ModuleType("flash_attn")), ("flash_attn.cute", ModuleType("flash_attn.cute")),
                         ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    flash_attn4._interface.cache_clear()
    yield calls
    flash_attn4._interface.cache_clear()
    attention_choice.deactivate()


def projection_views(B=3, N=17, H=2, d=16, dtype=torch.float32, seed=0):
    """q, k, v (B, H, N, d) as the ViT's attention takes them: views of one (B, N, 3, H, d) projection."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, 3, H, d, generator=g).to(dtype).requires_grad_()
    return qkv, [t.transpose(1, 2) for t in qkv.unbind(2)]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_ops_equal_the_reference_forward_and_backward(fake_fa4, dtype, tol):
    qkv, (q, k, v) = projection_views(dtype=dtype)
    got = flash_attn4.attention(q, k, v)
    grad = torch.randn_like(got)
    (g_got,) = torch.autograd.grad(got, qkv, grad)
    want = math_attention(q, k, v)
    (g_want,) = torch.autograd.grad(want, qkv, grad)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(g_got, g_want, rtol=tol, atol=tol)
    # the package got (B, N, H, d) views of the projection, no copies: token stride 3 x H x d
    assert [c[0] for c in fake_fa4] == ["fwd", "bwd"]
    assert fake_fa4[0][1:] == ((3, 17, 2, 16), (17 * 3 * 2 * 16, 3 * 2 * 16, 16, 1))


def test_a_compiled_block_traces_the_ops_without_a_break(fake_fa4, tmp_path):
    """fullgraph raises at a graph break; the block's loss and gradients equal eager's (fp32)."""
    from model.vit import Block

    torch.manual_seed(0)
    block = Block(32, 2, attn_backend="sdpa")
    x = torch.randn(3, 17, 32, requires_grad=True)
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"entries": [{"capability": "9.0", "dtype": "fp32", "attention": "dense", "heads": 2,
                                             "tokens": 17, "head_dim": 16, "kernel": "flash_attn4",
                                             "measured": {}}]}))
    with fake_gpu("h100"):
        assert attention_choice.activate(torch.device("cuda", 0), path) == 1
    want = block(x)
    (g_want,) = torch.autograd.grad(want.sum(), x)
    assert [c[0] for c in fake_fa4] == ["fwd", "bwd"]  # eager already ran it, routed by the table
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    (g_got,) = torch.autograd.grad(got.sum(), x)
    assert [c[0] for c in fake_fa4] == ["fwd", "bwd"] * 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def _fa4_table(tmp_path: Path, capability: str) -> Path:
    path = tmp_path / "choices.json"
    entries = [{"capability": capability, "dtype": "bf16", "attention": "dense", "heads": 2, "tokens": 17,
                "head_dim": 16, "kernel": "flash_attn4", "measured": {}},
               {"capability": capability, "dtype": "bf16", "attention": "dense", "heads": 4, "tokens": 17,
                "head_dim": 16, "kernel": "cudnn", "measured": {}}]
    path.write_text(json.dumps({"entries": entries}))
    return path


def test_the_table_routes_its_shape_to_flash_attn4_on_a_gpu_it_trains_on(fake_fa4, tmp_path):
    with fake_gpu("h100"):
        assert attention_choice.activate(torch.device("cuda", 0), _fa4_table(tmp_path, "9.0")) == 2
    assert attention_choice.set_aside_warnings() == []
    _, (q, k, v) = projection_views(dtype=torch.bfloat16)
    torch.testing.assert_close(sdpa_attention(q, k, v), math_attention(q, k, v), rtol=2e-2, atol=2e-2)
    assert [c[0] for c in fake_fa4] == ["fwd"]
    sdpa_attention(q.float(), k.float(), v.float())  # fp32: no entry, PyTorch's pick
    assert len(fake_fa4) == 1


@pytest.mark.parametrize("gpu, installed, reason", [
    ("a100", True, "flash_attn4: compute capability 8.0 (flash-attn-4 trains on sm90 and sm100)"),
    ("h100", False, "flash_attn4: flash-attn-4 does not import"),
])
def test_an_entry_it_cannot_run_here_is_set_aside_with_why(fake_fa4, monkeypatch, tmp_path, gpu, installed, reason):
    if not installed:
        monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)  # import raises ImportError
        flash_attn4._interface.cache_clear()
    with fake_gpu(gpu):
        capability = "9.0" if gpu == "h100" else "8.0"
        assert attention_choice.activate(torch.device("cuda", 0), _fa4_table(tmp_path, capability)) == 1  # cudnn's
    (line,) = attention_choice.set_aside_warnings()  # what the run's log says
    assert line.startswith(f"attention bf16 2x17x16: its measured kernel cannot run here ({reason}")
    assert line.endswith("; PyTorch's pick runs it")
    assert attention_choice.kernel_for(torch.empty(3, 2, 17, 16, dtype=torch.bfloat16)) is None
    attention_choice.deactivate()
    assert attention_choice.set_aside_warnings() == []


def test_entries_set_aside_for_two_dtypes_of_one_shape_each_get_their_line(fake_fa4, tmp_path):
    """The set-aside lines were keyed by shape alone: the fp16 entry's line hid the bf16 one's."""
    path = _fa4_table(tmp_path, "8.0")
    table = json.loads(path.read_text())
    table["entries"].append({**table["entries"][0], "dtype": "fp16"})
    path.write_text(json.dumps(table))
    with fake_gpu("a100"):
        attention_choice.activate(torch.device("cuda", 0), path)
    lines = attention_choice.set_aside_warnings()
    attention_choice.deactivate()
    assert [line.split(":")[0] for line in lines] == ["attention bf16 2x17x16", "attention fp16 2x17x16"]


@pytest.mark.parametrize("dtype, d, capability, said", [
    (torch.bfloat16, 64, (9, 0), None),
    (torch.float16, 256, (9, 0), None),
    (torch.bfloat16, 128, (10, 0), None),
    (torch.bfloat16, 256, (10, 0), "head dim 256 (flash-attn-4 takes multiples of 8 from 8 to 128 here)"),
    (torch.bfloat16, 20, (9, 0), "head dim 20"),
    (torch.float32, 64, (9, 0), "flash-attn-4 takes fp16 or bf16"),
    (torch.bfloat16, 64, (8, 0), "compute capability 8.0"),
    (torch.bfloat16, 64, (12, 0), "compute capability 12.0 (flash-attn-4 trains on sm90 and sm100)"),
    (torch.bfloat16, 64, None, "not on a GPU"),
])
def test_refusals_name_what_it_does_not_take(fake_fa4, dtype, d, capability, said):
    q = torch.empty(2, 4, 10, d, dtype=dtype)
    reason = flash_attn4.refusal(q, q, q, capability)
    assert reason is None if said is None else said in reason


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_a_value_head_dim_other_than_the_querys_is_refused(fake_fa4, capability):
    # both head dims within what the GPU takes, but not one head dim for q, k and v
    q = torch.empty(2, 4, 10, 64, dtype=torch.bfloat16)
    v = torch.empty(2, 4, 10, 128, dtype=torch.bfloat16)
    said = flash_attn4.refusal(q, q, v, capability)
    assert said == "value head dim 128 for query head dim 64 (flash-attn-4 takes one head dim for both)"


def test_a_version_without_the_functions_it_calls_is_refused_naming_the_tested_one(fake_fa4, monkeypatch):
    monkeypatch.delattr(sys.modules["flash_attn.cute.interface"], "_flash_attn_bwd")
    flash_attn4._interface.cache_clear()
    reason = flash_attn4.unavailable((9, 0))
    assert "has no _flash_attn_bwd" in reason and f"flash-attn-4=={flash_attn4.TESTED_VERSION}" in reason


def test_the_tool_says_why_flash_attn4_was_not_timed_on_cpu():
    ms = attention_choice.time_kernels(2, 2, 17, 16, torch.float32, torch.device("cpu"), iters=1, warmup=1)
    assert list(ms) == list(attention_choice.ATTENTIONS["dense"])
    assert ms["flash_attn4"] == "not available: torch.float32/torch.float32/torch.float32 inputs (flash-attn-4 takes fp16 or bf16)"
    ms = attention_choice.time_kernels(2, 2, 17, 16, torch.bfloat16, torch.device("cpu"), iters=1, warmup=1)
    assert ms["flash_attn4"] == "not available: not on a GPU"


AOT = """
import os, sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from kernels import flash_attn4
B = int(sys.argv[1])
with FakeTensorMode(allow_non_fake_inputs=True):
    for N, H, d in [tuple(map(int, s.split("x"))) for s in sys.argv[2:]]:
        qkv = torch.empty(B, N, 3, H, d, dtype=torch.bfloat16, device="cuda")
        q, k, v = qkv.unbind(2)  # (B, N, H, d) views: token stride 3 x H x d, as the blocks give them
        out, lse = flash_attn4.run_forward(q, k, v)
        dq, dk, dv = flash_attn4.run_backward(q, k, v, out, torch.empty_like(out), lse)
        assert out.shape == dq.shape == (B, N, H, d) and lse.shape == (B, H, N), (out.shape, lse.shape)
        print(f"compiled {N}x{H}x{d}")
"""


@pytest.mark.skipif(importlib.util.find_spec("flash_attn.cute") is None, reason="flash-attn-4 is not installed "
                    "(pip install -e '.[flash4]'; the test extra has it)")
def test_its_kernels_compile_for_sm90_at_vit_shapes_from_the_projections_layout():
    """No GPU: flash-attn-4 compiles for the architecture named in its environment variables and,
    under fake tensors, launches nothing. MAE ViT-B/16's encoder (50 tokens, 12 heads of 64) and
    decoder (197 tokens, 16 heads of 32), and ViT-L/16's encoder (16 heads of 64)."""
    env = {**os.environ, "FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a", "FLASH_ATTENTION_NUM_SMS": "132",
           "PYTHONPATH": str(REPO)}
    shapes = ["50x12x64", "197x16x32", "50x16x64"]
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(AOT), "128", *shapes], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[:3] == [f"compiled {s.split('x')[0]}x{s.split('x')[1]}x{s.split('x')[2]}" for s in shapes]


def test_the_dry_run_line_names_it_and_what_runs_without_it():
    said = attention_choice.describe({(16, 197, 32): "flash_attn4", (12, 50, 64): "cudnn"}, [(12, 50, 64), (16, 197, 32)])
    assert said == ("12x50x64 cudnn (measured fastest); "
                    "16x197x32 flash_attn4 (measured fastest; where it is not installed, PyTorch's pick)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens, head_dim", [(197, 64), (257, 80), (50, 64)])
def test_the_real_kernels_match_the_math_reference_forward_and_backward(dtype, tokens, head_dim):
    """The tests above run a stand-in package; this one runs flash-attn-4 itself where it trains
    (sm90 / sm100), at ViT-B/16 (197 x 64), ViT-H/14-like (257 x 80) and MAE's encoder (50 tokens)."""
    capability = torch.cuda.get_device_capability()
    empty = torch.empty(1, 1, 1, head_dim, dtype=dtype)
    why = flash_attn4.refusal(empty, empty, empty, capability)
    if why is not None:
        pytest.skip(f"flash-attn-4 does not run here: {why}")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, tokens, head_dim, device="cuda", generator=g).to(dtype).requires_grad_()
               for _ in range(3))
    out = flash_attn4.attention(q, k, v)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = math_attention(q32, k32, v32)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_fake_rules_agree_with_what_they_return(fake_fa4, dtype):
    """Compiled blocks trace the ops by their fake rules alone: each fake output's shape, dtype and
    strides must be the real one's (lse (B, H, N) fp32 whatever the inputs' dtype)."""
    _, (q, k, v) = projection_views(dtype=dtype)
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))  # (B, N, H, d), the ops' layout
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")  # not aot_dispatch: seconds, and
    torch.library.opcheck(flash_attn4.forward, (q, k, v), test_utils=checks)  # the compiled-block test traces it
    out, lse = flash_attn4.forward(q, k, v)
    assert lse.shape == (3, 2, 17) and lse.dtype == torch.float32  # the reference says what the real one returns
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch.library.opcheck(flash_attn4.backward, tuple(t.detach() for t in (q, k, v, out, grad_out, lse)),
                          test_utils=checks)


def test_mixed_dtypes_are_refused_by_name(fake_fa4):
    q = torch.empty(2, 4, 10, 64, dtype=torch.bfloat16)
    for k, v in ((q.half(), q), (q, q.half()), (q.float(), q)):
        said = flash_attn4.refusal(q, k, v, (9, 0))
        assert said == f"{q.dtype}/{k.dtype}/{v.dtype} inputs (flash-attn-4 takes fp16 or bf16)"
    assert flash_attn4.refusal(q, q, q, (9, 0)) is None
