"""Where each method's step spends its time on this device, by phase, beside the arithmetic of that
phase: the measured side of tools/method_costs.py.

    python -m tools.method_time                                   # GPU: ViT-B/16 presets, micro-batch 64, bf16
    python -m tools.method_time --methods mae energy --micro 128 --markdown
    python -m tools.method_time --device cpu --debug --micro 2 --steps 2 --warmup 1

Each method's objective is built from its shipped preset (`--debug`: its debug preset, on top of
mae/debug.json) and run as the loop runs one micro-batch per optimizer step, without the engine
(train/estimate/step_flops.py `run_step`): forward, backward, a fused AdamW update of the weights
as cast, the objective's after-step hook (MLO-MAE's levels II and III, AdPE's adversary). Each
phase is timed on the device (CUDA events, read once at the end; a CPU times it by the clock) and
its FLOPs are counted for the same steps on the meta device, so each row says how far the phase
is from its arithmetic floor: the FLOPs at the GPU's dense bf16 peak. `over mae` puts each
method's measured step beside its counted one, both against MAE's: the measured ratio above the
counted one is overhead, not arithmetic.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import sys
import time

import torch

from data.cli import Parser, refuse
from tools.method_costs import CONFIGS, DEBUG_METHODS, DS, METHODS
from train.config.parsing import parse_args
from train.estimate.gpus import current_gpu
from train.estimate.step_flops import PHASES, build_step, flops_by_step, run_step

TIMED = ("forward", "backward", "optimizer", "after_step")
DEBUG_DS = CONFIGS.parents[1] / "ds_configs" / "cpu_debug.json"


class PhaseClock:
    """Times each call of `__call__(phase, fn)`: on a GPU by events around it on the current stream
    (device time, read only in `ms`, so the steps queue as in training), on a CPU by the clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object, object]] = []

    def __call__(self, phase: str, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
        else:
            start = time.perf_counter()
            out = fn()
            end = time.perf_counter()
        self.marks.append((phase, start, end))
        return out

    def ms(self) -> dict[str, float]:
        """Total milliseconds per phase over the calls so far."""
        if self.cuda:
            torch.cuda.synchronize()
        totals = dict.fromkeys(TIMED, 0.0)
        for phase, start, end in self.marks:
            totals[phase] += start.elapsed_time(end) if self.cuda else (end - start) * 1000
        return totals


def config_of(method: str, debug: bool):
    if debug:
        return parse_args(["--ds_config", str(DEBUG_DS), "--data.source", "synthetic", *DEBUG_METHODS[method]])
    return parse_args(["--ds_config", str(DS), "--data.source", "synthetic", *METHODS[method]])


def phase_times(cfg, micro: int, steps: int, warmup: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Per optimizer step of one micro-batch: milliseconds and GFLOP per image of each phase,
    over `steps` steps after `warmup` (the FLOPs counted for exactly the timed steps)."""
    torch.manual_seed(0)
    objective, batch = build_step(cfg, micro, dtype, device)
    optimizer = torch.optim.AdamW(objective.parameters(), lr=1e-4, fused=device.type == "cuda")

    def untimed(phase: str, fn):
        return fn()

    for _ in range(warmup):
        run_step(objective, batch, untimed, optimizer)
    clock = PhaseClock(device)
    for _ in range(steps):
        run_step(objective, batch, clock, optimizer)
    ms = {phase: total / steps for phase, total in clock.ms().items()}
    del objective, optimizer, batch
    counted = flops_by_step(cfg, micro, warmup + steps, dtype)[warmup:]
    gflop = {phase: sum(s[phase] for s in counted) / steps / 1e9 for phase in PHASES}
    return {"ms": ms, "gflop_per_image": gflop, "step_ms": sum(ms.values()),
            "step_gflop_per_image": sum(gflop.values()), "micro_batch": micro, "steps": steps}


def with_floors(rows: dict[str, dict], peak_tflops: float | None) -> dict[str, dict]:
    """Adds to each method's row: TFLOP/s per phase, each phase's floor at `peak_tflops` (None
    without a known GPU) and the step's ratios to MAE's, measured and counted."""
    for row in rows.values():
        micro = row["micro_batch"]
        row["tflops"] = {p: (row["gflop_per_image"][p] * micro / row["ms"][p] if row["ms"][p] > 0 else 0.0)
                         for p in PHASES}
        if peak_tflops:
            row["floor_ms"] = {p: row["gflop_per_image"][p] * micro / peak_tflops for p in PHASES}
    if "mae" in rows:
        mae = rows["mae"]
        for row in rows.values():
            row["over_mae_measured"] = (row["step_ms"] / row["micro_batch"]) / (mae["step_ms"] / mae["micro_batch"])
            row["over_mae_counted"] = row["step_gflop_per_image"] / mae["step_gflop_per_image"]
    return rows


def markdown(rows: dict[str, dict]) -> str:
    lines = [("| method | forward ms | backward ms | optimizer ms | after-step ms | step ms | step TFLOP/s "
              "| over mae, measured | over mae, counted |"), "|---|---|---|---|---|---|---|---|---|"]
    for method, r in rows.items():
        step_tflops = r["step_gflop_per_image"] * r["micro_batch"] / r["step_ms"]
        ratios = (f"{r['over_mae_measured']:.2f}x | {r['over_mae_counted']:.2f}x" if "over_mae_measured" in r
                  else "- | -")
        lines.append(f"| {method} | " + " | ".join(f"{r['ms'][p]:.1f}" for p in TIMED)
                     + f" | {r['step_ms']:.1f} | {step_tflops:.1f} | {ratios} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=["mae", "mlomae", "energy"],
                   help="methods to time; MAE among them gives the ratios (default: %(default)s)")
    p.add_argument("--micro", type=int, default=64, help="images per micro-batch (default: %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first (default: %(default)s)")
    p.add_argument("--device", default="cuda", help="cuda or cpu (default: %(default)s)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--debug", action="store_true", help="the debug presets (the tiny model a CPU runs)")
    p.add_argument("--markdown", action="store_true", help="a markdown table instead of lines")
    a = p.parse_args(argv)
    for name in ("micro", "steps"):
        if getattr(a, name) < 1:
            refuse(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0:
        refuse(f"--warmup must be >= 0, got {a.warmup}")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        refuse("no CUDA device here; pass --device cpu --debug (the tiny presets a CPU runs)")
    if device.type == "cpu" and not a.debug:
        refuse("the ViT-B presets take hours per step on a CPU; pass --debug with --device cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    rows = {m: phase_times(config_of(m, a.debug), a.micro, a.steps, a.warmup, dtype, device) for m in a.methods}
    gpu = current_gpu() if device.type == "cuda" else None
    rows = with_floors(rows, gpu.peak_tflops if gpu and dtype == torch.bfloat16 else None)
    if a.markdown:
        print(markdown(rows))
    else:
        for method, r in rows.items():
            print(f"{method:8s} " + "  ".join(f"{k} {v:.2f} ms" for k, v in r["ms"].items()) + f"  step {r['step_ms']:.2f} ms")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
