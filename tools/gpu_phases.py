"""The phases of tools/gpu_check.py. Each takes the phase's Check (record, budget, work folder,
log) and the parsed options, measures items in order of importance (what the budget cuts is
the end of the list) and fills check.record["summary"] with the numbers the README reports.

Estimates (`check.item(name, seconds, ...)`) are for one H100, generous; sizes are chosen so
that each phase takes 2-7 minutes there.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from tools.gpu_check import REPO, Check, drop_process_group_env, free_memory

DEBUG_PRESET = REPO / "train" / "configs" / "debug_mae.json"
CPU_DEBUG_DS = REPO / "ds_configs" / "cpu_debug.json"
CONFIGS = REPO / "train" / "configs"
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
    return res


# ------------------------------------------------------------------ tests


def tests(check: Check, a) -> None:
    summary = check.record["summary"]
    if check.cuda:
        model = ["--model.name", "vit_base_patch16"]
        micro, steps, resume_steps = 64, 50, 20
    else:
        model = ["--config", str(DEBUG_PRESET)]
        micro, steps, resume_steps = 8, 6, 4

    def pretrain(name: str, ds: Path, n_steps: int, extra: list[str] = ()) -> list[dict]:
        from train.pretrain import main as pretrain_main
        from train.run_dir import read_metrics

        run = check.work / name
        argv = ["--ds_config", str(ds), *model, "--data.source", "synthetic", "--data.epoch_size",
                str(n_steps * micro), "--optim.epochs", "1", "--optim.warmup_epochs", "0.2", "--run.log_every", "1",
                "--run.tensorboard", "false", "--run.progress", "false", "--run.export", "false",
                "--output_dir", str(run), *extra]
        try:
            pretrain_main(argv)
        finally:
            free_memory()
        return [r for r in read_metrics(run) if "loss" in r]

    def engine(name: str, precision: str, stage: int) -> dict:
        ds = ds_config(check, name, micro, precision, stage) if check.cuda else CPU_DEBUG_DS
        rows = pretrain(name, ds, steps)
        losses = [r["loss"] for r in rows]
        k = max(1, len(losses) // 5)
        first, last = statistics.fmean(losses[:k]), statistics.fmean(losses[-k:])
        out = {"precision": precision, "zero_stage": stage, "steps": len(losses), "loss_first": losses[0],
               "loss_last": losses[-1], "finite": all(math.isfinite(x) for x in losses),
               "decreasing": last < first, "mean_first_fifth": first, "mean_last_fifth": last,
               "skipped_steps": rows[-1].get("skipped_steps"), "loss_scale": rows[-1].get("loss_scale")}
        out["ok"] = out["finite"] and out["decreasing"] and out["steps"] == steps
        return out

    engines = [("fp16_zero2", "fp16", 2), ("bf16_zero1", "bf16", 1), ("bf16_zero2", "bf16", 2)]
    for name, precision, stage in engines:
        if check.cuda:
            check.item(f"engine_{name}", 60, lambda n=name, p=precision, s=stage: engine(n, p, s))
        else:
            check.skip(f"engine_{name}", "fp16/bf16 DeepSpeed engines need CUDA (CPU smoke)")
    if not check.cuda:  # the same measurement in fp32 on CPU, so the smoke test sees the plumbing work
        check.item("engine_fp32_cpu", 0, lambda: engine("fp32_cpu", "fp32", 2))

    def resume() -> dict:
        """bf16 ZeRO-1 (CPU: fp32): resume_steps straight vs half, checkpoint, resume for the other half."""
        ds = ds_config(check, "resume", micro, "bf16", 1) if check.cuda else CPU_DEBUG_DS
        half = resume_steps // 2
        straight = pretrain("straight", ds, resume_steps, ["--run.ckpt_every", str(10**6)])
        pretrain("resumed", ds, resume_steps, ["--run.ckpt_every", str(half), "--run.max_steps", str(half)])
        resumed = pretrain("resumed", ds, resume_steps, ["--run.ckpt_every", str(10**6), "--resume", "auto"])
        a = {r["step"]: r["loss"] for r in straight}
        b = {r["step"]: r["loss"] for r in resumed}
        after = [s for s in sorted(a) if s > half and s in b]
        diff = max((abs(a[s] - b[s]) / max(abs(a[s]), 1e-12) for s in after), default=float("nan"))
        return {"steps": resume_steps, "checkpoint_at": half, "compared_steps": len(after),
                "max_rel_loss_diff": diff, "bitwise_equal": all(a[s] == b[s] for s in after) and bool(after),
                "ok": bool(after) and len(after) == resume_steps - half and diff < 1e-2}

    check.item("resume_equality", 90, resume)

    def pytest_gpu() -> dict:
        junit = check.work / "junit.xml"
        paths = ["tests"] if check.cuda else ["tests/kernels/test_restricted_triton_gpu.py"]
        timeout = max(30.0, check.remaining() - 10)
        proc = check.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-ra",
                          f"--junitxml={junit}", *paths], timeout, {"PYTHONWARNINGS": "ignore"})
        return {"returncode": proc.returncode, **junit_summary(junit)}

    check.item("pytest_gpu", 240, pytest_gpu)
    fields = ("ok", "loss_first", "loss_last", "loss_scale", "skipped_steps", "max_rel_loss_diff", "bitwise_equal",
              "passed", "failed", "errors", "skipped", "error")
    summary.update({k: {f: v[f] for f in fields if f in v} for k, v in check.record["items"].items()})


def junit_summary(path: Path) -> dict:
    if not path.is_file():
        return {"error": "pytest wrote no junit report (see the log)"}
    root = ET.parse(path).getroot()
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skip_reasons": {}}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            node = case.find("failure") if case.find("failure") is not None else case.find("error")
            out["failed" if node.tag == "failure" else "errors"] += 1
            out["failures"].append({"test": name, "message": (node.get("message") or "")[:300]})
        elif case.find("skipped") is not None:
            out["skipped"] += 1
            reason = (case.find("skipped").get("message") or "")[:160]
            out["skip_reasons"][reason] = out["skip_reasons"].get(reason, 0) + 1
        else:
            out["passed"] += 1
    return out


# ------------------------------------------------------------------ bench


def baseline_run(check: Check, argv: list[str], steps: int, warmup: int, dtype: torch.dtype) -> dict:
    """The plain-PyTorch MAE (tools/mae_baseline.py) with the same model, MAE settings, micro-batch
    and synthetic data as train/bench.py's run of `argv`."""
    from data.synthetic import SyntheticImages
    from tools.mae_baseline import BaselineMAE, time_training
    from train.bench import split_argv
    from train.config import parse_args
    from train.ds_config import resolve
    from model.registry import model_arch

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


