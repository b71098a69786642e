"""Pretraining reads webdataset shards through train/pretrain.py, and resumes mid-stream."""
import pytest
from conftest import run_pretrain

from data.write_shards import main as write_shards
from train.run.folder import read_metrics


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("folder")
    rng = np.random.default_rng(0)
    for c in range(2):
        (root / str(c)).mkdir()
        for i in range(24):
            Image.fromarray(rng.integers(0, 255, (20, 20), dtype=np.uint8), mode="L").save(root / str(c) / f"{i}.png")
    out = tmp_path_factory.mktemp("shards")
    write_shards(["imagefolder", str(root), str(out), "--samples_per_shard", "6"])  # 8 shards
    return out / "train.json"


def _args(index, *extra):
    return ("--data.source", "shards", "--data.train_index", str(index), "--data.epoch_size", "0",
            "--data.num_workers", "2", "--model.in_chans", "3", "--run.ckpt_every", "3", *extra)


def test_pretrain_from_shards_and_resume_mid_stream(shards, tmp_path):
    straight, split = tmp_path / "a", tmp_path / "b"
    run_pretrain(straight, *_args(shards, "--run.max_steps", "6"))
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == list(range(1, 7))  # 48 samples / batch 8 = 6 steps per epoch
    assert rows[0]["data_skipped_undecodable_image"] == 0
    run_pretrain(split, *_args(shards, "--run.max_steps", "3"))
    run_pretrain(split, *_args(shards, "--run.max_steps", "6", "--resume", "auto"))
    want = {r["step"]: r["loss"] for r in rows}
    assert [r["loss"] for r in read_metrics(split)[3:]] == [want[s] for s in (4, 5, 6)]


def test_too_few_shards_rejected_before_training(shards, tmp_path):
    proc = run_pretrain(tmp_path / "run", *_args(shards, "--data.num_workers", "16"), check=False)
    assert proc.returncode == 2 and "8 shards cannot feed 1 ranks x 16 workers" in proc.stderr
    assert not (tmp_path / "run").exists()
