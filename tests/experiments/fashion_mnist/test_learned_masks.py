"""learned_masks.py reads T back from an MLO-MAE checkpoint and tells a collapsed mask from a
working one; the study report collects it for the kept epoch checkpoints."""
import json
import shutil

import pytest
import torch
from conftest import CPU_DS, REPO, fake_fashion_mnist, save_module_state

from data.write_shards import main as write_shards
from experiments.fashion_mnist.learned_masks import main as learned_masks
from experiments.fashion_mnist.report import collect, mask_lines
from model.objectives import build_objective
from train.config.options import section
from train.config.parsing import parse_args, to_dict
from train.config.plan import build_encoder

PRESET = REPO / "train" / "configs" / "mlomae" / "debug.json"


def save_tag(root, step, obj, pinned=False):
    tag = root / f"step{step:08d}"
    tag.mkdir(parents=True)
    save_module_state(tag, obj.state_dict())
    (tag / "complete.json").write_text(json.dumps({"step": step, "zero_stage": 0, "pinned": pinned}))


def mlomae_run(tmp_path):
    """An mlomae run folder on 40 labeled test images: T at init saved at step 1 (an epoch's end,
    pinned) and step 2; T collapsed (its output is its last bias, +20 on the first quarter of the
    patches) at step 3. Returns (run folder, config, number of patches)."""
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
    save_tag(run / "checkpoints", 1, obj, pinned=True)
    save_tag(run / "checkpoints", 2, obj)
    first, last = obj.aux.mask_net.net[1], obj.aux.mask_net.net[3]
    n = last.out_features
    with torch.no_grad():
        first.weight.zero_()
        first.bias.zero_()
        last.bias.copy_(torch.where(torch.arange(n) < n // 4, 20.0, -20.0))
    save_tag(run / "checkpoints", 3, obj)
    return run, cfg, n


def test_a_collapsed_masking_network_is_told_from_a_working_one(tmp_path):
    run, cfg, n = mlomae_run(tmp_path)
    working, collapsed = learned_masks([str(run), "--images", "30", "--tags", "step00000001,step00000003"])
    assert [working["tag"], collapsed["tag"]] == ["step00000001", "step00000003"]
    assert working["images"] == collapsed["images"] == 30 and working["patches"] == n
    assert working["distinct_masks"] > 1 and working["mask_prob_spread"] > 0
    assert working["mask_prob_saturated"] < 1
    masked = round(n * cfg.mlomae.mask_ratio)
    assert collapsed["distinct_masks"] == 1 and collapsed["always_masked"] == masked
    assert collapsed["mask_prob_spread"] == 0.0 and collapsed["mask_prob_saturated"] == 1.0
    assert collapsed["mask_prob_mean"] == pytest.approx((n // 4) / n, abs=1e-5)
    assert collapsed["mask_prob_masked"] == pytest.approx((n // 4) / masked, abs=1e-5)


def test_the_report_collects_the_masks_of_kept_epochs_and_the_last_checkpoint(tmp_path):
    run, cfg, n = mlomae_run(tmp_path)
    seed = tmp_path / "study" / "mlomae" / "seed0"
    seed.mkdir(parents=True)
    run.rename(seed / "pretrain")
    (seed / "pretrain" / "meta.json").write_text(json.dumps({"total_steps": 8}))  # 4 epochs: 2 steps each
    (seed / "result.json").write_text(json.dumps({"entry": "mlomae", "label": "MLO-MAE", "seed": 0}))
    collect(tmp_path / "study", tmp_path / "summaries", tmp_path / "figures")
    summary = json.loads((tmp_path / "summaries" / "mlomae_seed0.json").read_text())
    masks = summary["learned_masks"]  # step 1 (pinned) and step 3 (the last); step 2 is neither
    assert [(m["step"], m["epoch"]) for m in masks] == [(1, 0.5), (3, 1.5)]
    assert masks[0]["distinct_masks"] > 1 and masks[1]["distinct_masks"] == 1
    assert masks[0]["images"] == 40  # the whole (fake) test split: fewer than 1000 images
    lines = mask_lines([summary])
    assert lines[-2].startswith("| MLO-MAE seed 0 | 0.5 | ") and lines[-1].startswith("| MLO-MAE seed 0 | 1.5 | 1 | ")
    masked = round(n * cfg.mlomae.mask_ratio)
    # the collapsed T: p = 1 on the first quarter of the patches, 0 elsewhere; those all among the masked
    assert lines[-1] == (f"| MLO-MAE seed 0 | 1.5 | 1 | {masked} of {n} | {(n // 4) / n:.3f} | "
                         f"{(n // 4) / masked:.3f} | 1.000 | 0.0000 |")
    assert mask_lines([{"label": "MAE", "seed": 0}]) == []


def test_a_run_of_another_objective_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step00000001").mkdir(parents=True)
    (run / "checkpoints" / "step00000001" / "complete.json").write_text(json.dumps({"step": 1, "zero_stage": 0}))
    cfg = parse_args(["--config", str(REPO / "train" / "configs" / "mae" / "debug.json"), "--ds_config", str(CPU_DS)])
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))
    shutil.copy(CPU_DS, run / "ds_config.json")
    with pytest.raises(ValueError, match="trained objective 'mae'; this tool reads 'mlomae' runs"):
        learned_masks([str(run), "--index", "unused.json"])


def test_always_masked_counts_the_patches_masked_in_every_image():
    import types

    from experiments.fashion_mnist.learned_masks import mask_report

    # T's probabilities for 3 images of 4 patches, ratio 0.5: the top two are masked in each image,
    # {0, 1}, {0, 2}, {0, 3}: patch 0 in all three (every patch in some image)
    probs = torch.tensor([[0.9, 0.8, 0.1, 0.2], [0.9, 0.1, 0.8, 0.2], [0.9, 0.2, 0.1, 0.8]])
    mask = torch.zeros(3, 4)
    mask.scatter_(1, probs.topk(2, dim=1).indices, 1.0)
    obj = types.SimpleNamespace(cfg=types.SimpleNamespace(mask_ratio=0.5),
                                mask_probabilities=lambda images: (None, probs[images.long()]))
    report = mask_report(obj, torch.arange(3), batch_size=2)  # "images" 0, 1, 2, in two batches
    assert report["always_masked"] == int(mask.all(0).sum()) == 1
    assert (report["images"], report["patches"], report["distinct_masks"]) == (3, 4, 3)