def bench(check: Check, a) -> None:
    from train.dry_run import check as dry_run
    from train.config import parse_args
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


# ------------------------------------------------------------------ methods


def methods(check: Check, a) -> None:
    summary = check.record["summary"]
    summary["targets"] = {k: TARGETS[k] for k in ("mixedae_over_mae_step", "adpe_over_maeplus_step",
                                                  "topk_fused_speedup_vs_topk_torch", "topk_fused_over_dense")}
    if check.cuda:
        base = ["--ds_config", "", "--data.source", "synthetic", "--steps", "10", "--warmup", "3"]
        base[1] = str(ds_config(check, "methods_64", 64))
        preset = {"mae": ["--model.name", "vit_base_patch16"], "mixedae": ["mixedae_vit_b.json"],
                  "maeplus": ["maeplus_vit_b.json", "adpe/maeplus_rpe.json"],
                  "adpe": ["maeplus_vit_b.json", "adpe/rpe_coord.json"], "mlomae": ["mlomae_vit_b.json"],
                  "energy": ["energy_vit_b.json"]}
        rounds, est = 2, 30
    else:
        base = ["--ds_config", str(CPU_DEBUG_DS), "--data.source", "synthetic", "--steps", "1", "--warmup", "0"]
        # every debug preset goes on top of debug_mae.json (the debug model and data), as the tests use them
        preset = {"mae": ["debug_mae.json"], "mixedae": ["debug_mae.json", "debug_mixedae.json"],
                  "maeplus": ["debug_mae.json", "debug_maeplus.json", "adpe/maeplus_rpe.json"],
                  "adpe": ["debug_mae.json", "debug_maeplus.json", "adpe/rpe_coord.json"],
                  "mlomae": ["debug_mae.json", "debug_mlomae.json"], "energy": ["debug_mae.json", "debug_energy.json"]}
        rounds, est = 1, 0

    def argv(method: str) -> list[str]:
        opts = preset[method]
        if opts[0].startswith("--"):
            return [*base, *opts]
        return [*base, *[x for p in opts for x in ("--config", str(CONFIGS / p))]]

    order = ["mae", "mixedae", "mixedae_torch_topk", "maeplus", "adpe", "mlomae", "energy"]
    for r in range(rounds):
        for method in (order if r % 2 == 0 else order[::-1]):  # alternate, so drift cancels between rounds
            name = method.replace("_torch_topk", "")
            check.item(f"{method}_r{r}", est, lambda m=method, n=name: our_bench(check, argv(n), m.endswith("torch_topk")))
    steps = {}
    for method in order:
        times = [v["step_time_s"] for k, v in check.record["items"].items()
                 if k.rsplit("_r", 1)[0] == method and "step_time_s" in v]
        if times:
            steps[method] = statistics.fmean(times)
    summary["step_time_s"] = steps
    ratios = {}
    for method, ref in [("mixedae", "mae"), ("mixedae_torch_topk", "mae"), ("adpe", "maeplus"), ("maeplus", "mae"),
                        ("mlomae", "mae"), ("energy", "mae"), ("mixedae_torch_topk", "mixedae")]:
        if method in steps and ref in steps:
            ratios[f"{method}_over_{ref}"] = steps[method] / steps[ref]
    summary["step_ratios"] = ratios
    check.save()

    def kernel_bench(dtype: str) -> dict:
        from kernels.bench import main as kbench

        opts = (["--dtype", dtype, "--shapes", "vit_b", "vit_l", "--iters", "20", "--warmup", "5"] if check.cuda else
                ["--device", "cpu", "--dtype", "fp32", "--shapes", "2,2,17,16", "--iters", "2", "--warmup", "1"])
        record = json.loads(Path(kbench([*opts, "--out_dir", str(check.work / "kernels")])).read_text())
        free_memory()
        return {"dtype": record["dtype"], "triton": record.get("triton"),
                "shapes": {k: {"ms": {n: r["ms"] for n, r in v["results"].items()}, "ratios": v["ratios"]}
                           for k, v in record["shapes"].items()}}

    for dtype in (("bf16", "fp16") if check.cuda else ("fp32",)):
        result = check.item(f"kernels_{dtype}", 60, lambda d=dtype: kernel_bench(d))
        if result and "shapes" in result:
            summary[f"kernels_{dtype}"] = {k: v["ratios"] for k, v in result["shapes"].items()}
    check.save()


