"""MAE+ / AdPE through train/pretrain.py under DeepSpeed (ZeRO-2, CPU): multi-crop shards,
adversaries updated by the loop's generic hook, checkpointed and restored exactly."""
import json
import os
import subprocess
import sys

import pytest
from conftest import CHILD_EXIT, CPU_DS, REPO, run_pretrain

from data.write_shards import main as write_shards
from train.run.folder import read_metrics

PRESET = REPO / "train" / "configs" / "maeplus/debug.json"
ADPE = REPO / "train" / "configs" / "maeplus" / "variants"


def test_default_adpe_moves_its_adversaries_and_resumes_them_exactly(tmp_path):
    out = tmp_path / "run"
    args = ("--config", str(PRESET), "--config", str(ADPE / "rpe_coord.json"), "--run.max_steps", "6",
            "--run.ckpt_every", "3")
    run_pretrain(out, *args)
    rows = read_metrics(out)
    keys = [k for k in rows[0] if k.startswith("adv_rpe_")]
    assert sorted(keys) == ["adv_rpe_dec0", "adv_rpe_enc0", "adv_rpe_enc1"]
    # Logged before each step. The iRPE tables start at 0, so the offsets get no gradient until the
    # tables have moved (lr is 0 at step 0): the adversary starts moving at step 3, then grows.
    sizes = [r["adv_rpe_enc0"] for r in rows]
    assert sizes[:3] == [0.0, 0.0, 0.0] and 0 < sizes[3] < sizes[4] < sizes[5] <= 20.0
    resumed = tmp_path / "resumed"
    run_pretrain(resumed, *args, "--resume", str(out / "checkpoints" / "step00000003"))
    again = read_metrics(resumed)
    for a, b in zip(again, rows[3:]):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["adv_rpe_enc0"] == pytest.approx(b["adv_rpe_enc0"], rel=1e-6)
    encoder = json.loads((out / "encoder.json").read_text())["timm_kwargs"]
    assert encoder["rpe"] is True  # loads into our ViT (timm has no iRPE)


def test_every_adpe_variant_and_fgsm_trains_from_its_preset(tmp_path):
    names = ["maeplus_rpe", "ape_embed", "ape_coord", "rpe_embed", "fgsm"]
    calls = [["--ds_config", str(CPU_DS), "--config", str(PRESET), "--config", str(ADPE / f"{n}.json"),
              "--output_dir", str(tmp_path / n), "--run.max_steps", "3", "--run.progress", "false",
              "--run.export", "false"] for n in names]
    code = "import json, sys\nfrom train.pretrain import main\nfor argv in json.loads(sys.argv[1]):\n    main(argv)\n" + CHILD_EXIT
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(calls)], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected_adv = {"maeplus_rpe": [], "ape_embed": ["adv_ape"], "ape_coord": ["adv_ape"],
                    "rpe_embed": ["adv_rpe_dec0", "adv_rpe_enc0", "adv_rpe_enc1"], "fgsm": []}
    for name in names:
        rows = read_metrics(tmp_path / name)
        assert sorted(k for k in rows[-1] if k.startswith("adv_")) == expected_adv[name], name
        eps = json.loads((ADPE / f"{name}.json").read_text())["maeplus"].get("adv_eps")
        for k in expected_adv[name]:  # logged before step 3: moved by the step-2 update (lr is 0 at step 1)
            assert 0 < rows[-1][k] <= eps, (name, k)


def test_multicrop_shards_count_images_not_crops_for_the_lr(tmp_path):
    import numpy as np
    from PIL import Image

    root = tmp_path / "folder"
    rng = np.random.default_rng(0)
    for c in range(2):
        (root / str(c)).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 255, (40, 40), dtype=np.uint8), mode="L").save(root / str(c) / f"{i}.png")
    write_shards(["imagefolder", str(root), str(tmp_path / "shards"), "--samples_per_shard", "8"])
    out = tmp_path / "run"
    run_pretrain(out, "--config", str(PRESET), "--model.in_chans", "3", "--data.source", "shards",
                 "--data.train_index", str(tmp_path / "shards" / "train.json"), "--data.epoch_size", "0",
                 "--data.num_workers", "1", "--data.train_transform", "multicrop", "--data.num_crops", "3",
                 "--run.max_steps", "2")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["batch"]["global"] == 8 and meta["peak_lr"] == pytest.approx(1.5e-3 * 8 / 256)
    assert meta["steps_per_epoch"] == 2  # 16 images / 8 per step, whatever the number of crops
    assert len(read_metrics(out)) == 2
