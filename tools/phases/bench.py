"""Phase `bench`: MAE ViT-B/L, ours (train/bench.py) alternating with the plain-PyTorch baseline
(tools/mae_baseline.py); MFU, peak memory vs the dry run, activation checkpointing, the largest
micro-batch, compile; then the attribution of each variant of the step (tools/profile_step.py:
device busy fraction, kernels per step, the kernels with the most time, host time per step, the
longest idle gaps): the engine against DeepSpeed's with the settings it shipped before
(tools/deepspeed_step.py), micro-batches 128 / 256 / 512, run.compile off and on, and the baseline; one
gzipped trace of the engine's step."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from tools.gpu_check import Check, free_memory
from tools.phases.common import (
    CPU_DEBUG_DS,
    DEBUG_PRESET,
    TARGETS,
    ds_config,
    our_bench,
    own_peak_gib,
)

# What CUDA says when a run needs more memory than the device has: the caching allocator raises
# torch.OutOfMemoryError, but an allocation inside a kernel launch or cuBLAS's workspace surfaces as
# a plain RuntimeError with one of these
OOM_MESSAGES = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDA out of memory")


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` says the device ran out of memory (any of CUDA's ways of saying it)."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError)
                                                     and any(m in str(e) for m in OOM_MESSAGES))


def baseline_run(check: Check, argv: list[str], steps: int, warmup: int, dtype: torch.dtype) -> dict:
    """The plain-PyTorch MAE (tools/mae_baseline.py) with the same model, MAE settings, micro-batch
    and synthetic data as train/bench.py's run of `argv`; on the GPU with fused AdamW, the fastest
    plain loop (as the engine's), recorded under "optimizer"."""
    from tools.census import baseline_model
    from tools.mae_baseline import time_training
    from train.bench import split_argv
    from train.config.ds_config import resolve
    from train.config.parsing import parse_args

    _, rest = split_argv(argv)
    cfg = parse_args(rest)
    micro = resolve(cfg, 1)[1].micro
    model, data = baseline_model(cfg, {}, micro, check.device)
    try:
        return {**time_training(model, data, steps, warmup, dtype, check.device, fused=True if check.cuda else None),
                "micro_batch": micro}
    finally:
        del model
        free_memory()

def run(check: Check, a) -> None:
    from train.config.parsing import parse_args
    from train.estimate.dry_run import check as dry_run
    from train.estimate.gpus import current_gpu

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
                       # the mean, as the compile phase's summary; None where the GPU's peak is unknown (CPU)
                       mfu=statistics.fmean(v["mfu"] for v in ours) if all(v.get("mfu") is not None for v in ours)
                       else None,
                       # each run's own peak (what earlier items left allocated taken off: the dry run
                       # estimates a process of its own), beside the largest allocated and resident
                       peak_gib=max(own_peak_gib(v) or 0.0 for v in ours) or None,
                       peak_allocated_gib=max(v.get("peak_allocated_gib") or 0.0 for v in ours) or None,
                       resident_gib_before=max(v.get("resident_gib_before") or 0.0 for v in ours))
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
    attribution_items(check)

