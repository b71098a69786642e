"""Every entry point runs as a script and as a module: `python train/pretrain.py --help` from any
folder, `python -m train.pretrain --help` from the repository root, and `deepspeed train/pretrain.py`
on 2 CPU ranks, all without PYTHONPATH (each script puts the repository root first on its path
itself: nothing is installed that could shadow another package named data, model or train)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_DS, DEBUG_PRESET, REPO
from ports import free_port

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


# Runs each entry point's --help in this one process, as `python <path>` (runpy.run_path: the
# script's own code must put the repository root on sys.path) or as `python -m <module>`
# (runpy.run_module), and prints one line per entry point with the exit status
HELP_ALL = """
import contextlib, io, json, runpy, sys
form, names = sys.argv[1], json.loads(sys.argv[2])
path = list(sys.path)
for name in names:
    sys.argv = [name, "--help"]
    sys.path[:] = path  # each script must put the repository root first itself
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if form == "script":
                runpy.run_path(name, run_name="__main__")
            else:
                runpy.run_module(name, run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as e:
        status = e.code or 0
    print(json.dumps([name, status, "usage" in out.getvalue().lower() or "options" in out.getvalue().lower(),
                      out.getvalue()[-300:], sys.path[0]]))
"""


def help_all(form: str, names: list[str], cwd: Path) -> dict[str, tuple[int, bool, str]]:
    import json

    proc = subprocess.run([sys.executable, "-c", HELP_ALL, form, json.dumps(names)], cwd=cwd, capture_output=True,
                          text=True, env=clean_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    return {name: (status, usage, tail, first) for name, status, usage, tail, first in rows}


def test_every_entry_point_answers_help_as_a_script_from_anywhere_and_as_a_module(tmp_path):
    scripts = entry_points()
    assert {"train/pretrain.py", "train/finetune.py", "train/linprobe.py", "train/bench.py", "launchers/submit.py",
            "tools/census.py", "data/write_shards.py"} <= set(scripts)
    modules = [s.removesuffix(".py").replace("/", ".") for s in scripts]
    as_scripts = help_all("script", [str(REPO / s) for s in scripts], tmp_path)  # from another folder
    as_modules = help_all("module", modules, REPO)
    for script, module in zip(scripts, modules):
        for form, (status, usage, tail, first) in (("script", as_scripts[str(REPO / script)]),
                                                   ("module", as_modules[module])):
            assert status == 0 and usage, f"{script} as a {form}: exit {status}: {tail}"
        assert as_scripts[str(REPO / script)][3] == str(REPO), f"{script} does not put the repository root first"
    assert not list(tmp_path.iterdir())  # --help writes nothing, wherever it runs


@pytest.mark.distributed
def test_deepspeed_runs_the_pretraining_script_on_two_cpu_ranks(tmp_path):
    """The design's command form: `deepspeed train/pretrain.py --ds_config ...`."""
    launcher = str(Path(sys.executable).parent / "deepspeed")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), "train/pretrain.py", "--ds_config",
           str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(tmp_path / "run"), "--run.max_steps", "2",
           "--run.progress", "false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=clean_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "world 2 on cpu" in proc.stdout + proc.stderr
    assert (tmp_path / "run" / "encoder.safetensors").is_file()