# ------------------------------------------------------------------ loader


def loader(check: Check, a) -> None:
    from benchmarks.photo_shards import main as photo_shards
    from tools.photos import write_photos

    summary = check.record["summary"]
    summary["targets"] = {"nvjpeg_images_per_s": TARGETS["nvjpeg_images_per_s"]}
    cores = os.cpu_count() or 1
    if check.cuda:
        photos, size, count, per_shard, short = 24, (1600, 1200), 1600, 50, "333,500"
        workers, micro, batches, warm = cores, 256, 40, 8
    else:
        photos, size, count, per_shard, short = 3, (160, 120), 16, 4, "40,60"
        workers, micro, batches, warm = 2, 8, 3, 1  # micro: cpu_debug.json's
    shards = check.work / "shards"

    def make() -> dict:
        write_photos(check.work / "photos", photos, size)
        photo_shards([str(check.work / "photos"), str(shards), "--count", str(count), "--samples_per_shard",
                      str(per_shard), "--short_side", short])
        files = list((shards / "images").rglob("*.jpg"))
        return {"images": len(files), "mean_kb": sum(f.stat().st_size for f in files) / len(files) / 1024,
                "shards": len(list(shards.glob("*.tar")))}

    made = check.item("make_shards", 90, make)
    if not made or "images" not in made:
        return
    ds = ds_config(check, "loader", micro) if check.cuda else CPU_DEBUG_DS
    common = ["--ds_config", str(ds), "--data.source", "shards", "--data.train_index", str(shards / "train.json"),
              "--model.name", "vit_base_patch16", "--model.in_chans", "3", "--data.num_workers", str(workers),
              "--data.train_transform", "crop_flip",
              "--steps", str(batches), "--warmup", str(warm)]

    def cpu_loader(decode: str) -> dict:
        from train import bench

        path = bench.main(["--loader_only", *common, "--data.decode", decode, "--out_dir", str(check.work / "rec")])
        return json.loads(Path(path).read_text())["loader"]

    for decode in ("cpu", "cpu_draft"):
        check.item(f"decode_{decode}", 40, lambda d=decode: cpu_loader(d))
    check.item("decode_nvjpeg", 40, lambda: device_loader(check, common, batches, warm))
    for decode in ("cpu", "cpu_draft", "nvjpeg"):
        v = check.record["items"].get(f"decode_{decode}", {})
        if "images_per_s" in v:
            summary[f"{decode}_images_per_s"] = v["images_per_s"]
    summary.update(workers=workers, cpu_count=cores, jpeg_mean_kb=made["mean_kb"])
    check.save()


