"""A directory of shards written by webdataset's ShardWriter with no labels
(img2dataset's layout: jpg / webp + txt + json) pretrains MAE end to end through the documented
command, with no sample skipped; and labels read from a json field (data.label_key) train a classifier."""
import os
import subprocess
import sys

from conftest import REPO
from wds_shards import write_img2dataset_shards, write_index

from train.run.folder import read_metrics


def pretrain(out, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "train.pretrain", "--ds_config", "ds_configs/cpu_debug.json", "--config",
           "train/configs/mae/debug.json", "--output_dir", str(out), "--run.progress", "false", *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)


def test_unlabeled_shardwriter_shards_pretrain_mae_with_no_sample_skipped(tmp_path):
    tars = write_img2dataset_shards(tmp_path / "shards")  # 2 shards x 8 samples, 2 of them webp
    index = write_index(tmp_path / "shards" / "train.json", tars, [8, 8])
    proc = pretrain(tmp_path / "run", "--data.source", "shards", "--data.train_index", str(index),
                    "--data.epoch_size", "0", "--model.in_chans", "3", "--run.max_steps", "4")
    assert proc.returncode == 0, proc.stderr[-4000:]
    [said] = [line for line in proc.stderr.splitlines() if "is unlabeled" in line]  # one warning, not silence
    assert said.startswith(f"[pretrain] data.train_index {index} is unlabeled") and "mae reads no labels" in said
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # 16 samples / batch 8: two epochs
    skipped = {k: v for k, v in rows[-1].items() if k.startswith("data_skipped_")}
    assert skipped and not any(skipped.values()), skipped
    assert (tmp_path / "run" / "encoder.safetensors").is_file()


def test_labels_from_a_json_field_train_a_linear_probe(tmp_path):
    tars = write_img2dataset_shards(tmp_path / "shards", label_field="label")
    index = write_index(tmp_path / "shards" / "train.json", tars, [8, 8], labeled=True, label_key="json:label",
                        classes=["0", "1", "2"])
    args = ["--data.source", "shards", "--data.train_index", str(index), "--model.in_chans", "3", "--objective",
            "linprobe", "--linprobe.num_classes", "3", "--run.max_steps", "2"]
    proc = pretrain(tmp_path / "run", *args)  # data.label_key's default: the index's own key
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and "train_top1" in rows[0]
    assert not any(v for k, v in rows[-1].items() if k.startswith("data_skipped_"))
