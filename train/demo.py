"""The Fashion-MNIST demo (`make demo`): shards -> pretraining -> frozen-feature evaluation.

1. Writes train/test shards from the idx files of the Debian package dataset-fashion-mnist.
2. Pretrains on the mini ViT (32x32 input, patch 4) with train/pretrain.py, the same entry
   point as every run, in a single process on the CPU (resumes if interrupted). The method is
   MAE by default; `--method mixedae [--ablation NAME]` runs MixedAE or a Table A4 ablation,
   `--method maeplus [--ablation NAME]` MAE+ or an AdPE variant / FGSM, `--method mlomae
   [--ablation blo|straight_through|unit_unroll_lr]` MLO-MAE (levels II-III on an 80/20 split of
   the train shards; its level-II head is also scored on the test split), `--method energy
   [--ablation CORRUPTION|convnext_atto]` energy-based pretraining (a mixture of corruptions by
   default; evaluated on average-pooled features)
   (train/configs/demo_<method>.json [+ mixedae_ablations/, adpe/, mlomae_variants/ or
   energy_variants/NAME.json]).
3. Evaluates the pretrained encoder and the same architecture at random init on the test split:
   weighted kNN and a linear probe on frozen features (train/evaluate.py).
4. Prints a table and writes <run>/eval.json next to <run>/encoder.safetensors/.json
   (run folder: runs/demo for MAE, runs/demo_<method>[_<ablation>] otherwise).

    python train/demo.py [--method mae|mixedae|maeplus|mlomae|energy] [--ablation NAME] [--epochs N]
"""
from __future__ import annotations

import argparse
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
from train.run_dir import read_metrics

REPO = Path(__file__).resolve().parent.parent
SHARDS = REPO / "runs" / "shards" / "fashion_mnist"
RAW_PIXEL_BASELINES = {"logistic_regression": 84.5, "knn_5": 85.5}  # test split, raw pixels (see README)


def fashion_mnist_shards() -> tuple[Path, Path]:
    """(train index, test index) of the Fashion-MNIST shards, written once from the idx files."""
    if not (SHARDS / "train.json").is_file() or not (SHARDS / "test.json").is_file():
        if not FASHION_MNIST_DIR.is_dir():
            sys.exit(f"Fashion-MNIST not found in {FASHION_MNIST_DIR}: run `apt-get install dataset-fashion-mnist`")
        write_shards(["fashion-mnist", str(SHARDS), "--samples_per_shard", "2500"])
    return SHARDS / "train.json", SHARDS / "test.json"


def epoch_options(epochs: float, train_samples: int) -> list[str]:
    """Pretraining options for a budget of `epochs` (warmup a third of it, as the presets); a
    fraction of an epoch becomes one shorter nominal epoch, so the schedule still completes."""
    if epochs == int(epochs):
        return ["--optim.epochs", f"{epochs:g}", "--optim.warmup_epochs", str(epochs / 3)]
    return ["--optim.epochs", "1", "--optim.warmup_epochs", str(1 / 3),
            "--data.epoch_size", str(round(train_samples * epochs))]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=["mae", "mixedae", "maeplus", "mlomae", "energy"], default="mae")
    p.add_argument("--ablation", default="", help="a preset of train/configs/mixedae_ablations/ (mixedae), "
                                                   "adpe/ (maeplus), mlomae_variants/ (mlomae) or "
                                                   "energy_variants/ (energy: a single corruption or convnext_atto)")
    p.add_argument("--epochs", type=float, default=0, help="pretraining epochs (0 = the preset's)")
    p.add_argument("--skip_control", action="store_true", help="do not evaluate the random-init control")
    a = p.parse_args(argv)
    configs = REPO / "train" / "configs"
    presets = [configs / f"demo_{a.method}.json"]
    if a.ablation:
        if a.method == "mae":
            p.error("--ablation is for --method mixedae or maeplus")
        folder = {"mixedae": "mixedae_ablations", "maeplus": "adpe", "mlomae": "mlomae_variants",
                  "energy": "energy_variants"}[a.method]
        presets.append(configs / folder / f"{a.ablation}.json")
        if not presets[-1].is_file():
            p.error(f"no ablation preset {presets[-1]}; choose one of "
                    f"{sorted(f.stem for f in presets[-1].parent.glob('*.json'))}")
    name = "demo" if a.method == "mae" and not a.epochs else "_".join(
        ["demo", a.method] + ([a.ablation] if a.ablation else []) + ([f"{a.epochs:g}ep"] if a.epochs else []))
    run = REPO / "runs" / name

    train, test = (ShardSet.from_index(index) for index in fashion_mnist_shards())

    t0 = time.perf_counter()
    cmd = [sys.executable, str(REPO / "train" / "pretrain.py"), "--ds_config", str(REPO / "ds_configs" / "cpu_demo.json"),
           *[arg for preset in presets for arg in ("--config", str(preset))], "--data.train_index",
           str(SHARDS / "train.json"), "--output_dir", str(run), "--resume", "auto"]
    if a.epochs:
        cmd += epoch_options(a.epochs, train.num_samples)
    if a.method == "mlomae":  # its level-II head is scored on the test split at the end (train/pretrain.py)
        cmd += ["--data.eval_index", str(SHARDS / "test.json")]
    subprocess.run(cmd, check=True, cwd=REPO)
    pretrain_s = time.perf_counter() - t0
    head_eval = json.loads((run / "eval.json").read_text()) if a.method == "mlomae" else None

    t0 = time.perf_counter()
    model_name = json.loads((run / "config.json").read_text())["model"]["name"]  # a timm backbone for energy
    # Energy pretraining reads average-pooled ViT features (its cls token is never trained); the
    # others are evaluated on the cls token, MAE's protocol.
    pool = "avg" if a.method == "energy" else "cls"
    # at the mini ViT's 32 px (MAE+ pretrains on 16 px crops; its sin-cos table is rebuilt for 32)
    pretrained = evaluate(load_encoder(encoder=str(run / "encoder.safetensors"), img_size=32), train, test, pool)
    control = None if a.skip_control else evaluate(load_encoder(random_init=model_name, img_size=32, seed=0), train,
                                                   test, pool)
    eval_s = time.perf_counter() - t0

    result = {
        **pretrained,
        "method": a.method,
        "ablation": a.ablation or None,
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
    print(f"{(a.method.upper() + ' ' + a.ablation).strip() + ' pretrained':24}{pretrained['linear_probe_top1']:>14.2f}{pretrained['knn_top1']:>12.2f}")
    if head_eval is not None:
        print(f"{'MLO-MAE level-II head':24}{head_eval['eval_top1']:>14.2f}{'':>12}   (its own linear head, test split)")
    if control is not None:
        print(f"{'random init':24}{control['linear_probe_top1']:>14.2f}{control['knn_top1']:>12.2f}")
    print(f"{'raw pixels':24}{RAW_PIXEL_BASELINES['logistic_regression']:>14.2f}{RAW_PIXEL_BASELINES['knn_5']:>12.2f}"
          "   (logistic regression / 5-NN)")
    print(f"pretraining {pretrain_s / 60:.1f} min, evaluation {eval_s / 60:.1f} min; wrote {run / 'eval.json'}")
    return result


if __name__ == "__main__":
    main()
