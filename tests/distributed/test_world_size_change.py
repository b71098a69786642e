"""Resuming on another world size and ZeRO stage: weights and optimizer state by parameter name
(train/engine/state_files.py), the shard stream re-laid out for the data (2 CPU ranks -> 1)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_pretrain
from ports import free_port

from data.write_shards import main as write_shards
from train.run.folder import read_metrics

pytestmark = pytest.mark.distributed


def deepspeed(ranks: int, *args: str) -> None:
    launcher = str(Path(sys.executable).parent / "deepspeed")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    cmd = [launcher, "--num_gpus", str(ranks), "--master_port", str(free_port()), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    # a rank's traceback can end up anywhere in the interleaved output: every error line first
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line or "error" in line]
    assert proc.returncode == 0, "\n".join(errors[:40]) + "\n...\n" + proc.stdout[-3000:] + proc.stderr[-3000:]


def write_ds(path: Path, stage: int = 2, **extra) -> Path:
    """Global batch 16 with micro 8: the accumulation follows the world size (2 ranks x 1, 1 rank x 2)."""
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0,
                                "zero_optimization": {"stage": stage}, "bf16": {"enabled": False}, **extra}))
    return path


STAGES = [(0, 3), (1, 2), (2, 0), (3, 1)]  # (trained on 2 ranks, resumed on 1)


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> Path:
    """Every case of STAGES, trained in one 2-rank launch and resumed in one 1-rank launch."""
    out = tmp_path_factory.mktemp("reshard")
    script = str(REPO / "tests" / "distributed" / "reshard_engine_check.py")
    deepspeed(2, script, str(out), "train", *(f"{a}to{b}={a}" for a, b in STAGES))
    deepspeed(1, script, str(out), "resume", *(f"{a}to{b}={b}" for a, b in STAGES))
    return out


@pytest.mark.parametrize("stages", STAGES)
def test_weights_moments_and_schedule_carry_over_from_2_ranks_to_1_and_across_zero_stages(resharded, stages):
    case = resharded / f"{stages[0]}to{stages[1]}"
    want = json.loads((case / "losses_train.json").read_text())
    got = json.loads((case / "losses_resume.json").read_text())
    assert list(got) == ["4", "5"]
    assert got["4"] == pytest.approx(want["4"], rel=1e-6)  # weights after step 3
    assert got["5"] == pytest.approx(want["5"], rel=1e-5)  # + Adam moments, step count, lr of step 4
    assert got["5"] != pytest.approx(want["4"], rel=1e-3)  # the step changed the loss
    tag = case / "run" / "checkpoints" / "step00000003"
    # each rank writes its part of the optimizer state (the sharded stages their shards; DDP's replicas
    # are split between the ranks), and rank 0 the weights by name
    assert {p.name for p in (tag / "optim").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    assert {p.name for p in tag.glob("*.safetensors")} == {"model.safetensors"}


def test_pretrain_on_shards_under_zero3_with_checkpointing_continues_on_one_rank(tmp_path):
    import numpy as np
    from PIL import Image

    src = tmp_path / "src"
    for c in range(2):
        (src / str(c)).mkdir(parents=True)
        for i in range(24):
            Image.fromarray(np.full((8, 8), c * 100 + i, dtype=np.uint8)).save(src / str(c) / f"{i}.png")
    write_shards(["imagefolder", str(src), str(tmp_path / "s"), "--samples_per_shard", "6"])  # 8 shards
    ds = write_ds(tmp_path / "ds.json", stage=3, activation_checkpointing={})  # the ViT-H matrix's setting
    args = ("--data.source", "shards", "--data.train_index", str(tmp_path / "s" / "train.json"), "--data.epoch_size",
            "0", "--data.num_workers", "1", "--model.in_chans", "3", "--run.ckpt_every", "2")
    run = tmp_path / "run"
    run_pretrain(run, *args, "--run.max_steps", "2", "--run.vis_every", "2", ranks=2, ds_config=ds)
    # the figures: every rank gathers the sharded weights, rank 0 draws
    assert sorted(p.name for p in (run / "vis").glob("*.png")) == ["cls_attention_step00000002.png",
                                                                   "mae_reconstruction_step00000002.png"]
    from train.weights.export import load_timm_encoder

    assert load_timm_encoder(run / "encoder.safetensors").patch_embed.proj.weight.shape[0] == 32  # ZeRO-3 exports
    proc = run_pretrain(run, *args, "--run.max_steps", "3", "--resume", "auto", ds_config=ds)
    assert "resumed from" in proc.stderr and "written by 2 ranks, continued on 1" in proc.stderr
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["data_skipped_undecodable_image"] == 0
    meta = json.loads((run / "meta.json").read_text())
    assert meta["world_size"] == 1 and meta["batch"] == {"micro": 8, "accum": 2, "world": 1, "global": 16}
    tag = run / "checkpoints" / "step00000003"
    assert json.loads((tag / "complete.json").read_text())["world_size"] == 1