def device_loader(check: Check, common: list[str], batches: int, warmup: int) -> dict:
    """nvjpeg: the workers send JPEG bytes, the batch is decoded on the training device (CPU smoke:
    torchvision's libjpeg decode stands in; the same code path otherwise)."""
    import time

    from data.source import build_source
    from train.bench import split_argv
    from train.config import parse_args
    from train.ds_config import resolve

    _, rest = split_argv(common)
    cfg = parse_args([*rest, "--data.decode", "nvjpeg"])
    micro = resolve(cfg, 1)[1].micro
    data = build_source(cfg.data, 224, 3, micro, cfg.seed, 0, 1, check.device)
    for _ in range(warmup):
        next(data)
    sync = torch.cuda.synchronize if check.cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(data)
    sync()
    elapsed = time.perf_counter() - start
    shape = list(batch["image"].shape)
    del data
    free_memory()
    return {"images_per_s": batches * micro / elapsed, "batches": batches, "micro_batch": micro,
            "num_workers": cfg.data.num_workers, "batch_shape": shape, "batch_device": str(check.device),
            "decoder": "nvJPEG (torchvision decode_jpeg on CUDA)" if check.cuda else "libjpeg on CPU (smoke stand-in)"}


# ------------------------------------------------------------------ study


def fashion_mnist_dir(a) -> Path | None:
    """The first folder holding the idx files: --fashion_mnist, the carried runs/fashion-mnist, Debian's."""
    for d in (a.fashion_mnist, REPO / "runs" / "fashion-mnist", Path("/usr/share/datasets/fashion-mnist")):
        if d is not None and any((d / f"train-images-idx3-ubyte{gz}").is_file() for gz in ("", ".gz")):
            return d
    return None


def tiny_fashion_mnist(folder: Path, train: int = 160, test: int = 64) -> Path:
    """idx files of random 28x28 images in 10 classes (smoke only: the study's plumbing, not its result)."""
    import gzip
    import struct

    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", train), ("t10k", test)):
        labels = np.arange(n, dtype=np.uint8) % 10
        images = (rng.random((n, 28, 28)) * 60 + labels[:, None, None] * 19).astype(np.uint8)
        with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
            f.write(struct.pack(">HBBIII", 0, 8, 3, n, 28, 28) + images.tobytes())
        with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(struct.pack(">HBBI", 0, 8, 1, n) + labels.tobytes())
    return folder


def study(check: Check, a) -> None:
    from data.write_shards import main as write_shards

    summary = check.record["summary"]
    if check.cuda:
        src = fashion_mnist_dir(a)
        if src is None:
            check.skip("study", "Fashion-MNIST idx files not found: carry runs/fashion-mnist (README, 'GPU "
                       "validation') or pass --fashion_mnist DIR")
            return
        options = ["--seeds", "0", "--pretrain_samples", str(a.study_pretrain_samples), "--finetune_samples", "10000"]
        entries = ["mae", "mixedae", "maeplus", "adpe", "mlomae", "energy", "random_init"]
        est = 60
    else:
        src = tiny_fashion_mnist(check.work / "fashion-mnist")
        # the control entry: evaluation + one fine-tuning subprocess (pretraining subprocesses are the
        # study's own, tested in tests/train); the plumbing, shards and JSON are what the smoke checks
        options = ["--seeds", "0", "--pretrain_samples", "128", "--finetune_samples", "128"]
        entries, est = ["random_init"], 0
    shards = check.work / "fashion_mnist_shards"

    def make_shards() -> dict:
        write_shards(["fashion-mnist", str(shards), "--src", str(src), "--samples_per_shard", "2500"])
        return {"src": str(src), "train": json.loads((shards / "train.json").read_text())["num_samples"]}

    if not (check.item("shards", 60, make_shards) or {}).get("train"):
        return
    import train.study as study_module

    drop_process_group_env()  # the study's subprocesses must not join this process's group (its port is taken)
    original = study_module.fashion_mnist_shards
    study_module.fashion_mnist_shards = lambda: (shards / "train.json", shards / "test.json")
    out = check.work / "runs"
    try:
        for entry in entries:  # one entry per call, so the budget can stop between them
            check.item(entry, est, lambda e=entry: compact(study_module.main(
                [*options, "--only", e, "--out", str(out), "--report", str(check.work / "RESULTS.md")])[-1]))
    finally:
        study_module.fashion_mnist_shards = original
    keys = ("knn_top1", "linear_probe_top1", "finetune_top1", "pretrain_images_per_s", "pretrain_seconds")
    summary["entries"] = {k: {f: v.get(f) for f in keys} for k, v in check.record["items"].items() if k != "shards"
                          and "skipped" not in v and "error" not in v}
    summary["pretrain_samples"] = int(options[3])
    check.save()


def compact(result: dict) -> dict:
    """A study result without its loss curve (first and last points kept)."""
    out = {k: v for k, v in result.items() if k != "loss_curve"}
    curve = result.get("loss_curve") or []
    if curve:
        out["loss_first_last"] = [curve[0], curve[-1]]
    return out
