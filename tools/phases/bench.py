"""Phase `bench`: MAE ViT-B/L, ours (train/bench.py) alternating with the plain-PyTorch baseline
(tools/mae_baseline.py); MFU, peak memory vs the dry run, activation checkpointing, the largest
micro-batch, compile."""
from __future__ import annotations

import statistics

import torch

from tools.gpu_check import Check, free_memory
from tools.phases.common import (
    CPU_DEBUG_DS,
    DEBUG_PRESET,
    TARGETS,
    ds_config,
    our_bench,
)


def baseline_run(check: Check, argv: list[str], steps: int, warmup: int, dtype: torch.dtype) -> dict:
    """The plain-PyTorch MAE (tools/mae_baseline.py) with the same model, MAE settings, micro-batch
    and synthetic data as train/bench.py's run of `argv`."""
    from data.synthetic import SyntheticImages
    from model.registry import model_arch
    from tools.mae_baseline import BaselineMAE, time_training
    from train.bench import split_argv
    from train.config import parse_args
    from train.ds_config import resolve

    _, rest = split_argv(argv)
    cfg = parse_args(rest)
    micro = resolve(cfg, 1)[1].micro
    arch = model_arch(cfg.model.name)
    img = cfg.model.img_size or arch["img_size"]
    torch.manual_seed(0)
    model = BaselineMAE(img, arch["patch_size"], cfg.model.in_chans, arch["embed_dim"], arch["depth"],
                        arch["num_heads"], cfg.mae.decoder_dim, cfg.mae.decoder_depth, cfg.mae.decoder_heads,
                        cfg.mae.mask_ratio, cfg.mae.norm_pix_loss).to(check.device)
    data = SyntheticImages(micro, img, cfg.model.in_chans, 10, cfg.seed, 0, check.device)
    try:
        return {**time_training(model, data, steps, warmup, dtype, check.device), "micro_batch": micro}
    finally:
        del model
        free_memory()

