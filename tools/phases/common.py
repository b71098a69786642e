"""What the phases share: the debug preset and ds_config, the targets docs/GPU.md reports against, a
ds_config written for one GPU, one run of train/bench.py, and the compact form of its result."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tools.gpu_check import REPO, Check, free_memory

DEBUG_PRESET = REPO / "train" / "configs" / "mae/debug.json"

CPU_DEBUG_DS = REPO / "ds_configs" / "cpu_debug.json"

TARGETS = {
    "mae_vit_b_over_baseline_images_per_s": ">= 1.5",
    "mae_vit_l_mfu": ">= 0.40",
    "topk_fused_speedup_vs_topk_torch": ">= 3 (forward+backward)",
    "topk_fused_over_dense": "<= 1.5",
    "mixedae_over_mae_step": "<= 1.03",
    "adpe_over_maeplus_step": "<= 1.015",
    "nvjpeg_images_per_s": ">= 5000",
}

def ds_config(check: Check, name: str, micro: int, precision: str = "bf16", stage: int = 1) -> Path:
    """A one-GPU ds_config (global batch = micro, no accumulation) from the shipped H100 file's settings."""
    shipped = json.loads((REPO / "ds_configs" / "vit_b_8xh100_bf16_zero1.json").read_text())
    ds = {k: v for k, v in shipped.items() if k not in ("gradient_accumulation_steps", "train_batch_size")}
    ds.update(train_micro_batch_size_per_gpu=micro, train_batch_size=micro)
    ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": stage}
    ds["bf16"], ds["fp16"] = {"enabled": precision == "bf16"}, {"enabled": precision == "fp16"}
    if precision == "fp16":
        ds["fp16"].update(loss_scale=0, initial_scale_power=16)  # dynamic loss scaling
    path = check.work / f"{name}.json"
    path.write_text(json.dumps(ds))
    return path

def our_bench(check: Check, argv: list[str], patch_torch_topk: bool = False) -> dict:
    """train/bench.py in this process; its record's results plus what the summary needs."""
    from train import bench

    out = check.work / "bench_records"
    resident = torch.cuda.memory_allocated() / 2**30 if check.cuda else None  # left over by earlier runs
    if check.cuda:
        torch.cuda.reset_peak_memory_stats()  # this run's peak, not an earlier item's
    restore = None
    if patch_torch_topk:  # MixedAE through the PyTorch TopK composition: the dispatch is told the kernel is out
        import importlib

        attention = importlib.import_module("kernels.attention")  # the module (the package exports a function of its name)
        restore = attention._fused_or_warn
        attention._fused_or_warn = lambda q: False
    try:
        path = bench.main([*argv, "--out_dir", str(out)])
    finally:
        if restore is not None:
            attention._fused_or_warn = restore
        free_memory()
    record = json.loads(Path(path).read_text())
    res = dict(record["results"])
    res.update(micro_batch=record["batch"]["micro"], dtype=record["dtype"], objective=record["config"]["objective"],
               model=record["config"]["model"]["name"], resident_gib_before=resident)
    if res.get("peak_allocated_gib") is not None:
        res["own_peak_gib"] = own_peak_gib(res)
    return res


def own_peak_gib(result: dict) -> float | None:
    """A run's peak allocated memory less what earlier runs had left allocated when it started
    (`resident_gib_before`): what a process of its own needs, the figure the dry run estimates.
    None where no CUDA peak was recorded."""
    peak = result.get("peak_allocated_gib")
    return None if peak is None else peak - (result.get("resident_gib_before") or 0.0)


def compact(result: dict) -> dict:
    """A study result without its loss curve (first and last points kept)."""
    out = {k: v for k, v in result.items() if k != "loss_curve"}
    curve = result.get("loss_curve") or []
    if curve:
        out["loss_first_last"] = [curve[0], curve[-1]]
    return out
