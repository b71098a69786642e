"""CI gate for the fused restricted-attention kernels, without a GPU: compile them ahead of time
for A100 (sm_80) and H100 (sm_90a) with the launcher's own plan, at a representative set of the
shapes the dispatch admits for the shipped presets and at the declared limits, and assert what a
launch needs: shared memory within the device's opt-in limit (and within the bound supports()
checks), and no register spills at the ViT-B/L shape (197 tokens, head dim 64, fp16/bf16).

About 2 minutes on 2 cores (the compiles run in 2 processes, once per module). The full sweep
(every dtype x shape x mode) is `make kernel-sweep`, whose table is docs/KERNELS.md.
"""
import json

import pytest
import torch

pytest.importorskip("triton")
from kernels import compile_check as cc  # noqa: E402
from kernels import restricted_triton as rt  # noqa: E402
from kernels.restricted_triton import supports  # noqa: E402

VIT_BL = cc.Shape("ViT-B/16 and ViT-L/16 at 224 px (MixedAE, MAE)", 197, 64)
VIT_H = cc.Shape("ViT-H/14 at 224 px", 257, 80)
FINETUNE_384 = cc.Shape("fine-tuning ViT-B/L/16 at 384 px", 577, 64)
LIMITS = cc.Shape("declared limits (MAX_TOKENS, MAX_HEAD_DIM)", 1024, 128)


def _ci_jobs() -> list:
    """Forward and backward of both modes at the common shape in fp16/bf16 (where spills matter);
    bf16 TopK at the larger presets; at the declared limit the largest-shared-memory kernels in
    fp32; fp32 at 197 tokens (224 KiB of shared memory on sm_80 before the redesign)."""
    jobs = cc.sweep_jobs((VIT_BL,), ("fp16", "bf16"), ("topk",))
    jobs += cc.sweep_jobs((VIT_BL,), ("fp16", "bf16"), ("segment",))
    jobs += cc.sweep_jobs((VIT_H, FINETUNE_384), ("bf16",), ("topk",))
    jobs += cc.sweep_jobs((VIT_BL,), ("fp32",), ("topk",), archs=(80,))
    jobs += [(LIMITS, "fp32", "topk", kernel, arch) for kernel in ("dkdv", "dq", "forward") for arch in cc.ARCHS]
    jobs += [(LIMITS, "bf16", "topk", "threshold", arch) for arch in cc.ARCHS]
    return jobs


@pytest.fixture(scope="module")
def builds() -> list[cc.Build]:
    return cc.compile_all(_ci_jobs(), workers=2)


def test_gate_covers_every_kernel_at_every_preset_shape_and_both_targets(builds):
    seen = {(b.tokens, b.head_dim, b.kernel, b.arch) for b in builds}
    for shape in (VIT_BL, VIT_H, FINETUNE_384):
        for kernel in cc.KERNELS:
            for arch in cc.ARCHS:
                assert (shape.tokens, shape.head_dim, kernel, arch) in seen
    assert {b.dtype for b in builds} == set(cc.DTYPES)
    assert {b.mode for b in builds} == {"topk", "segment"}


def test_compiled_shared_memory_fits_sm80_and_sm90(builds, record_property):
    record_property("kernel_builds", json.dumps([vars(b) for b in builds]))
    print("\n" + cc.markdown(builds))
    for b in builds:
        assert b.shared <= b.shared_limit, f"{b} needs more shared memory than sm_{b.arch} allows"
        # supports() admits a shape by the plan's bound: it must not undercount what compiles
        assert b.shared <= b.shared_bound, f"{b}: the plan's shared-memory bound undercounts"


def test_no_register_spills_at_the_vit_b_l_shape(builds):
    common = [b for b in builds if (b.tokens, b.head_dim) == (197, 64) and b.dtype in ("fp16", "bf16")]
    assert len(common) == 2 * 2 * (5 + 3)  # fp16/bf16 x sm_80/sm_90 x (5 TopK + 3 segment kernels)
    for b in common:
        assert b.spill_stores == 0 and b.spill_loads == 0, f"{b} spills"
        assert b.registers <= 255


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_dispatch_admits_every_compiled_shape(capability):
    # What the gate compiled is what the dispatch runs: supports() takes every preset shape and dtype
    for shape in cc.PRESET_SHAPES:
        for dtype in cc.DTYPES.values():
            probe = torch.empty(1, 1, shape.tokens, shape.head_dim, dtype=dtype, device="meta")
            assert supports(probe, capability) is None, (shape, dtype, capability)


def _build(mode="topk", kernel="forward", shared=50_000, registers=100, spills=0, bound=200_000) -> cc.Build:
    return cc.Build(VIT_BL.source, 197, 64, "bf16", mode, kernel, 80, 4, "64x64x64/64", shared,
                    cc.ARCHS[80][1], bound, registers, spills, 0, 1.0)


class _Compiled(Exception):
    """Raised in place of triton.compile: the gate's constants are captured, nothing is compiled."""


def _constexprs(monkeypatch, mode: str, kernel: str) -> dict:
    import triton
    import triton.compiler

    monkeypatch.setattr(triton.compiler, "ASTSource", lambda **source: source)

    def compile(source, **_):
        raise _Compiled(source["constexprs"])

    monkeypatch.setattr(triton, "compile", compile)
    with pytest.raises(_Compiled) as e:
        cc.compile_one(VIT_BL, "bf16", mode, kernel, 90)
    return e.value.args[0]


@pytest.mark.parametrize("mode, kernel, flags", [
    # as kernels/restricted_triton.py launches them: TopK forward with the same-source stats (MixedAE),
    # segment without; the threshold kernel alone, and writing the kept set with the stats for SDPA
    ("topk", "forward", {"MODE": rt.MODE_TOPK, "WITH_STATS": True}),
    ("segment", "forward", {"MODE": rt.MODE_SEGMENT, "WITH_STATS": False}),
    ("topk", "threshold", {"WRITE_MASK": False, "WITH_STATS": False}),
    ("topk", "threshold_mask", {"WRITE_MASK": True, "WITH_STATS": True}),
])
def test_the_gate_compiles_each_kernel_with_the_launchers_flags(monkeypatch, mode, kernel, flags):
    constexprs = _constexprs(monkeypatch, mode, kernel)
    assert {k: constexprs[k] for k in flags} == flags


def test_the_summary_shows_each_kernels_worst_over_the_modes():
    builds = [_build("topk", shared=90_000, registers=120, spills=0),
              _build("segment", shared=50_000, registers=168, spills=8)]
    row = cc.summary(builds).splitlines()[-1]
    worst = (max(b.shared for b in builds), max(b.registers for b in builds), max(b.spills for b in builds))
    assert "| {:,} / {} / {} |".format(*worst) in row  # 90,000 / 168 / 8: each the max of its column
    assert row.startswith("| 197 | 64 | bf16 | sm_80 |")


@pytest.mark.parametrize("shared, bound, status", [
    (100_000, 200_000, 0),
    (100_000, 90_000, 1),  # within the device's limit, but over the bound supports() admits shapes by
    (170_000, 200_000, 1),  # over sm_80's limit
])
def test_the_sweep_fails_on_a_kernel_over_the_limit_or_the_plans_bound(monkeypatch, capsys, shared, bound, status):
    monkeypatch.setattr(cc, "compile_all", lambda jobs, workers: [_build(shared=shared, bound=bound)])
    assert cc.main(["--sweep", "presets", "--workers", "1"]) == status
    assert f"{status} over the shared-memory limit or the plan's bound" in capsys.readouterr().err
