"""MLO-MAE through train/pretrain.py: resume, continued pretraining from MAE, 2 CPU ranks on
labeled shards with the split record and the level-II test accuracy."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import (
    CHILD_EXIT,
    CPU_DS,
    DEBUG_PRESET,
    REPO,
    run_pretrain,
    run_pretrain_calls,
)
from ports import free_port

from data.write_shards import main as write_shards
from train.run.folder import read_metrics

PRESET = REPO / "train" / "configs" / "mlomae/debug.json"
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def test_continued_pretraining_from_mae_then_resume_is_exact(tmp_path):
    mae, straight, resumed = tmp_path / "mae", tmp_path / "mlo", tmp_path / "resumed"
    common = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--run.progress", "false"]
    mlo = [*common, "--config", str(PRESET), "--model.init_from", str(mae), "--run.max_steps", "6",
           "--run.ckpt_every", "3"]
    proc = run_pretrain_calls([
        [*common, "--output_dir", str(mae), "--run.max_steps", "2"],
        [*mlo, "--output_dir", str(straight), "--run.vis_every", "6"],
        [*mlo, "--output_dir", str(resumed), "--resume", str(straight / "checkpoints" / "step00000003"),
         "--run.export", "false"],
    ])
    assert f"initialised encoder + decoder from {mae}" in proc.stderr
    rows, again = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in again] == [4, 5, 6]
    for key in ("loss", "recon_loss", "level2_loss", "level3_loss", "hypergrad_norm", "mask_prob_mean"):
        for a, b in zip(again, rows[3:]):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a, b)
    assert all(r["hypergrad_norm"] > 0 for r in rows[1:])
    assert list((straight / "vis").glob("mlo_masks_step*.png"))  # the learned masks (Fig. 4)


@pytest.mark.parametrize("level2_batch", ["shared", "own"])
def test_a_resume_inside_a_cycle_is_exact(tmp_path, level2_batch):
    """Two level-I steps per cycle and a level II over two micro-batches (one per step): a checkpoint
    at step 3 falls inside a cycle, whose level II at step 4 reads step 3's micro-batch too; with
    `own` every level II reads the step before's. Those micro-batches are each rank's own, saved in
    its file of the checkpoint, so the resumed steps repeat the straight run's values."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--config", str(PRESET), "--run.progress",
           "false", "--run.max_steps", "6", "--run.ckpt_every", "3", "--run.export", "false",
           "--mlomae.level1_steps", "2", "--mlomae.level2_steps", "2", "--mlomae.level2_batch", level2_batch]
    run_pretrain_calls([[*run, "--output_dir", str(straight)],
                        [*run, "--output_dir", str(resumed), "--resume", str(straight / "checkpoints" / "step00000003")]])
    rows, again = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in again] == [4, 5, 6] and "level2_loss" in again[0] and "level3_loss" in again[2]
    for key in ("loss", "level2_loss", "level3_loss", "hypergrad_norm"):
        for a, b in zip(again, rows[3:]):
            assert (key in a) == (key in b) and a.get(key) == b.get(key), (key, a, b)


def test_two_cpu_ranks_on_labeled_shards(image_folder, tmp_path):
    shards = tmp_path / "shards"
    write_shards(["imagefolder", str(image_folder), str(shards), "--name", "train", "--samples_per_shard", "3"])
    write_shards(["imagefolder", str(image_folder), str(shards), "--name", "test", "--samples_per_shard", "6"])
    out = tmp_path / "run"
    run_pretrain(out, "--config", str(PRESET), "--model.in_chans", "3", "--data.source", "shards",
                 "--data.train_index", str(shards / "train.json"), "--data.eval_index", str(shards / "test.json"),
                 "--data.num_workers", "1", "--mlomae.num_classes", "3", "--run.max_steps", "3", ranks=2)
    split = json.loads((out / "split.json").read_text())
    assert split["num_train"] + split["num_val"] == 24 and split["val_fraction"] == 0.2
    assert 0 < split["num_val"] < 24
    result = json.loads((out / "eval.json").read_text())  # level-II head on the test split
    assert result["step"] == 3 and result["eval_samples"] == 24 and 0.0 <= result["eval_top1"] <= 100.0
    rows = [r for r in read_metrics(out) if "loss" in r]  # (evaluation rows hold eval_* only)
    assert [r["step"] for r in rows] == [1, 2, 3] and all("level3_loss" in r for r in rows)


REPLICATION = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    sys.path.insert(0, "tests/model/objectives")
    from test_mlomae import batch, objective
    from train.engine import distributed
    rank, _, _ = distributed.init()
    obj = objective(seed=0)
    init = torch.cat([p.detach().flatten().clone() for p in [*obj.aux.mask_net.parameters(), *obj.aux.head.parameters()]])
    for step in range(3):
        b = batch(seed=100 * rank + step)  # different data on each rank
        obj(b)
        obj.after_optimizer_step(lr=1e-2, batches=[b])
    flat = torch.cat([p.detach().flatten() for p in [*obj.aux.mask_net.parameters(), *obj.aux.head.parameters()]])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    assert not torch.equal(flat, init), "T and C did not move"
    assert torch.equal(gathered[0], gathered[1]), "T / C differ across ranks"
    print("replicated", flush=True)
""") + CHILD_EXIT


def test_masking_network_and_head_stay_identical_across_ranks(tmp_path):
    script = tmp_path / "replication.py"
    script.write_text(REPLICATION)
    launcher = str(Path(sys.executable).parent / "deepspeed")
    proc = subprocess.run([launcher, "--num_gpus", "2", "--master_port", str(free_port()), str(script)], cwd=REPO,
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("replicated") == 2
