"""Attention benchmark: forward+backward time and peak memory of restricted attention against
named baselines measured in the same run, written as JSON to runs/bench/ (--out_dir DIR: there;
--record: benchmarks/results/, the committed records).

    python -m kernels.bench                      # GPU: ViT-B and ViT-L shapes, bf16
    python -m kernels.bench --dtype fp16
    python -m kernels.bench --device cpu --shapes 2,2,17,16 --iters 3   # CPU (PyTorch paths only)

(Training-step ratios of MixedAE / AdPE to their baselines: train/bench_objectives.py.)

Variants (each on the same q, k, v):
  dense_sdpa      F.scaled_dot_product_attention, no mask (flash on sm80+): the floor
  topk_torch      the best plain PyTorch composition: QK^T, topk threshold, masked softmax, PV
  topk_fused      the Triton kernel (GPU only)
  topk_masked_sdpa  the Triton threshold kernel writing the kept set, then SDPA under it as a mask (GPU only)
  segment_sdpa    SDPA with a boolean same-source mask (memory-efficient kernel)
  segment_flex    FlexAttention with a same-source block mask, compiled (GPU only, when available)
  segment_fused   the Triton kernel (GPU only)
Ratios: time(baseline) / time(variant) as "<variant>_speedup_vs_<baseline>" and
time(variant) / time(dense_sdpa) as "<variant>_over_dense".
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kernels.masked import (
    GLOBAL,
    TopKMask,
    segment_attention_sdpa,
    topk_attention_reference,
)

REPO = Path(__file__).resolve().parent.parent
RECORDS = REPO / "benchmarks" / "results"  # committed records: written there only when asked (--record)
SCRATCH = REPO / "runs" / "bench"  # git-ignored: where a benchmark writes by default
SHAPES = {"vit_b": (128, 12, 197, 64), "vit_l": (128, 16, 197, 64)}  # (B, H, T, d): 196 patches + cls
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHOW_DEFAULT = " (default: %(default)s)"  # argparse fills in each option's default


def commit() -> str:
    """GPU_CHECK_COMMIT when set (the GPU kit runs on a copy without git, tools/gpu_check.py), else
    git's HEAD, else "unknown"."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record_header(device: torch.device, dtype: str, iters: int, warmup: int) -> dict:
    """What every benchmark record starts with: commit, date, device, dtype, torch, timing counts."""
    return {
        "commit": commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": dtype, "torch": torch.__version__, "iters": iters, "warmup": warmup,
    }


