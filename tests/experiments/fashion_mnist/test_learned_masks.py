"""learned_masks.py reads T back from an MLO-MAE checkpoint and tells a collapsed mask from a
working one."""
import json
import shutil

import pytest
import torch
from conftest import CPU_DS, REPO, fake_fashion_mnist

from data.write_shards import main as write_shards
from experiments.fashion_mnist.learned_masks import main as learned_masks
from model.objectives import build_objective
from train.build import build_encoder
from train.config import parse_args, section, to_dict

PRESET = REPO / "train" / "configs" / "mlomae" / "debug.json"


def save_tag(root, step, obj):
    tag = root / f"step{step:08d}"
    tag.mkdir(parents=True)
    torch.save({"module": obj.state_dict()}, tag / "mp_rank_00_model_states.pt")
    (tag / "complete.json").write_text(json.dumps({"step": step, "zero_stage": 0}))


def test_a_collapsed_masking_network_is_told_from_a_working_one(tmp_path):
    shards = tmp_path / "shards"
    write_shards(["fashion-mnist", str(shards), "--src", str(fake_fashion_mnist(tmp_path / "idx", 20, 40)),
                  "--samples_per_shard", "20"])
    run = tmp_path / "run"
    cfg = parse_args(["--config", str(PRESET), "--ds_config", str(CPU_DS), "--model.in_chans", "3",
                      "--data.source", "shards", "--data.train_index", str(shards / "train.json"),
                      "--data.eval_index", str(shards / "test.json"), "--output_dir", str(run)])
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))
    shutil.copy(CPU_DS, run / "ds_config.json")
    torch.manual_seed(0)
    obj = build_objective(cfg.objective, build_encoder(cfg), section(cfg))
    save_tag(run / "checkpoints", 1, obj)  # T at init: reads the image
    first, last = obj.aux.mask_net.net[1], obj.aux.mask_net.net[3]
    n = last.out_features
    with torch.no_grad():  # T collapsed: its output is its last bias, +20 on the first quarter of the patches
        first.weight.zero_()
        first.bias.zero_()
        last.bias.copy_(torch.where(torch.arange(n) < n // 4, 20.0, -20.0))
    save_tag(run / "checkpoints", 2, obj)

    working, collapsed = learned_masks([str(run), "--images", "30"])
    assert [working["tag"], collapsed["tag"]] == ["step00000001", "step00000002"]
    assert working["images"] == collapsed["images"] == 30 and working["patches"] == n
    assert working["distinct_masks"] > 1 and working["mask_prob_spread"] > 0
    assert working["mask_prob_saturated"] < 1
    masked = round(n * cfg.mlomae.mask_ratio)
    assert collapsed["distinct_masks"] == 1 and collapsed["always_masked"] == masked
    assert collapsed["mask_prob_spread"] == 0.0 and collapsed["mask_prob_saturated"] == 1.0
    assert collapsed["mask_prob_mean"] == pytest.approx((n // 4) / n, abs=1e-5)
    assert collapsed["mask_prob_masked"] == pytest.approx((n // 4) / masked, abs=1e-5)


def test_a_run_of_another_objective_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step00000001").mkdir(parents=True)
    (run / "checkpoints" / "step00000001" / "complete.json").write_text(json.dumps({"step": 1, "zero_stage": 0}))
    cfg = parse_args(["--config", str(REPO / "train" / "configs" / "mae" / "debug.json"), "--ds_config", str(CPU_DS)])
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))
    shutil.copy(CPU_DS, run / "ds_config.json")
    with pytest.raises(ValueError, match="only mlomae has a masking network"):
        learned_masks([str(run), "--index", "unused.json"])