def run(check: Check, a) -> None:
    from train.config import parse_args
    from train.dry_run import check as dry_run
    from train.gpus import current_gpu

    gpu = current_gpu() if check.cuda else None
    if check.cuda:
        models = [("vit_b", "vit_base_patch16", 128, 40), ("vit_l", "vit_large_patch16", 128, 70)]
        timed, rounds, dtype = (15, 5), 2, torch.bfloat16
    else:
        models = [("debug", None, 8, 0)]
        timed, rounds, dtype = (2, 1), 2, torch.float32
    steps = ["--steps", str(timed[0]), "--warmup", str(timed[1])]  # train/bench.py's; the baseline runs the same
    summary = check.record["summary"]
    summary["targets"] = {k: TARGETS[k] for k in ("mae_vit_b_over_baseline_images_per_s", "mae_vit_l_mfu")}

    def argv_for(key: str, model: str | None, micro: int) -> list[str]:
        if model is None:
            return ["--ds_config", str(CPU_DEBUG_DS), "--config", str(DEBUG_PRESET), "--data.source", "synthetic"]
        return ["--ds_config", str(ds_config(check, f"bench_{key}_{micro}", micro)), "--model.name", model,
                "--data.source", "synthetic"]

    # 1. ours and the baseline alternating, every model (the headline ratio), then the variants
    for key, model, micro, est in models:
        argv = argv_for(key, model, micro)
        for r in range(rounds):
            check.item(f"{key}_ours_r{r}", est, lambda: our_bench(check, [*argv, *steps]))
            check.item(f"{key}_baseline_r{r}", est * 0.7,
                       lambda: baseline_run(check, argv, *timed, dtype))
        ours = [v for k, v in check.record["items"].items() if k.startswith(f"{key}_ours_r") and "images_per_s" in v]
        base = [v for k, v in check.record["items"].items() if k.startswith(f"{key}_baseline_r")
                and "images_per_s" in v]
        row: dict = {"micro_batch": micro}
        if ours:
            row.update(ours_images_per_s=statistics.fmean(v["images_per_s"] for v in ours),
                       tflops_per_gpu=statistics.fmean(v["tflops_per_gpu"] for v in ours),
                       mfu=ours[-1]["mfu"], peak_gib=max(v.get("peak_allocated_gib", 0.0) for v in ours) or None)
            if check.cuda and gpu is not None:
                cfg = parse_args(argv)
                est_mem = dry_run(cfg, 1, gpu).memory
                if est_mem is not None:
                    row.update(estimate_gib=est_mem.total / 2**30, estimate_largest_micro=est_mem.largest_micro(gpu))
                    if row.get("peak_gib"):
                        row["estimate_over_peak"] = row["estimate_gib"] / row["peak_gib"]
        if base:
            row["baseline_images_per_s"] = statistics.fmean(v["images_per_s"] for v in base)
        if ours and base:
            row["ours_over_baseline"] = row["ours_images_per_s"] / row["baseline_images_per_s"]
        summary[key] = row
        check.save()
    if check.cuda:
        check.item("vit_b_baseline_fp16_gradscaler", 30,
                   lambda: baseline_run(check, argv_for("vit_b", "vit_base_patch16", 128), 15, 5, torch.float16))
    # 2. activation checkpointing on (every model), 3. the largest micro-batch (GPU), 4. compile (GPU)
    for key, model, micro, est in models:
        check.item(f"{key}_ours_activation_checkpointing", est * 1.3,
                   lambda: our_bench(check, [*argv_for(key, model, micro), *steps, "--activation_checkpointing", "on"]))
    for key, model, micro, est in models:
        if not check.cuda:
            check.skip(f"{key}_largest_micro", "needs CUDA (CPU smoke)")
            continue
        check.item(f"{key}_largest_micro", est * 2.5, lambda: largest_micro(check, key, model, micro, summary))
    for key, model, micro, est in models:
        if not check.cuda:
            check.skip(f"{key}_ours_compile", "torch.compile is measured on the GPU only (CPU smoke)")
            continue
        check.item(f"{key}_ours_compile", est + 120,
                   lambda: our_bench(check, [*argv_for(key, model, micro), *steps, "--run.compile", "true"]))
    for key, *_ in models:
        for variant in ("activation_checkpointing", "compile"):
            v = check.record["items"].get(f"{key}_ours_{variant}", {})
            if "images_per_s" in v and summary.get(key, {}).get("ours_images_per_s"):
                summary[key][f"{variant}_over_eager"] = v["images_per_s"] / summary[key]["ours_images_per_s"]
    check.save()

def largest_micro(check: Check, key: str, model: str, micro: int, summary: dict) -> dict:
    """Peak memory at 2x the micro-batch beside the eager run's gives the per-sample slope; the
    micro-batch predicted to fill 90% of the GPU (the dry run's headroom) is then run for 3 steps."""
    def peak(m: int) -> float:
        argv = ["--ds_config", str(ds_config(check, f"largest_{key}_{m}", m)), "--model.name", model,
                "--data.source", "synthetic", "--steps", "2", "--warmup", "1"]
        return our_bench(check, argv)["peak_allocated_gib"]

    p1, p2 = summary.get(key, {}).get("peak_gib") or peak(micro), peak(2 * micro)
    slope = (p2 - p1) / micro
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    predicted = int((0.9 * total - (p1 - slope * micro)) // slope)
    out = {"peak_gib_at": {micro: p1, 2 * micro: p2}, "gib_per_sample": slope, "device_gib": total,
           "predicted_largest_micro": predicted}
    try:
        out["peak_gib_at_predicted"] = peak(predicted)
        out["fits"] = True
    except torch.OutOfMemoryError as e:
        out["fits"], out["oom"] = False, str(e)[:200]
    free_memory()  # after the handler: its traceback (and the engine in its frames) is gone by now
    summary.setdefault(key, {})["measured_largest_micro"] = predicted if out["fits"] else None
    return out
