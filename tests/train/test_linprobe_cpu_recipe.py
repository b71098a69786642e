"""The CPU linear probe of docs/EVALUATION.md learns: its command, read from the page and run at a
reduced size (synthetic 10-class images, a mini ViT at random init, a shorter epoch), reaches at
least train/evaluate.py's quick probe of the same encoder minus 3 points; and the MAE recipe at the
same CPU batch, whose LARS lr is far too small there, keeps its loss at ln(10) and says so."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import CHILD_EXIT, REPO
from PIL import Image
from readme_commands import Doc, command

CLASSES, TRAIN, TEST = 10, 40, 20  # images per class
EPOCH = 5120  # nominal samples per epoch: 20 steps of 256, 60 in the recipe's 3 epochs


def write_images(root, per_class: int, seed: int) -> None:
    """Class c: its own 4 x 4 pattern of grey levels upsampled to 28 x 28, under noise (sigma 150)."""
    patterns = np.random.default_rng(0).integers(0, 256, (CLASSES, 4, 4))
    rng = np.random.default_rng(seed)
    for c in range(CLASSES):
        (root / f"class{c}").mkdir(parents=True)
        base = np.kron(patterns[c], np.ones((7, 7)))
        for i in range(per_class):
            image = np.clip(base + rng.normal(0, 150, base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(image).save(root / f"class{c}" / f"{i}.png")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Train / test shards and an exported mini ViT at random init (the demo's architecture)."""
    from safetensors.torch import save_file

    from data.write_shards import main as write_shards
    from model.registry import create_model

    root = tmp_path_factory.mktemp("probe")
    for split, n, seed in (("train", TRAIN, 1), ("test", TEST, 2)):
        write_images(root / "images" / split, n, seed)
        write_shards(["imagefolder", str(root / "images" / split), str(root / "shards"), "--name", split,
                      "--workers", "1"])
    import torch

    torch.manual_seed(0)
    encoder = create_model("vit_mini_patch4")
    (root / "demo").mkdir()
    save_file({k: v.contiguous() for k, v in encoder.state_dict().items()}, str(root / "demo" / "encoder.safetensors"))
    (root / "demo" / "encoder.json").write_text(json.dumps({"timm_kwargs": encoder.timm_kwargs()}))
    return root


def test_the_documented_cpu_probe_learns_as_the_quick_probe_does_and_the_mae_recipe_says_it_does_not(data):
    from data.shard_index import ShardSet
    from train.run.evaluation import evaluate, load_encoder

    doc = command(Doc.read("docs/EVALUATION.md"), "python train/linprobe.py", "Linear probe on a CPU")
    argv = doc.argv({"runs/shards/fashion_mnist": data / "shards", "runs/demo": data / "demo",
                     "runs/linprobe_demo": data / "cpu"})
    assert "cpu_recipe.json" in " ".join(argv) and "ds_configs/cpu_linprobe.json" in argv
    reduced = ["--data.epoch_size", str(EPOCH), "--run.log_every", "5", "--run.progress", "false"]
    cpu = [*argv[2:], *reduced]  # the options after `python train/linprobe.py`
    recipe = cpu.index("--config")
    # the same command without the CPU recipe: MAE's LARS recipe (lr 0.1 at this batch), 20 steps
    mae = [*cpu[:recipe], *cpu[recipe + 2:], "--optim.epochs", "1", "--optim.warmup_epochs", "0.1"]
    mae[mae.index("--output_dir") + 1] = str(data / "mae")
    code = ("import json, sys\nfrom train.linprobe import main\nfor argv in json.loads(sys.argv[1]):\n"
            "    main(argv)\n" + CHILD_EXIT)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([cpu, mae])], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]

    quick = evaluate(load_encoder(encoder=str(data / "demo" / "encoder.safetensors")),
                     ShardSet.from_index(data / "shards" / "train.json"),
                     ShardSet.from_index(data / "shards" / "test.json"))["linear_probe_top1"]
    probe = json.loads((data / "cpu" / "eval.json").read_text())
    assert probe["eval_top1"] >= quick - 3, (probe, quick)
    assert quick > 3 * 100 / CLASSES, quick  # a task the features can solve, far above chance
    assert probe["training_loss_at_chance"] is False

    at_chance = json.loads((data / "mae" / "eval.json").read_text())
    losses = [r["loss"] for r in map(json.loads, (data / "mae" / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    assert min(losses) > 0.98 * math.log(CLASSES) and at_chance["training_loss_at_chance"] is True
    assert at_chance["eval_top1"] < probe["eval_top1"] - 20
    said = [line for line in proc.stderr.splitlines() if "is within 2% of chance (ln 10 = 2.303)" in line]
    assert len(said) == 2, said  # when first seen, and at the end: the MAE recipe's run only
    assert all("steps after the lr warmup ended: the classifier is not learning" in line and "far too small for LARS"
               in line and "on a CPU use train/configs/linprobe/cpu_recipe.json" in line for line in said), said
