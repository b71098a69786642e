"""Every method's debug preset is complete on its own: alone (no mae/debug.json under it) it
resolves to the debug model and a schedule of a few dozen steps, with synthetic data."""
import json
from pathlib import Path

import pytest
from conftest import CPU_DS, REPO

from train.config.parsing import parse_args
from train.run.prestart import check_before_start

PRESETS = sorted((REPO / "train" / "configs").glob("*/debug.json"))


@pytest.mark.parametrize("preset", PRESETS, ids=[p.parent.name for p in PRESETS])
def test_a_debug_preset_alone_is_the_debug_model_on_a_short_schedule(preset: Path, tmp_path):
    declared = json.loads(preset.read_text())
    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(preset), "--output_dir", str(tmp_path / "run")])
    assert cfg.objective == declared.get("objective", "mae")
    assert cfg.model.name == "vit_debug_patch4"
    assert cfg.data.source == "synthetic" and cfg.data.epoch_size == 64
    checked = check_before_start(cfg)
    assert checked.total_steps <= 64  # 4 epochs of 64 samples in batches of 8 (ViT-B defaults: 128 million)
    assert not (tmp_path / "run").exists()  # the checks wrote nothing


def test_every_method_has_a_debug_preset():
    assert {p.parent.name for p in PRESETS} >= {"mae", "maeplus", "mixedae", "mlomae", "energy"}