def attribution_items(check: Check) -> None:
    """The profiled variants (module docstring), each an item with its tools/profile_step.py summary."""
    from tools import census
    from tools.profile_step import attribution
    from train.config.ds_config import BatchPlan
    from train.config.plan import peak_lr

    if check.cuda:
        model, micros, steps = ["--model.name", "vit_base_patch16"], (128, 256, 512), 5
        traced = 256
    else:
        model, micros, steps = ["--config", str(DEBUG_PRESET)], (8,), 2
        traced = 8

    def argv(micro: int, *extra: str) -> list[str]:
        return ["--ds_config", str(ds_config(check, f"attribution_{micro}", micro)), *model, "--data.source",
                "synthetic", *extra]

    def profiled(subject_of, micro: int, trace: bool = False, compiled: bool = False) -> dict:
        cfg, arch = census.narrowed(argv(micro), 0)
        subject = subject_of(cfg, arch, micro)
        trace_path = check.path.with_name(check.path.stem + "_trace.json.gz") if trace else None
        try:
            return {"micro_batch": micro, **attribution(subject, steps, check.device, trace_path, compiled)}
        finally:
            del subject
            free_memory()

    def ours(cfg, arch, micro):
        return census.our_subject(cfg, arch)[0]

    def baseline(cfg, arch, micro):
        dtype = torch.bfloat16 if check.cuda else torch.float32
        return census.baseline_subject(cfg, arch, micro, dtype, check.device, fused=True)

    def deepspeed(cfg, arch, micro):
        ds = json.loads(Path(cfg.ds_config).read_text())  # tools/deepspeed_step.py adds DeepSpeed's old settings
        ds.update(gradient_accumulation_steps=1)
        info = {"ds_config": ds, "batch": {"micro": micro, "accum": 1, "world": 1},
                "peak_lr": peak_lr(cfg, BatchPlan(micro, 1, 1))}  # ours at the same batch
        return census.deepspeed_subject(cfg, arch, info, check.device)

    for micro in micros:
        check.item(f"attribution_ours_micro{micro}", 60, lambda: profiled(ours, micro, trace=micro == traced))
    first = micros[0]
    check.item(f"attribution_baseline_micro{first}", 45, lambda: profiled(baseline, first))
    if check.cuda:
        check.item(f"attribution_deepspeed_old_defaults_micro{first}", 90, lambda: profiled(deepspeed, first))
        check.item(f"attribution_ours_compile_micro{traced}", 180, lambda: profiled(
            lambda cfg, arch, m: census.our_subject(census.narrowed(argv(m, "--run.compile", "true"), 0)[0], arch)[0],
            traced, compiled=True))
    else:
        check.skip(f"attribution_deepspeed_old_defaults_micro{first}",
                   "DeepSpeed's engine on the CPU first compiles its shared-memory collectives (minutes): GPU only")
        check.skip(f"attribution_ours_compile_micro{traced}", "torch.compile is measured on the GPU only (CPU smoke)")
    rows = {name.removeprefix("attribution_"): {k: v.get(k) for k in ("micro_batch", "wall_ms_per_step",
                                                                      "host_ms_per_step", "device_busy_fraction",
                                                                      "kernels_per_step")}
            for name, v in check.record["items"].items() if name.startswith("attribution_") and "steps" in v}
    check.record["summary"]["attribution"] = rows
    check.save()


def largest_micro(check: Check, key: str, model: str, micro: int, summary: dict) -> dict:
    """Peak memory at 2x the micro-batch beside the eager run's gives the per-sample slope; the
    micro-batch predicted to fill 90% of the GPU (the dry run's headroom) is then run for 3 steps.
    Every peak is the run's own (common.own_peak_gib), so the two points and the prediction are
    those of a process of its own whatever earlier items left allocated."""
    def run(m: int) -> dict:
        argv = ["--ds_config", str(ds_config(check, f"largest_{key}_{m}", m)), "--model.name", model,
                "--data.source", "synthetic", "--steps", "2", "--warmup", "1"]
        return our_bench(check, argv)

    p1 = summary.get(key, {}).get("peak_gib") or own_peak_gib(run(micro))
    p2 = own_peak_gib(run(2 * micro))
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    out: dict = {"peak_gib_at": {micro: p1, 2 * micro: p2}, "device_gib": total}
    summary.setdefault(key, {})["measured_largest_micro"] = None
    if p2 <= p1:  # no growth with the batch: no slope to extrapolate (a zero or negative micro-batch)
        out.update(predicted_largest_micro=None, fits=None,
                   not_predicted=f"the peak at micro-batch {2 * micro} ({p2:.2f} GiB) is not above the one at "
                                 f"{micro} ({p1:.2f} GiB): no memory per sample to predict from")
        return out
    slope = (p2 - p1) / micro
    predicted = int((0.9 * total - (p1 - slope * micro)) // slope)
    out.update(gib_per_sample=slope, predicted_largest_micro=predicted)
    if predicted < 1:
        out.update(fits=None, not_predicted=f"even micro-batch 1 is predicted past 90% of the {total:.1f} GiB")
        return out
    try:
        largest = run(predicted)
        out.update(peak_gib_at_predicted=own_peak_gib(largest), resident_gib_before=largest.get("resident_gib_before"),
                   fits=True, **{k: largest.get(k) for k in ("images_per_s", "mfu")})  # 2 steps: a rough rate
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        if not out_of_memory(e):
            raise
        out["fits"], out["oom"] = False, str(e)[:200]
    free_memory()  # after the handler: its traceback (and the engine in its frames) is gone by now
    summary[key]["measured_largest_micro"] = predicted if out["fits"] else None
    return out
