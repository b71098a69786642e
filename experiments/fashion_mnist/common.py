"""What the Fashion-MNIST demo, study and report share: the shards, the epoch budget, the preset
convention, what a finished pretraining run says about how to evaluate it, and the fixed numbers
the report quotes.

Presets by path convention: a method's demo preset is train/configs/<method>/demo.json and its
variants are train/configs/<method>/variants/<variant>.json (applied over the demo preset). A
registered objective with a demo preset is a demo method; nothing here names a method.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from data.cli import refuse
from data.fashion_mnist import find_or_download
from data.image_datasets import FASHION_MNIST_DIR
from data.image_datasets import ShardError
from data.write_shards import main as write_shards
from model.objectives import OBJECTIVES, list_objectives

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "train" / "configs"
SHARDS = REPO / "runs" / "shards" / "fashion_mnist"
RAW_PIXEL_BASELINES = {"logistic_regression": 84.3, "knn_5": 85.5}  # test split, raw pixels (benchmarks/fashion_mnist_raw_pixels.py)
TRAIN_IMAGES = 60000  # Fashion-MNIST's training split: one pretraining epoch
FINETUNE_BLR = 5e-3  # the study's fine-tuning blr; study.py's docstring says why not the paper's 5e-4


def fashion_mnist_shards() -> tuple[Path, Path]:
    """(train index, test index) of the Fashion-MNIST shards, written once from the idx files that
    data/fashion_mnist.py finds (Debian's package, else runs/fashion-mnist) or downloads; without
    them the process exits, saying where to put them."""
    if not (SHARDS / "train.json").is_file() or not (SHARDS / "test.json").is_file():
        try:
            src = find_or_download(system=FASHION_MNIST_DIR)
        except ShardError as e:
            refuse(str(e))
        # a pair left incomplete (a write interrupted between its two sets) is the study's own: replaced
        write_shards(["fashion-mnist", str(SHARDS), "--src", str(src), "--samples_per_shard", "2500", "--overwrite"])
    return SHARDS / "train.json", SHARDS / "test.json"


def read_result(path: Path) -> dict:
    """A run's result.json (study.py, progress.py, report.py); one that does not parse was cut short
    (a kill or a full disk while it was written, or a copy stopped half-way) and is refused naming
    the fix, since its run's checkpoints make it again."""
    try:
        return json.loads(path.read_text())
    except ValueError:  # JSONDecodeError, or UnicodeDecodeError for bytes cut mid-character
        refuse(f"{path} is not readable JSON (a write cut short): delete it and the entry reruns from its "
               "checkpoints")


def cpu_training_env() -> dict[str, str]:
    """The environment of a CPU training subprocess: OpenMP threads that wait for work by sleeping
    (OMP_WAIT_POLICY=PASSIVE) unless the caller chose otherwise. The training process runs one
    OpenMP thread per core and its loader worker decodes beside them; spinning threads then take
    the worker's core at every matmul barrier. On the 2-core dev machine (AMD EPYC, AVX2, torch
    2.14.1) the MAE demo step with 1 worker ran at 456 images/s spinning and 519 sleeping (medians of
    3 runs each, train.bench, 60 steps). libgomp reads it once, at start-up, so it
    cannot be set from inside an already started process."""
    return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def epoch_options(epochs: float, train_samples: int) -> list[str]:
    """Pretraining options for a budget of `epochs` (warmup a third of it, as the presets); a
    fraction of an epoch becomes one shorter nominal epoch, so the schedule still completes."""
    if epochs == int(epochs):
        return ["--optim.epochs", f"{epochs:g}", "--optim.warmup_epochs", str(epochs / 3)]
    return ["--optim.epochs", "1", "--optim.warmup_epochs", str(1 / 3),
            "--data.epoch_size", str(round(train_samples * epochs))]


def demo_methods() -> list[str]:
    """Registered objectives that have a demo preset (fine-tuning and the linear probe start from
    a pretrained encoder and have none)."""
    return [name for name in list_objectives() if (CONFIGS / name / "demo.json").is_file()]


def variants(method: str) -> list[str]:
    """Names of the method's variant presets (train/configs/<method>/variants/*.json)."""
    return sorted(f.stem for f in (CONFIGS / method / "variants").glob("*.json"))


def presets(method: str, variant: str = "") -> list[Path]:
    """The method's demo preset, then its variant preset when one is named; ValueError names the choices."""
    if not (CONFIGS / method / "demo.json").is_file():
        raise ValueError(f"no demo preset for {method!r}; methods with one: {demo_methods()}")
    if not variant:
        return [CONFIGS / method / "demo.json"]
    path = CONFIGS / method / "variants" / f"{variant}.json"
    if not path.is_file():
        raise ValueError(f"no variant preset {path}; {method} has {variants(method) or 'none'}")
    return [CONFIGS / method / "demo.json", path]


def has_classifier(method: str) -> bool:
    """The objective trains its own classifier (MLO-MAE's level-II head): pretraining scores it on
    the test split when given data.eval_index, and writes <run>/eval.json."""
    return OBJECTIVES[method][1].has_classifier()


def feature_pool(run: Path) -> str:
    """Frozen features to evaluate a finished run on: the objective's own `pool` option when it has
    one (energy reads average-pooled ViT features; its cls token is never trained), else the cls
    token, MAE's protocol. From the run's config.json, so no method is named here."""
    config = json.loads((run / "config.json").read_text())
    return config.get(config["objective"], {}).get("pool", "cls")


def encoder_has_rpe(run: Path) -> bool:
    """The exported encoder has iRPE in every block (MAE+ / AdPE): fine-tuning keeps it."""
    return bool(json.loads((run / "encoder.json").read_text())["timm_kwargs"].get("rpe", False))
