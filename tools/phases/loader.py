"""Phase `loader`: decode + RandomResizedCrop 224 images/s on JPEGs drawn on the machine, cpu /
cpu_draft / nvjpeg; then end to end, MAE ViT-B/16 trained from those shards with nvjpeg against
synthetic images at the same micro-batch (128, compiled blocks, bf16), alternating twice, with
every core of the machine as a worker (the count is recorded: an 8-GPU node of 128 cores gives
each GPU 16)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tools.gpu_check import Check, free_memory
from tools.phases.common import CPU_DEBUG_DS, TARGETS, ds_config


def run(check: Check, a) -> None:
    from benchmarks.photo_shards import images_folder
    from benchmarks.photo_shards import main as photo_shards
    from tools.photos import write_photos

    summary = check.record["summary"]
    summary["targets"] = {"nvjpeg_images_per_s": TARGETS["nvjpeg_images_per_s"], "shards_over_synthetic": ">= 0.95"}
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
        files = list(images_folder(shards).rglob("*.jpg"))
        return {"images": len(files), "mean_kb": sum(f.stat().st_size for f in files) / len(files) / 1024,
                "shards": len(list(shards.glob("*.tar")))}

    made = check.item("make_shards", 45, make)
    if not made or "images" not in made:
        return
    summary.update(workers=workers, cpu_count=cores, jpeg_mean_kb=made["mean_kb"])
    ds = ds_config(check, "loader", micro) if check.cuda else CPU_DEBUG_DS
    common = ["--ds_config", str(ds), "--data.source", "shards", "--data.train_index", str(shards / "train.json"),
              "--model.name", "vit_base_patch16", "--model.in_chans", "3", "--data.num_workers", str(workers),
              "--data.train_transform", "crop_flip",
              "--steps", str(batches), "--warmup", str(warm)]

    def cpu_loader(decode: str) -> dict:
        from train import bench

        path = bench.main(["--loader_only", *common, "--data.decode", decode, "--out_dir", str(check.work / "rec")])
        return json.loads(Path(path).read_text())["loader"]

    # the targets' items first (a short call learns them), then the CPU decoders beside them
    check.item("decode_nvjpeg", 20, lambda: device_loader(check, common, batches, warm))  # 12,288 images
    end_to_end(check, shards, workers)
    for decode in ("cpu", "cpu_draft"):
        check.item(f"decode_{decode}", 30, lambda d=decode: cpu_loader(d))
    for decode in ("cpu", "cpu_draft", "nvjpeg"):
        v = check.record["items"].get(f"decode_{decode}", {})
        if "images_per_s" in v:
            summary[f"{decode}_images_per_s"] = v["images_per_s"]
    check.save()


def end_to_end(check: Check, shards: Path, workers: int) -> None:
    """train/bench.py from the JPEG shards (nvjpeg; CPU smoke: cpu decode, the debug model) and from
    synthetic images, same model and micro-batch, alternating; images/s of each and their ratio."""
    from tools.phases.common import DEBUG_PRESET, our_bench

    if check.cuda:
        run = ["--ds_config", str(ds_config(check, "loader_e2e", 128)), "--model.name", "vit_base_patch16",
               "--steps", "15", "--warmup", "5", "--run.compile", "true"]
        decode, est = "nvjpeg", (60, 35)  # the first compiles the blocks, the rest find inductor's cache warm
    else:
        run = ["--ds_config", str(CPU_DEBUG_DS), "--config", str(DEBUG_PRESET), "--model.in_chans", "3",
               "--steps", "2", "--warmup", "1"]
        decode, est = "cpu", (0, 0)
    sources = {"synthetic": ["--data.source", "synthetic"],
               "shards": ["--data.source", "shards", "--data.train_index", str(shards / "train.json"),
                          "--data.num_workers", str(workers), "--data.train_transform", "crop_flip",
                          "--data.decode", decode]}
    for r in range(2):
        for source in (sources if r == 0 else dict(reversed(sources.items()))):
            first = not any(k.startswith("end_to_end_") for k in check.record["items"])
            check.item(f"end_to_end_{source}_r{r}", est[0] if first else est[1],
                       lambda s=source: our_bench(check, [*run, *sources[s]]))
    rates = {s: [v["images_per_s"] for k, v in check.record["items"].items()
                 if k.startswith(f"end_to_end_{s}_r") and "images_per_s" in v] for s in sources}
    row = {"decode": decode, "workers": workers, **{f"{s}_images_per_s": sum(v) / len(v) for s, v in rates.items() if v}}
    if all(rates.values()):
        row["shards_over_synthetic"] = row["shards_images_per_s"] / row["synthetic_images_per_s"]
    check.record["summary"]["end_to_end"] = row
    check.save()

def device_loader(check: Check, common: list[str], batches: int, warmup: int) -> dict:
    """nvjpeg: the workers send JPEG bytes, the batch is decoded on the training device (CPU smoke:
    torchvision's libjpeg decode stands in; the same code path otherwise)."""
    import time

    from data.source import build_source
    from train.bench import split_argv
    from train.config.ds_config import resolve
    from train.config.parsing import parse_args

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
