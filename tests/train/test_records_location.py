"""Benchmark and census records go to runs/ (git-ignored) or where the command says, and into the
committed benchmarks/results/ only when asked (--record)."""

import pytest
from conftest import CPU_DS, REPO

from train.config.errors import ConfigError


def test_bench_writes_into_runs_unless_told_to_record(tmp_path):
    from train.bench import split_argv

    run = ["--ds_config", str(CPU_DS)]
    assert split_argv(run)[0]["out_dir"] == str(REPO / "runs" / "bench")
    assert split_argv([*run, "--record"])[0]["out_dir"] == str(REPO / "benchmarks" / "results")
    assert split_argv([*run, "--out_dir", str(tmp_path)])[0]["out_dir"] == str(tmp_path)
    with pytest.raises(ConfigError, match="give --out_dir or --record, not both"):
        split_argv([*run, "--out_dir", str(tmp_path), "--record"])


def test_the_census_writes_into_runs_unless_told_to_record(tmp_path):
    from tools.census import record_path, split_argv

    opts, _ = split_argv(["--ds_config", str(CPU_DS)])
    assert record_path(opts, "mae", "vit_debug_patch4").parent == REPO / "runs" / "census"
    opts, _ = split_argv(["--ds_config", str(CPU_DS), "--record"])
    assert record_path(opts, "mae", "vit_debug_patch4").parent == REPO / "benchmarks" / "results"
    opts, _ = split_argv(["--ds_config", str(CPU_DS), "--json", str(tmp_path / "c.json")])
    assert record_path(opts, "mae", "vit_debug_patch4") == tmp_path / "c.json"


def test_kernel_and_objective_benchmarks_too(tmp_path, capsys):
    from kernels.bench import OneLineParser, add_timing_options, out_dir_of

    p = OneLineParser()
    add_timing_options(p, iters=1)
    assert out_dir_of(p, p.parse_args([])) == REPO / "runs" / "bench"
    assert out_dir_of(p, p.parse_args(["--record"])) == REPO / "benchmarks" / "results"
    with pytest.raises(SystemExit) as status:
        out_dir_of(p, p.parse_args(["--record", "--out_dir", str(tmp_path)]))
    assert status.value.code == 2 and capsys.readouterr().err.count("\n") == 1