def write_record(record: dict, out_dir: Path, prefix: str, device: torch.device, dtype: str) -> Path:
    """<out_dir>/<prefix>_<device type>_<dtype>_<UTC stamp>.json; prints where."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    path = out_dir / f"{prefix}_{device.type}_{dtype}_{stamp}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path}")
    return path


class OneLineParser(argparse.ArgumentParser):
    """Errors as one line and exit 2, as every command of the repository refuses input (data/cli.py)."""

    def error(self, message: str):
        print(f"error: {message} (--help lists the options)", file=sys.stderr)
        raise SystemExit(2)


def add_timing_options(p: argparse.ArgumentParser, iters: int) -> None:
    """--device, --dtype, --iters, --warmup, --out_dir, --record: what every benchmark entry point takes."""
    p.add_argument("--device", default="cuda", help="cuda or cpu" + SHOW_DEFAULT)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="compute dtype" + SHOW_DEFAULT)
    p.add_argument("--iters", type=int, default=iters, help="timed calls" + SHOW_DEFAULT)
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first" + SHOW_DEFAULT)
    p.add_argument("--out_dir", help="where the JSON record goes (default: runs/bench, git-ignored)")
    p.add_argument("--record", action="store_true", help="write the record into benchmarks/results/ (committed)")


def out_dir_of(p: argparse.ArgumentParser, a: argparse.Namespace) -> Path:
    """Where the record goes: --out_dir, else benchmarks/results/ with --record, else runs/bench/;
    refused (one line, exit 2) when it cannot be written or both are given."""
    if a.out_dir and a.record:
        p.error("give --out_dir or --record, not both")
    out = Path(a.out_dir) if a.out_dir else RECORDS if a.record else SCRATCH
    if out.exists() and not out.is_dir():
        p.error(f"--out_dir {out} is a file: give a folder")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        p.error(f"--out_dir {out} cannot be written ({existing} is not a folder you can write to)")
    if a.iters < 1 or a.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor], iters: int, warmup: int,
            device: torch.device) -> dict[str, float]:
    """Mean forward+backward milliseconds and peak extra memory (MiB, GPU only)."""
    grad_out = None

    def step():
        nonlocal grad_out
        out = fn()
        grad_out = torch.ones_like(out) if grad_out is None else grad_out
        torch.autograd.grad(out, inputs, grad_out)

    for _ in range(warmup):
        step()
    sync(device)
    result: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        result["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    result["ms"] = (time.perf_counter() - start) * 1000 / iters
    return result


def variants(q, k, v, segments, topk: int, device: torch.device) -> dict[str, Callable[[], torch.Tensor]]:
    out: dict[str, Callable[[], torch.Tensor]] = {
        "dense_sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "topk_torch": lambda: topk_attention_reference(q, k, v, TopKMask(topk)),
        "segment_sdpa": lambda: segment_attention_sdpa(q, k, v, segments),
    }
    from kernels.accelerators import has_triton_gpu

    if device.type == "cuda" and has_triton_gpu():
        from kernels.restricted_triton import segment_attention, topk_attention, topk_attention_masked_sdpa

        B, _, T, _ = q.shape
        k_rows = torch.full((B, T), topk, device=device)
        out["topk_fused"] = lambda: topk_attention(q, k, v, k_rows, 1)[0]
        out["topk_masked_sdpa"] = lambda: topk_attention_masked_sdpa(q, k, v, k_rows, 1)[0]
        out["segment_fused"] = lambda: segment_attention(q, k, v, segments)
        try:
            from torch.nn.attention.flex_attention import (
                create_block_mask,
                flex_attention,
            )

            def same_source(b, h, qi, ki):
                return (segments[b, qi] == segments[b, ki]) | (segments[b, qi] == GLOBAL)

            block_mask = create_block_mask(same_source, B, None, T, T, device=device)
            flex = torch.compile(flex_attention)
            out["segment_flex"] = lambda: flex(q, k, v, block_mask=block_mask)
        except Exception as e:  # noqa: BLE001 - FlexAttention is optional here; record why it is missing
            print(f"segment_flex skipped: {type(e).__name__}: {e}")
    return out


def bench_shape(name: str, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device, ratio: float,
                iters: int, warmup: int) -> dict:
    B, H, T, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    groups = round(1 / ratio)
    segments = torch.randint(0, groups, (B, T), generator=g).to(device)
    segments[:, 0] = GLOBAL
    topk = int(ratio * (T - 1) + 0.5)
    results = {}
    for label, fn in variants(q, k, v, segments, topk, device).items():
        results[label] = measure(fn, [q, k, v], iters, warmup, device)
        print(f"{name} {label:14} {results[label]}")
    ms = {label: r["ms"] for label, r in results.items()}
    ratios = {f"{label}_over_dense": ms[label] / ms["dense_sdpa"] for label in ms if label != "dense_sdpa"}
    if "topk_fused" in ms:
        ratios["topk_fused_speedup_vs_topk_torch"] = ms["topk_torch"] / ms["topk_fused"]
        ratios["topk_masked_sdpa_speedup_vs_topk_fused"] = ms["topk_fused"] / ms["topk_masked_sdpa"]
    for label in ("segment_fused", "segment_flex"):
        if label in ms:
            ratios[f"{label}_speedup_vs_segment_sdpa"] = ms["segment_sdpa"] / ms[label]
    return {"shape": {"B": B, "H": H, "T": T, "d": d}, "topk": topk, "groups": groups, "results": results,
            "ratios": ratios}


def main(argv: list[str] | None = None) -> Path:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_timing_options(p, iters=20)
    p.add_argument("--shapes", nargs="*", default=list(SHAPES),
                   help="vit_b, vit_l, or B,H,T,d (T counts the cls token)" + SHOW_DEFAULT)
    p.add_argument("--mix_ratio", type=float, default=0.25, help="K = round(r * patches), r = 1/groups" + SHOW_DEFAULT)
    a = p.parse_args(argv)
    out_dir = out_dir_of(p, a)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device; pass --device cpu for the PyTorch paths on small shapes")
    dtype = DTYPES[a.dtype]
    record = {**record_header(device, a.dtype, a.iters, a.warmup), "shapes": {}}
    try:
        import triton

        record["triton"] = triton.__version__
    except ImportError:
        record["triton"] = None
    for spec in a.shapes:
        shape = SHAPES[spec] if spec in SHAPES else tuple(int(x) for x in spec.split(","))
        record["shapes"][spec] = bench_shape(spec, shape, dtype, device, a.mix_ratio, a.iters, a.warmup)
    return write_record(record, out_dir, "attention", device, a.dtype)


if __name__ == "__main__":
    main()
