"""Every entry point runs as a script and as a module: `python train/pretrain.py --help` from any
folder, `python -m train.pretrain --help` from the repository root, and `deepspeed train/pretrain.py`
on 2 CPU ranks, all without PYTHONPATH (each script puts the repository root first on its path
itself: nothing is installed that could shadow another package named data, model or train)."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import CPU_DS, DEBUG_PRESET, REPO, _free_port

FOLDERS = ("train", "data", "launchers", "tools", "kernels", "experiments", "benchmarks")


def entry_points() -> list[str]:
    """Every module of the repository with a `__main__` block (tests left out)."""
    found = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if 'if __name__ == "__main__"' in path.read_text():
                found.append(str(path.relative_to(REPO)))
    return found


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def both_forms(script: str, elsewhere: Path) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    module = script.removesuffix(".py").replace("/", ".")
    as_script = subprocess.run([sys.executable, str(REPO / script), "--help"], cwd=elsewhere, capture_output=True,
                               text=True, env=clean_env(), timeout=300)
    as_module = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                               env=clean_env(), timeout=300)
    return as_script, as_module


def test_every_entry_point_answers_help_as_a_script_from_anywhere_and_as_a_module(tmp_path):
    scripts = entry_points()
    assert {"train/pretrain.py", "train/finetune.py", "train/linprobe.py", "train/bench.py", "launchers/submit.py",
            "tools/census.py", "data/write_shards.py"} <= set(scripts)
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(scripts, pool.map(lambda s: both_forms(s, tmp_path), scripts)))
    for script, runs in results.items():
        for form, proc in zip(("script", "module"), runs):
            assert proc.returncode == 0, f"{script} as a {form}: {proc.stderr[-2000:]}"
            assert "usage" in (proc.stdout + proc.stderr).lower() or "options" in proc.stdout.lower(), (script, form)
    assert not list(tmp_path.iterdir())  # --help writes nothing, wherever it runs


@pytest.mark.distributed
def test_deepspeed_runs_the_pretraining_script_on_two_cpu_ranks(tmp_path):
    """The design's command form: `deepspeed train/pretrain.py --ds_config ...`."""
    launcher = str(Path(sys.executable).parent / "deepspeed")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(_free_port()), "train/pretrain.py", "--ds_config",
           str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(tmp_path / "run"), "--run.max_steps", "2",
           "--run.progress", "false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=clean_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "world 2 on cpu" in proc.stdout + proc.stderr
    assert (tmp_path / "run" / "encoder.safetensors").is_file()
