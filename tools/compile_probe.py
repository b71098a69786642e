"""Eager blocks against run.compile's, one GPU: step time, device time per step, kernels per step
and the kernels with the most device time, for MAE at 224 in bf16 through the engine (one rank,
no wrapper) on synthetic images.

    python -m tools.compile_probe eager|compiled|compiled_no_graphs [--model vit_base_patch16] [--micro 128]

`compiled` is what `--run.compile true` does on one GPU (train/run/build.py `uses_cuda_graphs`: the
compiled blocks replay as CUDA graphs); `compiled_no_graphs` is what it does on FSDP2's sharded
stages. Prints its findings; one process per variant, so each compiles from a fresh cache
(inductor's on-disk cache aside). docs/PERFORMANCE.md "Compiling the blocks on one H200".
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from data.cli import Parser, refuse
from train.config.ds_config import resolve
from train.config.options import parse_args
from train.engine.execution import apply_execution_options
from train.run.build import build_engine

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("eager", "compiled", "compiled_no_graphs")
WARMUP, TIMED, PROFILED = 8, 20, 3


def engine_for(variant: str, model: str, micro: int):
    """The engine of MAE on `model` at `micro` images, one rank, the H100 ZeRO-1 file's settings."""
    ds = json.loads((REPO / "ds_configs" / "vit_b_8xh100_bf16_zero1.json").read_text())
    ds.update(train_batch_size=micro, train_micro_batch_size_per_gpu=micro)
    ds_file = Path(tempfile.mkdtemp()) / "ds.json"
    ds_file.write_text(json.dumps(ds))
    cfg = parse_args(["--ds_config", str(ds_file), "--model.name", model, "--data.source", "synthetic"])
    ds_config, _ = resolve(cfg, 1)
    engine, objective, _ = build_engine(cfg, ds_config, torch.device("cuda"), 1e-4, 10, 1000)
    if variant != "eager":  # what run.compile applies, with or without the CUDA graphs
        engine.cuda_graphs = variant == "compiled"
        apply_execution_options(objective, recompute=False, compile_blocks=True, cuda_graphs=engine.cuda_graphs)
    return engine


def main(argv: list[str] | None = None) -> dict:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("variant", choices=VARIANTS)
    p.add_argument("--model", default="vit_base_patch16")
    p.add_argument("--micro", type=int, default=128)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        refuse("tools.compile_probe measures a GPU's step; this machine has no CUDA device")
    from torch.profiler import ProfilerActivity, profile

    engine = engine_for(a.variant, a.model, a.micro)
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
