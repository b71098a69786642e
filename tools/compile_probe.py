"""Eager blocks against run.compile's, one GPU: step time, device time per step, kernels per step
and the kernels with the most device time, for MAE at 224 in bf16 through the engine (one rank,
no wrapper) on synthetic images.

    python -m tools.compile_probe eager|compiled|compiled_no_graphs [--model vit_base_patch16] [--micro 128]
    python -m tools.compile_probe equality [--precision bf16|fp32] [--accum N] [--steps 12] [--micro 64]

`compiled` is what `--run.compile true` does on one GPU (train/run/build.py `uses_cuda_graphs`: the
compiled blocks replay as CUDA graphs); `compiled_no_graphs` is what it does on FSDP2's sharded
stages. `equality` trains eager and compiled blocks (as CUDA graphs) from the same weights, images
and masks and compares each step's loss. Prints its findings; one process per variant, so each compiles from a fresh cache
(inductor's on-disk cache aside). docs/PERFORMANCE.md "Compiling the blocks on one H200".
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from data.cli import Parser, refuse
from train.config.ds_config import resolve
from train.config.options import encoder_img_size
from train.config.parsing import parse_args
from train.engine.execution import apply_execution_options
from train.run.build import build_engine

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("eager", "compiled", "compiled_no_graphs")
STEPS = 12  # trained by `equality`
WARMUP, TIMED, PROFILED = 8, 20, 3


def engine_for(variant: str, model: str, micro: int, precision: str = "bf16", accum: int = 1,
               device: torch.device | None = None, preset: list[str] = (), options: list[str] = ()):
    """The engine of MAE on `model` (or the `preset`'s) at `micro` images x `accum` micro-batches,
    one rank, the H100 ZeRO-1 file's settings in `precision` (bf16 | fp32), with `options` of
    train/pretrain.py on top; and its configuration."""
    device = device or torch.device("cuda")
    ds = json.loads((REPO / "ds_configs" / "vit_b_8xh100_bf16_zero1.json").read_text())
    ds.update(train_batch_size=micro * accum, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum)
    ds["bf16"] = {"enabled": precision == "bf16"}
    ds_file = Path(tempfile.mkdtemp()) / "ds.json"
    ds_file.write_text(json.dumps(ds))
    cfg = parse_args(["--ds_config", str(ds_file), "--data.source", "synthetic",
                      *(preset or ["--model.name", model]), *options])
    ds_config, _ = resolve(cfg, 1)
    engine, objective, _ = build_engine(cfg, ds_config, device, 1e-4, 10, 1000)
    if variant != "eager":  # what run.compile applies, with or without the CUDA graphs
        engine.cuda_graphs = variant == "compiled"
        apply_execution_options(objective, recompute=False, compile_blocks=True, cuda_graphs=engine.cuda_graphs)
    return engine, cfg


def loss_curve(variant: str, model: str, micro: int, steps: int, precision: str = "bf16", accum: int = 1,
               device: torch.device | None = None, preset: list[str] = (), options: list[str] = (),
               seed: int = 0) -> list[float]:
    """Each optimizer step's mean loss over its micro-batches, from the same weights, images and
    mask draws for a `seed` whatever the variant: what compiled blocks (and their CUDA graphs) must
    reproduce; another seed draws other weights, images and masks."""
    device = device or torch.device("cuda")
    engine, cfg = engine_for(variant, model, micro, precision, accum, device, preset, [*options, "--seed", str(seed)])
    shape = (micro, cfg.model.in_chans, encoder_img_size(cfg), encoder_img_size(cfg))
    images = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed + 1)  # the masks: drawn on the device from its default generator
    losses = []
    for _ in range(steps):
        total = torch.zeros((), device=device)
        for _ in range(accum):
            batch = {"image": torch.randn(shape, generator=images).to(device, engine.dtype)}
            if engine.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            loss = engine(batch)["loss"]
            engine.backward(loss)
            total += loss.detach().float()
        engine.step()
        losses.append(total / accum)
    return [x.item() for x in losses]


def equality(model: str, micro: int, steps: int, precision: str, accum: int) -> dict:
    """Eager against compiled blocks replayed as CUDA graphs: per-step losses, the largest relative
    difference, and whether it is within the tolerance (fp32 1e-3, bf16 2e-2: fused kernels round
    differently, and the difference grows with the steps trained)."""
    curves = {}
    for variant in ("eager", "compiled"):
        curves[variant] = loss_curve(variant, model, micro, steps, precision, accum)
        torch.cuda.empty_cache()
    worst = max(abs(c - e) / abs(e) for e, c in zip(curves["eager"], curves["compiled"]))
    tolerance = 1e-3 if precision == "fp32" else 2e-2
    return {"model": model, "micro_batch": micro, "accum": accum, "precision": precision, "steps": steps,
            "losses": curves, "max_relative_difference": worst, "tolerance": tolerance, "equal": worst <= tolerance}


def float8_curves(model: str, micro: int, steps: int, variant: str = "compiled",
                  device: torch.device | None = None, preset: list[str] = ()) -> dict:
    """run.float8 against bf16 over `steps` steps: the gap between float8's curve and bf16's from
    the same seed, beside the gap between two bf16 curves of different seeds (bf16's own noise),
    each the mean absolute difference over the last quarter of the steps."""
    run = functools.partial(loss_curve, variant, model, micro, steps, "bf16", 1, device, preset)
    curves = {"bf16_seed0": run(seed=0), "bf16_seed1": run(seed=1), "float8_seed0": run(["--run.float8", "true"], seed=0)}

    def gap(a: list[float], b: list[float]) -> float:
        tail = slice(len(a) - max(1, len(a) // 4), None)
        return sum(abs(x - y) for x, y in zip(a[tail], b[tail])) / len(a[tail])

    float8_gap, seed_gap = gap(curves["float8_seed0"], curves["bf16_seed0"]), gap(curves["bf16_seed1"], curves["bf16_seed0"])
    return {"model": model, "micro_batch": micro, "steps": steps, "variant": variant, "losses": curves,
            "float8_gap": float8_gap, "seed_gap": seed_gap, "within_bf16_noise": float8_gap <= seed_gap}


def main(argv: list[str] | None = None) -> dict:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("variant", choices=(*VARIANTS, "equality"))
    p.add_argument("--model", default="vit_base_patch16")
    p.add_argument("--micro", type=int, default=None, help="images per micro-batch (default 128; equality: 64)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="equality's")
    p.add_argument("--accum", type=int, default=1, help="equality's micro-batches per step")
    p.add_argument("--steps", type=int, default=STEPS, help="equality's optimizer steps")
    a = p.parse_args(argv)
    if min(a.micro or 1, a.accum, a.steps) < 1:
        refuse(f"--micro, --accum and --steps must be >= 1, got {a.micro}, {a.accum} and {a.steps}")
    if not torch.cuda.is_available():
        refuse("tools.compile_probe measures a GPU's step; this machine has no CUDA device")
    if a.variant == "equality":
        result = equality(a.model, a.micro or 64, a.steps, a.precision, a.accum)
        print(json.dumps(result, indent=1))
        return result
    a.micro = a.micro or 128
    from torch.profiler import ProfilerActivity, profile

    engine, _ = engine_for(a.variant, a.model, a.micro)
    images = torch.randn(a.micro, 3, 224, 224, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        if engine.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        engine.backward(engine({"image": images})["loss"])
        engine.step()

    start = time.perf_counter()
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(TIMED):
        step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / TIMED
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    result = {"variant": a.variant, "model": a.model, "micro_batch": a.micro, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "warmup_s": warmup_s, "step_ms": step_s * 1e3,
              "images_per_s": a.micro / step_s,
              "device_ms_per_step": sum(e.self_device_time_total for e in kernels) / PROFILED / 1e3,
              "kernels_per_step": sum(e.count for e in kernels) / PROFILED,
              "top_kernels": [(e.key[:120], e.self_device_time_total / PROFILED / 1e3, e.count / PROFILED)
                              for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:14]]}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
