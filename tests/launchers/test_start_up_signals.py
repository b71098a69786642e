"""Slurm's stop signals during a rank's start-up (imports, process group, engine, resume):
train/pretrain.py catches them from its first line (train/run/early_signals.py) instead of dying
(what a real cluster does)."""
import json
import os
import signal
import subprocess
import sys
import time

from conftest import CPU_DS, DEBUG_PRESET, REPO

from train.run.folder import read_metrics


def catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for sig (/proc/PID/status SigCgt)."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigCgt")).split()[1], 16)
    return bool(mask >> (sig - 1) & 1)


def signal_early(proc: subprocess.Popen, sig: int, within: float = 2.0) -> None:
    """Send sig as soon as the process catches it, or after `within` s (long before the engine exists)."""
    end = time.time() + within
    while time.time() < end and not catches(proc.pid, sig):
        time.sleep(0.01)
    proc.send_signal(sig)


def test_a_signal_during_start_up_is_kept_for_the_loop_and_a_config_error_still_exits_2(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.log\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))},
           "SLURM_JOB_ID": "77", "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"
    common = ["--config", str(DEBUG_PRESET), "--run.progress", "false", "--run.stop_check_every", "1"]
    # the time-limit warning while the rank is still importing: checkpoint at the first stop check, requeue
    warned = subprocess.Popen([sys.executable, "-m", "train.pretrain", "--ds_config", str(CPU_DS), *common,
                               "--output_dir", str(run_dir), "--data.epoch_size", "100000"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # a configuration error on this rank while srun --kill-on-bad-exit SIGTERMs it for another rank's
    bad = subprocess.Popen([sys.executable, "-m", "train.pretrain", "--ds_config",
                            str(REPO / "ds_configs" / "vit_b_8xv100_fp16_zero1.json"), *common,
                            "--output_dir", str(tmp_path / "bad")], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    signal_early(warned, signal.SIGUSR1)
    signal_early(bad, signal.SIGTERM)

    out, err = bad.communicate(timeout=120)
    assert bad.returncode == 2, (bad.returncode, err[-2000:])
    assert err.strip().splitlines()[-1].startswith("config error: ds_config enables fp16")

    out, _ = warned.communicate(timeout=300)
    assert warned.returncode == 0, out[-3000:]
    assert "requeued Slurm job 77" in out
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "77"]
    stopped = read_metrics(run_dir)[-1]["step"]
    assert stopped <= 2  # the first stop checks, not the end of the 100000-sample epoch
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step{stopped:08d}" and json.loads((run_dir / "checkpoints" / latest / "complete.json")
                                                         .read_text())["world_size"] == 1
