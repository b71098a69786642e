"""study.py --jobs: entries as their own processes side by side, each with cores / jobs threads,
on a tiny Fashion-MNIST (the random-init control: evaluation and a fine-tuning subprocess)."""
import json
import os
import subprocess
import sys

from conftest import REPO

from data.write_shards import main as write_shards
from tools.phases.study import tiny_fashion_mnist


def test_two_jobs_run_every_seed_and_the_report_has_both(tmp_path):
    shards = tmp_path / "shards"
    write_shards(["fashion-mnist", str(shards), "--src", str(tiny_fashion_mnist(tmp_path / "idx")),
                  "--samples_per_shard", "80"])
    out, report = tmp_path / "runs", tmp_path / "RESULTS.md"
    cmd = [sys.executable, "-m", "experiments.fashion_mnist.study", "--shards", str(shards), "--seeds", "0,1",
           "--only", "random_init", "--pretrain_samples", "128", "--finetune_samples", "128", "--jobs", "2",
           "--out", str(out), "--report", str(report)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    threads = max(1, (os.cpu_count() or 1) // 2)
    for seed in (0, 1):
        run = out / "random_init" / f"seed{seed}"
        result = json.loads((run / "result.json").read_text())
        assert result["seed"] == seed and result["torch_threads"] == threads
        assert "[study] random_init seed" in (run / "study.log").read_text()
    assert "| random init (control) |" in report.read_text() and "seeds [0, 1]" in report.read_text()
    # entries that fail (a file where each fine-tuning run folder goes) are named after all ran
    bad_out = tmp_path / "bad"
    for seed in (0, 1):
        (bad_out / "random_init" / f"seed{seed}").mkdir(parents=True)
        (bad_out / "random_init" / f"seed{seed}" / "finetune").write_text("not a folder")
    bad = subprocess.run([*cmd[:-4], "--out", str(bad_out), "--report", str(report)], cwd=REPO, capture_output=True,
                         text=True, env=env, timeout=600)
    assert bad.returncode == 1 and "failed: random_init seed 0, random_init seed 1" in bad.stderr
    assert "train.finetune failed" in (bad_out / "random_init" / "seed0" / "study.log").read_text()
