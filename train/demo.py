"""The Fashion-MNIST demo (`make demo`): shards -> MAE pretraining -> frozen-feature evaluation.

1. Writes train/test shards from the idx files of the Debian package dataset-fashion-mnist.
2. Pretrains MAE on the mini ViT (32x32 input, patch 4) with train/pretrain.py, the same entry
   point as every run, in a single process on the CPU (resumes if interrupted).
3. Evaluates the pretrained encoder and the same architecture at random init on the test split:
   weighted kNN and a linear probe on frozen cls features (train/evaluate.py).
4. Prints a table and writes runs/demo/eval.json next to runs/demo/encoder.safetensors/.json.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from data.shards import ShardSet
from data.write_shards import FASHION_MNIST_DIR
from data.write_shards import main as write_shards
from train.evaluate import evaluate, load_encoder

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "runs" / "demo"
SHARDS = REPO / "runs" / "shards" / "fashion_mnist"
MODEL = "vit_mini_patch4"
RAW_PIXEL_BASELINES = {"logistic_regression": 84.5, "knn_5": 85.5}  # test split, raw pixels (see README)


def main() -> dict:
    if not (SHARDS / "train.json").is_file() or not (SHARDS / "test.json").is_file():
        if not FASHION_MNIST_DIR.is_dir():
            sys.exit(f"Fashion-MNIST not found in {FASHION_MNIST_DIR}: run `apt-get install dataset-fashion-mnist`")
        write_shards(["fashion-mnist", str(SHARDS), "--samples_per_shard", "2500"])
    train, test = ShardSet.from_index(SHARDS / "train.json"), ShardSet.from_index(SHARDS / "test.json")

    t0 = time.perf_counter()
    cmd = [sys.executable, str(REPO / "train" / "pretrain.py"), "--ds_config", str(REPO / "ds_configs" / "cpu_demo.json"),
           "--config", str(REPO / "train" / "configs" / "demo_mae.json"), "--data.train_index",
           str(SHARDS / "train.json"), "--output_dir", str(RUN), "--resume", "auto"]
    subprocess.run(cmd, check=True, cwd=REPO)
    pretrain_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    pretrained = evaluate(load_encoder(encoder=str(RUN / "encoder.safetensors")), train, test)
    control = evaluate(load_encoder(random_init=MODEL, seed=0), train, test)
    eval_s = time.perf_counter() - t0

    result = {
        **pretrained,
        "random_init": control,
        "raw_pixel_baselines": RAW_PIXEL_BASELINES,
        "model": MODEL,
        "pretrain_seconds": round(pretrain_s, 1),
        "eval_seconds": round(eval_s, 1),
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
    }
    (RUN / "eval.json").write_text(json.dumps(result, indent=2))
    print(f"\nFashion-MNIST test top-1 (%), {MODEL}, frozen cls features")
    print(f"{'':24}{'linear probe':>14}{'kNN (k=20)':>12}")
    print(f"{'MAE pretrained':24}{pretrained['linear_probe_top1']:>14.2f}{pretrained['knn_top1']:>12.2f}")
    print(f"{'random init':24}{control['linear_probe_top1']:>14.2f}{control['knn_top1']:>12.2f}")
    print(f"{'raw pixels':24}{RAW_PIXEL_BASELINES['logistic_regression']:>14.2f}{RAW_PIXEL_BASELINES['knn_5']:>12.2f}"
          "   (logistic regression / 5-NN)")
    print(f"pretraining {pretrain_s / 60:.1f} min, evaluation {eval_s / 60:.1f} min; wrote {RUN / 'eval.json'}")
    return result


if __name__ == "__main__":
    main()
