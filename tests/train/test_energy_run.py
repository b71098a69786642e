"""Energy-based pretraining through train/pretrain.py: the ViT (resume, figures, export), a timm
ConvNeXt exported under timm's names, and every single-corruption preset."""
import json
import math
import os
import subprocess
import sys

import pytest
import timm
import torch
from conftest import CPU_DS, DEBUG_PRESET, REPO, run_pretrain_calls

from train.run.evaluation import load_encoder
from train.run.folder import read_metrics

PRESET = REPO / "train" / "configs" / "energy/debug.json"
VARIANTS = REPO / "train" / "configs" / "energy" / "variants"
CORRUPTIONS = ["grid", "blank_small", "blank_large", "sr", "denoise", "colorize"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
COMMON = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--config", str(PRESET), "--run.progress", "false"]


def test_vit_and_convnext_train_resume_and_export(tmp_path):
    vit, resumed, convnext = tmp_path / "vit", tmp_path / "resumed", tmp_path / "convnext"
    run_pretrain_calls([
        [*COMMON, "--output_dir", str(vit), "--run.max_steps", "4", "--run.ckpt_every", "2", "--run.vis_every", "4"],
        [*COMMON, "--output_dir", str(resumed), "--run.max_steps", "4", "--run.export", "false",
         "--resume", str(vit / "checkpoints" / "step00000002")],
        [*COMMON, "--config", str(VARIANTS / "convnext_atto.json"), "--energy.grid_cell", "8", "--output_dir", str(convnext),
         "--run.max_steps", "2"],
    ])
    rows = read_metrics(vit)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["loss"] == pytest.approx((r["loss_step1"] + r["loss_step2"]) / 2, rel=1e-5)
        assert r["alpha"] > 0
    assert rows[-1]["alpha"] != 1.0  # alpha is learned
    for a, b in zip(read_metrics(resumed), rows[2:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["alpha"] == pytest.approx(b["alpha"], rel=1e-6)
    assert list((vit / "vis").glob("energy_restoration_step*.png"))
    meta = json.loads((vit / "meta.json").read_text())
    assert meta["attention_backend"] == "math"  # the twice-differentiable path, chosen through the dispatch

    # ConvNeXt: exported under timm's names, identical features in timm's own model
    assert [r["step"] for r in read_metrics(convnext)] == [1, 2]
    ours = load_encoder(encoder=str(convnext / "encoder.safetensors")).eval()
    reference = timm.create_model("convnext_atto", pretrained=False, num_classes=0).eval()
    from safetensors.torch import load_file

    reference.load_state_dict(load_file(str(convnext / "encoder.safetensors")), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours.pooled_features(x), reference(x))


def test_timm_vit_backbone_trains_resumes_and_exports(tmp_path):
    """A timm ViT (attention modules, which ConvNeXt lacks) from the command line: its fused SDPA
    (no double backward) is turned off, the run says so, checkpoints, resumes exactly and exports."""
    vit = [*COMMON, "--model.name", "timm/vit_tiny_patch16_224", "--model.img_size", "32", "--energy.grid_cell", "8"]
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    run_pretrain_calls([
        [*vit, "--output_dir", str(run), "--run.max_steps", "3", "--run.ckpt_every", "2"],
        [*vit, "--output_dir", str(resumed), "--run.max_steps", "3", "--run.export", "false",
         "--resume", str(run / "checkpoints" / "step00000002")],
    ])
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert rows[-1]["alpha"] != 1.0  # alpha learns through the double backward
    assert sorted(p.name for p in (run / "checkpoints").glob("step*")) == ["step00000002", "step00000003"]
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [3] and again[0]["loss"] == pytest.approx(rows[-1]["loss"], rel=1e-5)
    meta = json.loads((run / "meta.json").read_text())
    assert meta["attention_backend"] == "math"
    assert meta["attention_paths"]["dense"].startswith("timm vit_tiny_patch16_224: explicit softmax")
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32)
    from safetensors.torch import load_file

    reference.load_state_dict(load_file(str(run / "encoder.safetensors")), strict=True)  # timm's names


def test_every_single_corruption_preset_trains(tmp_path):
    runs = {c: tmp_path / c for c in CORRUPTIONS}
    run_pretrain_calls([[*COMMON, "--config", str(VARIANTS / f"{c}.json"), "--output_dir", str(out),
                         "--run.max_steps", "2", "--run.export", "false"] for c, out in runs.items()])
    for c, out in runs.items():
        rows = read_metrics(out)
        assert len(rows) == 2 and all(r["loss"] > 0 for r in rows), c
        assert json.loads((out / "config.json").read_text())["energy"]["corruption"] == c


def test_colorize_on_grayscale_input_is_refused_before_start(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "train" / "pretrain.py"), *COMMON, "--model.in_chans", "1",
                           "--output_dir", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert proc.returncode == 2 and "colorize needs RGB input" in proc.stderr
    assert not (tmp_path / "run").exists()
