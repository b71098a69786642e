"""Phase `study`: the Fashion-MNIST study (experiments/fashion_mnist/study.py), one entry per budget step."""
from __future__ import annotations

import json
from pathlib import Path

from tools.gpu_check import REPO, Check, drop_process_group_env
from tools.phases.common import compact


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

def run(check: Check, a) -> None:
    from data.write_shards import main as write_shards

    summary = check.record["summary"]
    if check.cuda:
        src = fashion_mnist_dir(a)
        if src is None:
            check.skip("study", "Fashion-MNIST idx files not found: copy them to runs/fashion-mnist (docs/GPU.md) "
                       "or pass --fashion_mnist DIR")
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
    import experiments.fashion_mnist.study as study_module

    drop_process_group_env()  # the study's subprocesses must not join this process's group (its port is taken)
    out = check.work / "runs"
    for entry in entries:  # one entry per call, so the budget can stop between them
        check.item(entry, est, lambda e=entry: compact(study_module.main(
            [*options, "--shards", str(shards), "--only", e, "--out", str(out),
             "--report", str(check.work / "RESULTS.md")])[-1]))
    keys = ("knn_top1", "linear_probe_top1", "finetune_top1", "pretrain_images_per_s", "pretrain_seconds")
    summary["entries"] = {k: {f: v.get(f) for f in keys} for k, v in check.record["items"].items() if k != "shards"
                          and "skipped" not in v and "error" not in v}
    summary["pretrain_samples"] = int(options[3])
    check.save()
