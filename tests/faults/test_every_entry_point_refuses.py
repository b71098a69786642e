"""Every command refuses bad input the way pretraining does (data/cli.py, train/run/cli.py): exit status
2, one line on stderr naming the problem and the fix, no traceback, nothing written.

The table runs each entry point against each class of bad input that applies to it: a path that
does not exist, a malformed or missing preset or index (file, line and column; the presets folder
and the nearest names), weights that do not fit the model (input channels, sizes, objective: both
values named), an output place that cannot be written, a misspelt option or a bad value. Each
call runs in this process through the wrapper the module's `__main__` block uses (checked below),
and two run as real scripts. The table is refusal_cases.py, its inputs refusal_inputs.py."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import REPO
from refusal_cases import CASES
from refusal_inputs import make_inputs

from train.run.cli import cli


def exits(main: Callable[[], int]) -> None:  # `sys.exit(main())`
    sys.exit(main())


def called(main: Callable[[], object]) -> None:  # `main()`
    main()


# module -> (its main, the wrapper its __main__ block runs it with, how that block reads)
ENTRY_POINTS = {
    "train.pretrain": ("train.run.command", cli, "run_script(main)"),
    "train.finetune": ("train.finetune", cli, "run_script(main)"),
    "train.linprobe": ("train.linprobe", cli, "run_script(main)"),
    "train.evaluate": ("train.evaluate", cli, "cli(main)"),
    "train.export": ("train.export", cli, "cli(main)"),
    "train.bench": ("train.bench", cli, "cli(main)"),
    "train.bench_objectives": ("train.bench_objectives", called, "main()"),
    "kernels.bench": ("kernels.bench", called, "main()"),
    "tools.census": ("tools.census", cli, "cli(main)"),
    "tools.scaling": ("tools.scaling", cli, "cli(lambda: sys.exit(main()))"),
    "train.convert_checkpoint": ("train.convert_checkpoint", cli, "cli(main)"),
    "data.write_shards": ("data.write_shards", called, "main()"),
    "data.index_shards": ("data.index_shards", exits, "sys.exit(main())"),
    "data.verify": ("data.verify", exits, "sys.exit(main())"),
    "launchers.submit": ("launchers.submit", exits, "sys.exit(main())"),
    "experiments.fashion_mnist.study": ("experiments.fashion_mnist.study", called, "main()"),
    "experiments.fashion_mnist.report": ("experiments.fashion_mnist.report", called, "main()"),
    "experiments.fashion_mnist.demo": ("experiments.fashion_mnist.demo", called, "main()"),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """The inputs good and bad (refusal_inputs.py), made once."""
    return make_inputs(tmp_path_factory.mktemp("inputs"))


def tree(folder: Path) -> dict[str, float]:
    """Every path under `folder`, with its modification time for files (a folder's changes when a
    check makes and removes an entry to see whether it can be written)."""
    return {str(p.relative_to(folder)): p.stat().st_mtime if p.is_file() else 0 for p in folder.rglob("*")}


def run(entry: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """The entry point run as its __main__ block runs it: (exit status, stdout, stderr)."""
    import importlib

    module, wrapper, _ = ENTRY_POINTS[entry]
    main = importlib.import_module(module).main
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            wrapper(lambda: main(argv))
            status = 0
        except SystemExit as e:
            status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("entry, what, argv, message, setup", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_bad_input_is_refused_in_one_line_before_any_work(inputs, entry, what, argv, message, setup, capsys,
                                                          monkeypatch):
    if setup == "cpu_only":
        if torch.cuda.is_available():
            pytest.skip("a GPU's benchmark runs on this machine")
    elif setup is not None:
        setup(monkeypatch)
    (inputs / "big_micro.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 100000,
                                                       "gradient_accumulation_steps": 1, "gradient_clipping": 0.0}))
    monkeypatch.chdir(REPO)
    before = tree(inputs)
    status, out, err = run(entry, [a.format(d=inputs) for a in argv], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, (status, out[-2000:], err[-2000:])
    assert len(lines) == 1 and "Traceback" not in out + err, err[-3000:]
    assert re.search(message, lines[0]), lines[0]
    assert tree(inputs) == before  # nothing written, nothing touched


def test_every_entry_point_is_in_the_table_and_runs_its_main_as_the_table_does():
    """The table's wrapper is the one each module's __main__ block uses, and every entry point of
    train/, data/, launchers/, tools/census.py, kernels/bench.py and the study's commands has a row."""
    covered = {c[0] for c in CASES}
    assert covered == set(ENTRY_POINTS)
    for entry, (_, _, block) in ENTRY_POINTS.items():
        source = (REPO / Path(*entry.split("."))).with_suffix(".py").read_text()
        main_block = source[source.rindex('if __name__ == "__main__":'):]
        assert block in main_block, (entry, main_block)
    commands = {str(p.relative_to(REPO).with_suffix("")).replace("/", ".") for folder in ("train", "data", "launchers")
                for p in (REPO / folder).glob("*.py") if 'if __name__ == "__main__"' in p.read_text()}
    assert commands - set(ENTRY_POINTS) <= {"data.fashion_mnist", "launchers.slurm"}, commands - set(ENTRY_POINTS)


@pytest.mark.parametrize("argv, message", [
    (["train/export.py", "--checkpoint", "no/such/run"], "--checkpoint no/such/run does not exist: give a run folder"),
    (["train/evaluate.py", "--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json",
      "--encoder", "{d}/gray.safetensors"], "takes 1-channel images, the shards decode to 3-channel RGB"),
], ids=["export", "evaluate"])
def test_as_scripts_too(inputs, argv, message, tmp_path):
    script, *rest = argv
    proc = subprocess.run([sys.executable, str(REPO / script), *[a.format(d=inputs) for a in rest]], cwd=tmp_path,
                          capture_output=True,
                          text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())
