"""Compile the fused restricted-attention kernels ahead of time for A100 (sm_80) and H100 (sm_90a)
on a machine without a GPU, and read what each compiled kernel needs.

For one configuration (tokens, head dim, dtype, mode) every kernel the launcher would run is
compiled with the launcher's own plan (kernels.restricted_triton.plan: tile sizes, warps,
stages), through `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`:
- shared memory: the compiled kernel's `metadata.shared` (what the driver is asked for at launch);
- registers and spill bytes per thread: `ptxas -v` (the one bundled with Triton, the same flags
  Triton uses) on the kernel's PTX.
The pointer arguments are specialised as the launcher specialises them (16-byte aligned), and
integer arguments divisible by 16 likewise, so the code matches what a launch compiles.

    python -m kernels.compile_check --sweep full --json out.json --markdown out.md

writes the table in docs/KERNELS.md (`make kernel-sweep`); tests/kernels/test_compile_gate.py
compiles a representative subset in `make test`.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch

# arch -> (ptxas --gpu-name, opt-in shared memory per block in bytes)
ARCHS = {80: ("sm_80", 166_912), 90: ("sm_90a", 232_448)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
POINTER_TYPES = {"LSE": "*fp32", "DELTA": "*fp32", "KROW": "*i32", "THR": "*i32", "SEG": "*i32", "STATS": "*i32",
                 "MASK": "*u8"}
# threshold_mask: the threshold kernel writing the kept set and the same-source counts too (the
# TopK path through SDPA with a mask, restricted_triton.topk_attention_masked_sdpa)
KERNELS = ("threshold", "threshold_mask", "forward", "dkdv", "dq")
THRESHOLD_KERNELS = ("threshold", "threshold_mask")


@dataclass(frozen=True)
class Shape:
    """One attention shape the dispatch admits: where it comes from, tokens, head dim."""
    source: str
    tokens: int
    head_dim: int


# Shapes the shipped presets produce (train/configs, model/vit.py sizes) and the declared limits.
PRESET_SHAPES = (
    Shape("ViT-B/16 and ViT-L/16 at 224 px (MixedAE, MAE)", 197, 64),
    Shape("ViT-H/14 at 224 px", 257, 80),
    Shape("fine-tuning ViT-B/L/16 at 384 px", 577, 64),
    Shape("declared limits (MAX_TOKENS, MAX_HEAD_DIM)", 1024, 128),
)
# Extra shapes in the full sweep: the edges of the plan's branches.
SWEEP_SHAPES = PRESET_SHAPES + (
    Shape("ViT-H/14 at 448 px fine-tuning", 1024, 80),
    Shape("head dim 128 at 224 px", 197, 128),
)


@dataclass
class Build:
    """What one compiled kernel needs on one target."""
    source: str
    tokens: int
    head_dim: int
    dtype: str
    mode: str  # topk (with the same-source stats) or segment
    kernel: str
    arch: int
    num_warps: int
    tiles: str  # the kernel's tile sizes
    shared: int  # bytes per block (metadata.shared)
    shared_limit: int
    shared_bound: int  # the plan's bound that supports() compares with the device limit
    registers: int
    spill_stores: int
    spill_loads: int
    seconds: float

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


def _signature(fn, dtype: str, constexprs: dict, ints: dict) -> tuple[dict, dict]:
    """Triton signature and divisibility attributes for `fn` as the launcher specialises it."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTER_TYPES:
            signature[name] = POINTER_TYPES[name]
        elif name.isupper() and name not in ints:
            signature[name] = f"*{dtype}"
        elif name == "scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
        is_pointer = signature[name].startswith("*")
        if is_pointer or (name in ints and ints[name] % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _ptxas(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) per thread from the bundled ptxas."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [knobs.nvidia.ptxas.path, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={ARCHS[arch][0]}",
               src, "-o", os.path.join(tmp, "kernel.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas output:\n{log}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def compile_one(shape: Shape, dtype: str, mode: str, kernel: str, arch: int) -> Build:
    """Compile one kernel for one target with the launcher's plan and measure it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import restricted_triton as rt

    cfg = rt.plan(shape.tokens, shape.head_dim, DTYPES[dtype])
    T, d, H = shape.tokens, shape.head_dim, 12
    ints = {"H": H, "T": T, "D": d, "stride_b": H * T * d, "stride_h": T * d, "stride_t": d, "num_global": 1}
    common = {"BLOCK_D": cfg.block_d, "D_CHUNK": cfg.d_chunk}
    mode_id = rt.MODE_TOPK if mode == "topk" else rt.MODE_SEGMENT
    if kernel in THRESHOLD_KERNELS:
        fn, (bm, bn, warps) = rt._threshold_kernel, cfg.threshold
        mask = kernel == "threshold_mask"
        constexprs = {**common, "BLOCK_M": bm, "BLOCK_ROW": bn, "WRITE_MASK": mask, "WITH_STATS": mask}
    else:
        fn, (bm, bn, warps) = {"forward": (rt._fwd_kernel, cfg.forward), "dkdv": (rt._bwd_dkdv_kernel, cfg.dkdv),
                               "dq": (rt._bwd_dq_kernel, cfg.dq)}[kernel]
        constexprs = {**common, "MODE": mode_id, "BLOCK_M": bm, "BLOCK_N": bn}
        if kernel == "forward":
            constexprs["WITH_STATS"] = mode == "topk"
    signature, attrs = _signature(fn, dtype, constexprs, ints)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": cfg.num_stages})
    regs, stores, loads = _ptxas(compiled.asm["ptx"], arch)
    element_bytes = DTYPES[dtype].itemsize
    return Build(source=shape.source, tokens=T, head_dim=d, dtype=dtype, mode=mode, kernel=kernel, arch=arch,
                 num_warps=warps, tiles=f"{bm}x{bn}x{cfg.d_chunk}/{cfg.block_d}", shared=compiled.metadata.shared,
                 shared_limit=ARCHS[arch][1], shared_bound=cfg.shared_bound(element_bytes), registers=regs,
                 spill_stores=stores, spill_loads=loads, seconds=round(time.perf_counter() - start, 1))


def _compile_args(args: tuple) -> Build:
    return compile_one(*args)


def compile_all(jobs: list[tuple[Shape, str, str, str, int]], workers: int = 2) -> list[Build]:
    """Compile (shape, dtype, mode, kernel, arch) jobs in `workers` processes, in order."""
    if workers <= 1:
        return [compile_one(*job) for job in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_compile_args, jobs))


def kernels_for(mode: str) -> tuple[str, ...]:
    return KERNELS if mode == "topk" else tuple(k for k in KERNELS if k not in THRESHOLD_KERNELS)


def sweep_jobs(shapes=SWEEP_SHAPES, dtypes=tuple(DTYPES), modes=("topk", "segment"), archs=tuple(ARCHS)) -> list:
    return [(shape, dtype, mode, kernel, arch) for shape in shapes for dtype in dtypes for mode in modes
            for kernel in kernels_for(mode) for arch in archs]


def markdown(builds: list[Build]) -> str:
    head = ("| tokens | head dim | dtype | mode | kernel | arch | warps | tiles (M x N x d-chunk / d) | shared (B) "
            "| limit (B) | registers | spill bytes (st+ld) |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {b.tokens} | {b.head_dim} | {b.dtype} | {b.mode} | {b.kernel} | sm_{b.arch} | {b.num_warps} | {b.tiles} "
            f"| {b.shared:,} | {b.shared_limit:,} | {b.registers} | {b.spills} |" for b in builds]
    return head + "\n".join(rows) + "\n"


def summary(builds: list[Build]) -> str:
    """One row per (shape, dtype, arch): per kernel the worst over modes of shared bytes /
    registers / spill bytes (stores + loads)."""
    worst: dict[tuple, dict[str, tuple[int, int, int]]] = {}
    for b in builds:
        cell = worst.setdefault((b.tokens, b.head_dim, b.dtype, b.arch), {})
        old = cell.get(b.kernel, (0, 0, 0))
        cell[b.kernel] = (max(old[0], b.shared), max(old[1], b.registers), max(old[2], b.spills))
    head = ("| tokens | head dim | dtype | arch | " + " | ".join(KERNELS) + " |\n|---|---|---|---|"
            + "---|" * len(KERNELS) + "\n")
    rows = []
    for (tokens, head_dim, dtype, arch), cell in worst.items():
        kernels = " | ".join("{:,} / {} / {}".format(*cell[k]) if k in cell else "-" for k in KERNELS)
        rows.append(f"| {tokens} | {head_dim} | {dtype} | sm_{arch} | {kernels} |")
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", choices=("full", "presets"), default="full")
    parser.add_argument("--json", help="write every build as JSON here")
    parser.add_argument("--markdown", help="write the table as markdown here")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    shapes = SWEEP_SHAPES if args.sweep == "full" else PRESET_SHAPES
    start = time.perf_counter()
    builds = compile_all(sweep_jobs(shapes), args.workers)
    table = markdown(builds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(b) for b in builds], f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("Per (shape, dtype, arch), each kernel's worst over the modes: shared memory (B) / registers / "
                    "spill bytes per thread.\n\n" + summary(builds) + "\nEvery build:\n\n" + table)
    print(table)
    over = [b for b in builds if b.shared > b.shared_limit or b.shared > b.shared_bound]
    print(f"{len(builds)} kernels compiled in {time.perf_counter() - start:.0f} s; "
          f"{len(over)} over the shared-memory limit or the plan's bound", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
