"""MixedAE and every Table A4 ablation through train/pretrain.py under DeepSpeed (ZeRO-2, CPU)."""
import json
import os
import subprocess
import sys

import pytest
from conftest import CHILD_EXIT, CPU_DS, REPO, run_pretrain

from train.run.folder import read_metrics

PRESET = REPO / "train" / "configs" / "mixedae/debug.json"
ABLATIONS = REPO / "train" / "configs" / "mixedae" / "variants"

# ablation overlay -> (losses logged, TopK accuracy logged)
EXPECTED = {
    "naive_mixing": ({"loss_recon"}, False),
    "masked_self_attention": ({"loss_recon"}, False),
    "homocon_only": ({"loss_homocon"}, True),
    "recon_only": ({"loss_recon"}, True),
    "without_mixing": ({"loss_recon", "loss_homocon"}, False),
    "without_segment_embeddings": ({"loss_recon", "loss_homocon"}, True),
}


def test_default_mixedae_trains_resumes_and_exports(tmp_path):
    out = tmp_path / "run"
    run_pretrain(out, "--config", str(PRESET), "--run.max_steps", "6", "--run.ckpt_every", "3", "--run.vis_every", "6")
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for key in ("loss_recon", "loss_homocon", "topk_acc", "topk_acc_block0", "topk_acc_block1"):
        assert all(key in r for r in rows), key
    assert all(0.0 <= r["topk_acc_block1"] <= 1.0 for r in rows)
    assert all(abs(r["loss"] - r["loss_recon"] - r["loss_homocon"]) < 1e-4 for r in rows)
    assert (out / "encoder.safetensors").is_file() and list((out / "vis").glob("mixedae_unmixing_step*.png"))
    # A resumed run from step 3 continues the same stream: identical losses at steps 4-6.
    resumed = tmp_path / "resumed"
    run_pretrain(resumed, "--config", str(PRESET), "--run.max_steps", "6", "--run.ckpt_every", "3",
                 "--resume", str(out / "checkpoints" / "step00000003"))
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [4, 5, 6]
    for a, b in zip(again, rows[3:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)


def test_every_table_a4_ablation_trains_from_its_preset(tmp_path):
    # One process runs all six (the start-up cost is paid once); each gets its own run folder.
    runs = {name: tmp_path / name for name in EXPECTED}
    calls = [["--ds_config", str(CPU_DS), "--config", str(PRESET), "--config", str(ABLATIONS / f"{name}.json"),
              "--output_dir", str(out), "--run.max_steps", "3", "--run.progress", "false", "--run.export", "false"]
             for name, out in runs.items()]
    code = "import json, sys\nfrom train.pretrain import main\nfor argv in json.loads(sys.argv[1]):\n    main(argv)\n" + CHILD_EXIT
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(calls)], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name, (losses, topk) in EXPECTED.items():
        rows = read_metrics(runs[name])
        assert len(rows) == 3, name
        assert {k for k in rows[-1] if k.startswith("loss_")} == losses, name
        assert ("topk_acc" in rows[-1]) == topk, name
        config = json.loads((runs[name] / "config.json").read_text())["mixedae"]
        assert config == {**config, **json.loads((ABLATIONS / f"{name}.json").read_text())["mixedae"]}


def test_micro_batch_not_divisible_by_the_group_is_rejected_before_start(tmp_path):
    ds = json.loads(CPU_DS.read_text()) | {"train_micro_batch_size_per_gpu": 6}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    proc = run_pretrain(tmp_path / "run", "--config", str(PRESET), ds_config=tmp_path / "ds.json", check=False)
    assert proc.returncode == 2
    assert "train_micro_batch_size_per_gpu in the ds_config to a multiple of 4" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing written: rejected before any process group
