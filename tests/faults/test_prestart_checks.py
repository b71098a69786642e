"""Checks before start: the shards' channels against model.in_chans, a non-positive
lr, a mask ratio that masks or keeps no patch; each an exit-2 message naming the cause and the
fix, before any process group or run folder. A folder whose start never trained is reusable."""
import json

import numpy as np
import pytest
from conftest import CPU_DS, DEBUG_PRESET
from PIL import Image
from test_config_errors import _reject as reject_before_start

from data.write_shards import main as write_shards
from train.config.errors import ConfigError
from train.config.objective_fits import check_objective_fits
from train.config.parsing import parse_args
from train.run.run_lock import release_run_lock
from train.run.prestart import check_before_start

CONFIGS = DEBUG_PRESET.parent.parent


def _reject(tmp_path, capsys, monkeypatch, *args) -> str:
    """test_config_errors' refusal check (exit 2, no process group), and no run folder at all."""
    err = reject_before_start(tmp_path, capsys, monkeypatch, *args)
    assert not (tmp_path / "run").exists()
    return err


@pytest.mark.parametrize("which", ["train", "eval"])
def test_grayscale_shards_against_a_one_channel_model_name_both_counts_and_the_fix(tmp_path, capsys, monkeypatch,
                                                                                    which):
    """The training shards, or the evaluation shards of a run training on synthetic images (whose
    first evaluation failed mid-run: a (256, 3, 28, 28) batch against 1 channel)."""
    root = tmp_path / "folder"
    for c in range(2):
        (root / str(c)).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(np.full((8, 8), 40 * c + i, dtype=np.uint8), mode="L").save(root / str(c) / f"{i}.png")
    write_shards(["imagefolder", str(root), str(tmp_path / "shards"), "--samples_per_shard", "4"])
    index = str(tmp_path / "shards" / "train.json")
    source = (["--data.source", "shards", "--data.train_index", index, "--data.num_workers", "1"] if which == "train"
              else ["--config", str(CONFIGS / "mlomae" / "debug.json"), "--data.eval_index", index])  # a classifier
    err = _reject(tmp_path, capsys, monkeypatch, *source)  # the debug presets: in_chans 1
    assert f"model.in_chans is 1, but the data has 3 channels: the shards of {index}" in err
    assert "hold PIL mode L images (1 channel), which the loader decodes to 3-channel RGB" in err
    assert "set --model.in_chans 3" in err


@pytest.mark.parametrize("option, value, says", [
    ("optim.blr", "-1e-3", "optim.blr must be > 0, got -0.001"),
    ("optim.blr", "0", "optim.blr must be > 0, got 0.0"),
    ("optim.min_lr", "-1e-6", "optim.min_lr must be >= 0, got -1e-06"),
    ("optim.weight_decay", "-0.05", "optim.weight_decay must be >= 0"),
    ("mae.mask_ratio", "0.0", "mae.mask_ratio must be in (0, 1)"),
])
def test_values_that_cannot_train_are_refused_when_parsed(option, value, says):
    with pytest.raises(ConfigError) as e:
        parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), f"--{option}", value])
    assert says in str(e.value)


@pytest.mark.parametrize("objective, ratio, says", [
    ("mae", "0.99", "mae.mask_ratio 0.99 keeps no patch of the 49 (floor(49 x (1 - 0.99)) = 0)"),
    ("mae", "1e-17", "mae.mask_ratio 1e-17 masks no patch of the 49"),  # 1 - 1e-17 == 1.0 in floats
    ("maeplus", "0.99", "maeplus.mask_ratio 0.99 keeps no patch of the 49"),
    ("mlomae", "0.99", "mlomae.mask_ratio 0.99 keeps no patch of the 49"),
])
def test_a_mask_ratio_that_masks_or_keeps_no_patch_of_the_model_is_refused(tmp_path, capsys, monkeypatch, objective, ratio,
                                                                              says):
    err = _reject(tmp_path, capsys, monkeypatch, "--config", str(CONFIGS / objective / "debug.json"), f"--{objective}.mask_ratio",
                  ratio)
    assert says in err


def test_a_floor_above_the_peak_lr_is_refused_naming_the_peak(tmp_path, capsys, monkeypatch):
    """The debug preset's peak is 1.5e-3 x 8 / 256 = 4.69e-5: min_lr 1e-3 made the "cosine down to
    min_lr" climb 21-fold above the peak."""
    err = _reject(tmp_path, capsys, monkeypatch, "--optim.min_lr", "1e-3")
    assert "optim.min_lr 0.001 is above the peak lr 4.69e-05 (blr 0.0015 x global batch 8 / 256)" in err
    assert "give an optim.min_lr below 4.69e-05 (MAE: 0), or a larger optim.blr" in err


