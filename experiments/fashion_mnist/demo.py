"""The Fashion-MNIST demo (`make demo`): shards -> pretraining -> frozen-feature evaluation.

1. Writes train/test shards from the idx files of the Debian package dataset-fashion-mnist.
2. Pretrains on the mini ViT (32x32 input, patch 4) with train/pretrain.py, the same entry
   point as every run, in a single process on the CPU (resumes if interrupted). The method is
   MAE by default; `--method NAME` runs any registered objective that has a demo preset
   (train/configs/NAME/demo.json) and `--variant VARIANT` one of its variant presets over it
   (train/configs/NAME/variants/VARIANT.json: MixedAE's Table A4 ablations, AdPE's variants /
   FGSM, MLO-MAE's blo|straight_through|unit_unroll_lr, energy's single corruptions or
   convnext_atto). An objective with its own classifier (MLO-MAE's level-II head, trained on an
   80/20 split of the train shards) also has that head scored on the test split.
3. Evaluates the pretrained encoder and the same architecture at random init on the test split:
   weighted kNN and a linear probe on frozen features (train/evaluate.py): the features the
   objective's own `pool` option names (energy: average-pooled), else the cls token.
4. Prints a table and writes <run>/eval.json next to <run>/encoder.safetensors/.json
   (run folder: runs/demo for MAE, runs/demo_<method>[_<variant>] otherwise).

    python -m experiments.fashion_mnist.demo [--method NAME] [--variant VARIANT] [--epochs N]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from data.shards import ShardSet
from experiments.fashion_mnist.common import (
    RAW_PIXEL_BASELINES,
    REPO,
    SHARDS,
    demo_methods,
    epoch_options,
    fashion_mnist_shards,
    feature_pool,
    has_classifier,
    presets,
    variants,
)
from train.evaluate import evaluate, load_encoder
from train.run_dir import read_metrics

DEFAULT_METHOD = "mae"  # its run folder is runs/demo


D = " (default: %(default)s)"  # argparse fills in each option's default

def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    methods = demo_methods()
    p.add_argument("--method", choices=methods, default=DEFAULT_METHOD,
                   help="a registered objective with a demo preset (train/configs/<method>/demo.json)" + D)
    p.add_argument("--variant", "--ablation", dest="variant", default="",
                   help="a preset of train/configs/<method>/variants/ over the demo preset: " +
                        "; ".join(f"{m}: {', '.join(variants(m))}" for m in methods if variants(m)))
    p.add_argument("--epochs", type=float, default=0, help="pretraining epochs (0 = the preset's)" + D)
    p.add_argument("--skip_control", action="store_true", help="do not evaluate the random-init control")
    a = p.parse_args(argv)
    try:
        configs = presets(a.method, a.variant)
    except ValueError as e:
        p.error(str(e))
    name = "demo" if a.method == DEFAULT_METHOD and not a.variant and not a.epochs else "_".join(
        ["demo", a.method] + ([a.variant] if a.variant else []) + ([f"{a.epochs:g}ep"] if a.epochs else []))
    run = REPO / "runs" / name

    train, test = (ShardSet.from_index(index) for index in fashion_mnist_shards())

    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "train.pretrain", "--ds_config", str(REPO / "ds_configs" / "cpu_demo.json"),
           *[arg for preset in configs for arg in ("--config", str(preset))], "--data.train_index",
           str(SHARDS / "train.json"), "--output_dir", str(run), "--resume", "auto"]
    if a.epochs:
        cmd += epoch_options(a.epochs, train.num_samples)
    classifier = has_classifier(a.method)
    if classifier:  # its own head is scored on the test split at the end (train/pretrain.py)
        cmd += ["--data.eval_index", str(SHARDS / "test.json")]
    subprocess.run(cmd, check=True, cwd=REPO)
    pretrain_s = time.perf_counter() - t0
    head_eval = json.loads((run / "eval.json").read_text()) if classifier else None

    t0 = time.perf_counter()
    model_name = json.loads((run / "config.json").read_text())["model"]["name"]  # a timm backbone for energy
    pool = feature_pool(run)  # energy: average-pooled (its cls token is never trained); else the cls token
    # at the mini ViT's 32 px (MAE+ pretrains on 16 px crops; its sin-cos table is rebuilt for 32)
    pretrained = evaluate(load_encoder(encoder=str(run / "encoder.safetensors"), img_size=32), train, test, pool)
    control = None if a.skip_control else evaluate(load_encoder(random_init=model_name, img_size=32, seed=0), train,
                                                   test, pool)
    eval_s = time.perf_counter() - t0

    result = {
        **pretrained,
        "method": a.method,
        "ablation": a.variant or None,
        "random_init": control,
        "final_train_metrics": {k: v for k, v in [r for r in read_metrics(run) if "loss" in r][-1].items()
                                if k.startswith(("loss", "topk_acc", "level", "recon", "mask_prob"))},
        "level2_head_test_top1": head_eval["eval_top1"] if head_eval else None,
        "raw_pixel_baselines": RAW_PIXEL_BASELINES,
        "model": model_name,
        "features": pool,
        "pretrain_seconds": round(pretrain_s, 1),
        "eval_seconds": round(eval_s, 1),
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
    }
    (run / "eval.json").write_text(json.dumps(result, indent=2))
    print(f"\nFashion-MNIST test top-1 (%), {model_name}, frozen {pool} features")
    print(f"{'':24}{'linear probe':>14}{'kNN (k=20)':>12}")
    print(f"{(a.method.upper() + ' ' + a.variant).strip() + ' pretrained':24}{pretrained['linear_probe_top1']:>14.2f}{pretrained['knn_top1']:>12.2f}")
    if head_eval is not None:
        print(f"{a.method.upper() + ' own head':24}{head_eval['eval_top1']:>14.2f}{'':>12}   (test split)")
    if control is not None:
        print(f"{'random init':24}{control['linear_probe_top1']:>14.2f}{control['knn_top1']:>12.2f}")
    print(f"{'raw pixels':24}{RAW_PIXEL_BASELINES['logistic_regression']:>14.2f}{RAW_PIXEL_BASELINES['knn_5']:>12.2f}"
          "   (logistic regression / 5-NN)")
    print(f"pretraining {pretrain_s / 60:.1f} min, evaluation {eval_s / 60:.1f} min; wrote {run / 'eval.json'}")
    return result


if __name__ == "__main__":
    main()
