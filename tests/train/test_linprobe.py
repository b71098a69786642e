"""train/linprobe.py end to end: LARS on a frozen exported encoder, evaluation on shards."""
import json
import subprocess
import sys

import torch
from conftest import REPO, run_pretrain

from data.shard_index import ShardSet
from data.write_shards import main as write_shards
from model.objectives import build_objective
from model.objectives.linear_probe import LinearProbeConfig
from model.registry import create_model
from train.engine.state_files import read_tensors
from train.run.evaluation import classification_accuracy
from train.run.folder import read_metrics


def _linprobe(out, ds, *args):
    cmd = [sys.executable, str(REPO / "train" / "linprobe.py"), "--ds_config", str(ds), "--output_dir", str(out),
           "--run.progress", "false", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_linear_probe_on_a_frozen_encoder(image_folder, tmp_path):
    for name in ("train", "test"):  # the same images; the evaluation may not score the training shards
        write_shards(["imagefolder", str(image_folder), str(tmp_path / "s"), "--samples_per_shard", "3", "--name", name])
    index = tmp_path / "s" / "train.json"
    shard_args = ["--data.source", "shards", "--data.train_index", str(index), "--data.num_workers", "1",
                  "--data.epoch_size", "0", "--model.in_chans", "3"]
    run_pretrain(tmp_path / "mae", *shard_args, "--run.max_steps", "2")
    encoder_file = tmp_path / "mae" / "encoder.safetensors"

    ds = tmp_path / "stage0.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                              "gradient_clipping": 0.0, "zero_optimization": {"stage": 0}}))
    out = tmp_path / "probe"
    proc = _linprobe(out, ds, "--model.name", "vit_debug_patch4", "--model.init_from", str(encoder_file),
                     *shard_args, "--data.eval_index", str(tmp_path / "s" / "test.json"), "--data.eval_crop_pct", "1.0",
                     "--linprobe.num_classes", "3", "--optim.epochs", "2", "--optim.warmup_epochs", "1",
                     "--run.ckpt_every", "3", "--run.log_every", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert (config["optim"]["name"], config["optim"]["blr"], config["optim"]["weight_decay"]) == ("lars", 0.1, 0.0)

    rows = read_metrics(out)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 7))  # 24 samples / 8 = 3 steps x 2 epochs
    [final_eval] = [r for r in rows if "eval_top1" in r]
    assert final_eval["step"] == 6 and final_eval["eval_samples"] == 24

    # the encoder stayed frozen, the head moved, and the logged accuracy is reproducible from the checkpoint
    module = read_tensors(out / "checkpoints" / "step00000006")
    from safetensors.torch import load_file

    for k, v in load_file(str(encoder_file)).items():
        assert torch.equal(module[f"encoder.{k}"], v), k
    probe = build_objective("linprobe", create_model("vit_debug_patch4"), LinearProbeConfig(num_classes=3))
    probe.load_state_dict(module)
    probe.eval()
    again = classification_accuracy(probe.predict, ShardSet.from_index(index), 28, 1.0, 0, 1,
                                    torch.device("cpu"), torch.float32)
    assert again == {k: final_eval[k] for k in again}
    assert json.loads((out / "eval.json").read_text())["eval_top1"] == final_eval["eval_top1"]


def test_lars_with_zero_partitions_is_rejected(tmp_path):
    proc = _linprobe(tmp_path / "run", REPO / "ds_configs" / "cpu_debug.json", "--data.source", "synthetic")
    assert proc.returncode == 2 and "ZeRO stage 0" in proc.stderr