def test_a_run_folder_whose_start_never_trained_is_not_another_run(tmp_path):
    """A failed start leaves config.json, meta.json, an empty metrics.jsonl and no checkpoint: the
    corrected command (another config) reuses the folder, without --run.overwrite."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step00000004.partial").mkdir(parents=True)  # killed while writing its first one
    (run / "config.json").write_text(json.dumps({"optim": {"blr": 0.5}, "model": {"in_chans": 1}}))
    (run / "meta.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    (run / "launch").mkdir()  # launchers/submit.py's snapshot: kept
    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(run)])
    check_before_start(cfg)  # no "holds a run with another config"
    assert sorted(p.name for p in run.iterdir()) == ["launch", "run.lock"]  # the failed start's files are gone
    release_run_lock(run)  # held from the checks to the run's end: this test runs no run
    (run / "config.json").write_text(json.dumps({"optim": {"blr": 0.5}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")  # it trained a step: a run
    with pytest.raises(ConfigError, match="holds a run with another config"):
        check_before_start(cfg)


def test_no_data_points_to_a_debug_preset_not_to_a_full_size_synthetic_run():
    with pytest.raises(ConfigError) as e:
        parse_args(["--ds_config", str(CPU_DS)])  # no preset: ViT-B, 800 epochs
    assert "start from a debug preset (--config train/configs/<method>/debug.json" in str(e.value)
    assert "not --data.source synthetic alone" in str(e.value)


@pytest.mark.parametrize("objective", ["finetune", "linprobe"])
def test_a_classifier_of_another_class_count_than_the_labels_is_refused(tmp_path, capsys, monkeypatch, objective):
    """Synthetic labels 0..9 against a 5-way classifier failed inside the first step (timm's mixup:
    index out of bounds); a wider one (the default 1000 on a 10-class index) trained and exported a
    classifier of classes no sample has, its label smoothing spread over them. The class count of
    labeled shards is checked the same way."""
    err = _reject(tmp_path, capsys, monkeypatch, "--objective", objective, f"--{objective}.num_classes", "5",
                  "--optim.name", "adamw")  # mae/debug.json: data.num_classes 10
    assert f"the training labels have 10 classes but {objective}.num_classes is 5; set --{objective}.num_classes 10" in err
    for extra in (1, 2):  # one output too many is refused as two are
        wider = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--objective", objective,
                            f"--{objective}.num_classes", str(10 + extra)])
        with pytest.raises(ConfigError, match=rf"its other {extra} outputs would be classes no sample has; set "
                                              rf"--{objective}.num_classes 10"):
            check_objective_fits(wider, micro_batch=8)


def _debug(*options: str):
    return parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), *options])


def test_a_floor_just_above_the_peak_lr_is_refused_and_one_at_the_peak_accepted():
    from train.config.ds_config import BatchPlan
    from train.config.plan import schedule_steps

    cfg, plan = _debug(), BatchPlan(8, 1, 1)
    peak = cfg.optim.blr * plan.global_batch / 256  # the MAE recipe's scaling rule
    cfg.optim.min_lr = peak  # a flat cosine: nothing rises
    schedule_steps(cfg, plan)
    cfg.optim.min_lr = peak * (1 + 1e-6)
    with pytest.raises(ConfigError, match="is above the peak lr"):
        schedule_steps(cfg, plan)


def test_a_warmup_longer_than_the_schedule_is_refused_and_one_as_long_accepted():
    epochs = _debug().optim.epochs
    assert _debug("--optim.warmup_epochs", str(epochs)).optim.warmup_epochs == epochs
    with pytest.raises(ConfigError, match=rf"optim.warmup_epochs \({epochs + 0.5}\) exceeds optim.epochs \({epochs}\)"):
        _debug("--optim.warmup_epochs", str(epochs + 0.5))


def test_overwrite_and_resume_together_are_refused():
    assert _debug("--run.overwrite", "true").run.overwrite and _debug("--resume", "auto").resume == "auto"
    with pytest.raises(ConfigError, match="run.overwrite starts afresh and --resume continues: give one of them"):
        _debug("--run.overwrite", "true", "--resume", "auto")


@pytest.mark.parametrize("accum, fits", [(1, False), (2, True)])
def test_mlomae_level2_steps_may_use_every_micro_batch_of_a_cycle_accumulation_included(accum, fits):
    """level2_steps head steps run on the cycle's latest D_tr micro-batches: level1_steps x accumulation of them."""
    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(CONFIGS / "mlomae" / "debug.json"),
                      "--mlomae.level2_steps", "2"])
    assert (cfg.mlomae.level1_steps, cfg.mlomae.level2_steps) == (1, 2)
    if fits:
        check_objective_fits(cfg, micro_batch=8, accum=accum)
    else:
        with pytest.raises(ConfigError, match=r"level2_steps 2 exceeds the micro-batches of one cycle \(level1_steps 1 "
                                              r"x gradient_accumulation_steps 1\)"):
            check_objective_fits(cfg, micro_batch=8, accum=accum)
