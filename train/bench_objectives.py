"""Training-step time of a method against its baseline, same batch, same run: forward (autocast),
backward, a fused AdamW step and the objective's after_optimizer_step, on one device without the
engine (kernels/bench.py times the attention kernels alone; train/bench.py the whole engine).

    python -m train.bench_objectives                         # GPU: ViT-B/16, batch 128, bf16, both pairs
    python -m train.bench_objectives --dtype fp16 --pairs mixedae
    python -m train.bench_objectives --device cpu --dtype fp32 --pairs adpe --model vit_mini_patch4 --batch 64

Pairs:
  mixedae   MAE vs MixedAE (full-size images)
  adpe      MAE+ with iRPE vs AdPE RPE-coord (4 crops of half the model's image size)
Ratio: "<method>_over_<baseline>" = time(method) / time(baseline). JSON to runs/bench/ (--out_dir DIR:
there; --record: benchmarks/results/, the committed records).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import time
from pathlib import Path

import torch

from data.progress import Progress
from kernels.bench import (
    DTYPES,
    SHOW_DEFAULT,
    OneLineParser,
    add_timing_options,
    out_dir_of,
    record_header,
    sync,
    write_record,
)
from model.objectives import build_objective
from model.objectives.mae import MAEConfig
from model.objectives.maeplus import MAEPlusConfig
from model.objectives.mixedae import MixedAEConfig
from model.registry import create_model, list_models, model_arch
from train.config.errors import ConfigError
from train.estimate.cpu_time import check_cpu_time

PAIRS = ("mixedae", "adpe")


def time_training_step(objective, images: torch.Tensor, dtype: torch.dtype, device: torch.device, iters: int,
                       warmup: int, progress: Progress | None = None) -> float:
    """Mean milliseconds of forward (autocast), backward, a fused AdamW step and the objective's
    after_optimizer_step (AdPE's PGD step), as the loop runs them for one micro-batch per step;
    `progress` counts the steps (a host-side counter: no device read)."""
    opt = torch.optim.AdamW(objective.parameters(), lr=1e-4, fused=device.type == "cuda")
    batch = {"image": images}

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = objective(batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        objective.after_optimizer_step(1e-4, [batch])
        if progress is not None:
            progress.update()

    for _ in range(warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    return (time.perf_counter() - start) * 1000 / iters


def pair_runs(pair: str, model: str, batch: int, device: torch.device | str) -> tuple[dict, torch.Tensor]:
    """(label -> (objective name, its config, model overrides) of the pair's baseline and method,
    the images both train on)."""
    size = model_arch(model)["img_size"]
    if pair == "mixedae":
        runs = {"mae": ("mae", MAEConfig(), {}),
                "mixedae": ("mixedae", MixedAEConfig(cell_size=2 * model_arch(model)["patch_size"]), {})}
        return runs, torch.randn(batch, 3, size, size, device=device)
    size //= 2
    runs = {"maeplus_rpe": ("maeplus", MAEPlusConfig(rpe=True), {"rpe": True, "img_size": size}),
            "adpe_rpe_coord": ("maeplus", MAEPlusConfig(rpe=True, adversary="rpe_coord"),
                               {"rpe": True, "img_size": size})}
    return runs, torch.randn(batch, 4, 3, size, size, device=device)


def train_flops(pairs: list[str], model: str, batch: int, steps: int) -> float:
    """Matmul FLOPs of `steps` training steps of every objective of the pairs (train/estimate/costs.py, on
    the meta device: nothing is computed)."""
    from train.estimate.costs import profile

    total = 0.0
    for pair in pairs:
        runs, images = pair_runs(pair, model, batch, "meta")
        for objective_name, cfg, overrides in runs.values():
            with torch.device("meta"):
                objective = build_objective(objective_name, create_model(model, **overrides), cfg)
            total += profile(objective, {"image": images}).train_flops * steps
    return total


def bench_pair(pair: str, dtype: torch.dtype, device: torch.device, batch: int, iters: int, warmup: int,
               model: str = "vit_base_patch16") -> dict:
    """Step time of the pair's baseline and method on the same images, and their ratio."""
    runs, images = pair_runs(pair, model, batch, device)
    out: dict = {}
    for label, (objective_name, cfg, overrides) in runs.items():
        torch.manual_seed(0)
        objective = build_objective(objective_name, create_model(model, **overrides), cfg).to(device)
        with Progress(f"{pair} {label}", warmup + iters, "steps") as progress:
            out[label] = {"ms": time_training_step(objective, images, dtype, device, iters, warmup, progress)}
        print(f"{pair} {label} {out[label]}")
        del objective
    base, method = list(runs)
    out[f"{method}_over_{base}"] = out[method]["ms"] / out[base]["ms"]
    return {"model": model, "batch": batch, "images": list(images.shape), "results": out}


def main(argv: list[str] | None = None) -> Path:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_timing_options(p, iters=10)
    p.add_argument("--pairs", nargs="+", choices=PAIRS, default=list(PAIRS),
                   help="methods timed against MAE" + SHOW_DEFAULT)
    p.add_argument("--batch", type=int, default=128, help="images per training step" + SHOW_DEFAULT)
    p.add_argument("--model", default="vit_base_patch16", help="a registered ViT" + SHOW_DEFAULT)
    p.add_argument("--allow_cpu", action="store_true",
                   help="run on a CPU what is estimated to take longer than 5 minutes there (refused otherwise)")
    a = p.parse_args(argv)
    out_dir = out_dir_of(p, a)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device; pass --device cpu (with a small --model)")
    if a.model not in list_models():
        p.error(f"--model {a.model} is not a registered ViT; choose one of {', '.join(list_models())}")
    if a.batch < 1:
        p.error(f"--batch must be >= 1, got {a.batch}")
    if device.type == "cpu":  # before anything is built: how long, or refused when sized for a GPU
        try:
            check_cpu_time(train_flops(a.pairs, a.model, a.batch, a.iters + a.warmup),
                           f"{' and '.join(a.pairs)} pairs on {a.model}, batch {a.batch}, {a.warmup} + {a.iters} steps "
                           f"each", a.allow_cpu, "give a smaller --model, --batch or --iters (e.g. --model "
                           "vit_mini_patch4 --batch 64)")
        except ConfigError as e:
            p.error(str(e))
    dtype = DTYPES[a.dtype]
    record = {**record_header(device, a.dtype, a.iters, a.warmup),
              "e2e": {pair: bench_pair(pair, dtype, device, a.batch, a.iters, a.warmup, a.model) for pair in a.pairs}}
    return write_record(record, out_dir, "objective_steps", device, a.dtype)


if __name__ == "__main__":
    main()
