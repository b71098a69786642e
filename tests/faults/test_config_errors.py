"""Configuration and environment errors are caught before any process group starts or anything
is written: a message naming the problem and the fix, exit status 2."""
import json

import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET, run_pretrain
from fake_gpu import CU126_ARCHS, CU130_ARCHS, fake_gpu

from train.pretrain import main
from train.run.cli import cli
from train.run.folder import read_metrics


def _reject(tmp_path, capsys, monkeypatch, *args, world: int = 1, ds=CPU_DS) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    out = tmp_path / "run"
    argv = ["--ds_config", str(ds), "--config", str(DEBUG_PRESET), "--output_dir", str(out), "--run.progress",
            "false", *args]
    with pytest.raises(SystemExit) as exit_info:
        cli(lambda: main(argv))
    assert exit_info.value.code == 2
    assert not torch.distributed.is_initialized()  # rejected before the process group
    assert not (out / "config.json").exists()  # and before the run folder was written
    return capsys.readouterr().err


def _ds(tmp_path, **changes) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**json.loads(CPU_DS.read_text()), **changes}))
    return str(path)


def _index(tmp_path, shards: list[dict]) -> str:
    path = tmp_path / "shards" / "train.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"shards": shards, "classes": ["a", "b"]}))
    return str(path)


def test_misspelt_option(tmp_path, capsys, monkeypatch):
    assert "unknown option 'optim.bl'; did you mean 'optim.blr'" in _reject(tmp_path, capsys, monkeypatch,
                                                                            "--optim.bl", "1")


def test_batch_arithmetic_that_does_not_match_the_world_size(tmp_path, capsys, monkeypatch):
    ds = _ds(tmp_path, train_batch_size=16)  # = 8 x 1 x 2 ranks, but 4 ranks start
    err = _reject(tmp_path, capsys, monkeypatch, world=4, ds=ds)
    assert "train_batch_size 16 != micro 8 x accumulation 1 x 4 ranks" in err


def test_an_optimizer_of_whole_tensors_on_a_sharded_stage(tmp_path, capsys, monkeypatch):
    err = _reject(tmp_path, capsys, monkeypatch, "--optim.name", "lars", ds=_ds(tmp_path, zero_optimization={"stage": 3}))
    assert "optim.name lars needs whole per-layer tensors for its trust ratio" in err


def test_missing_shard_index(tmp_path, capsys, monkeypatch):
    err = _reject(tmp_path, capsys, monkeypatch, "--data.source", "shards", "--data.train_index",
                  str(tmp_path / "nowhere.json"), "--model.in_chans", "3")
    assert "nowhere.json not found; write shards with data/write_shards.py" in err


def test_shard_file_listed_but_missing(tmp_path, capsys, monkeypatch):
    index = _index(tmp_path, [{"file": "train-000000.tar", "samples": 10}])
    err = _reject(tmp_path, capsys, monkeypatch, "--data.source", "shards", "--data.train_index", index,
                  "--model.in_chans", "3")
    assert "1 shard(s) listed in" in err and "are missing" in err


def test_empty_shard_index(tmp_path, capsys, monkeypatch):
    index = _index(tmp_path, [])
    err = _reject(tmp_path, capsys, monkeypatch, "--data.source", "shards", "--data.train_index", index,
                  "--model.in_chans", "3")
    assert "no shards" in err


def test_too_few_shards_for_ranks_times_workers(tmp_path, capsys, monkeypatch):
    (tmp_path / "shards").mkdir()
    for i in range(3):
        (tmp_path / "shards" / f"s{i}.tar").write_bytes(b"\0" * 1024)
    index = tmp_path / "shards" / "train.json"
    index.write_text(json.dumps({"shards": [{"file": f"s{i}.tar", "samples": 8} for i in range(3)], "classes": ["a"]}))
    err = _reject(tmp_path, capsys, monkeypatch, "--data.source", "shards", "--data.train_index", str(index),
                  "--model.in_chans", "3", "--data.num_workers", "2", "--data.epoch_size", "64", world=2,
                  ds=_ds(tmp_path, train_micro_batch_size_per_gpu=4))
    assert "3 shards cannot feed 2 ranks x 2 workers = 4 readers" in err


def test_bf16_asked_of_a_gpu_without_it(tmp_path, capsys, monkeypatch):
    with fake_gpu("v100", CU126_ARCHS):  # torch.cuda.is_bf16_supported() says True here: it counts emulation
        err = _reject(tmp_path, capsys, monkeypatch, ds=_ds(tmp_path, bf16={"enabled": True}))
    assert "bf16, which this GPU lacks (V100 has none); use an fp16 config" in err


def test_gpu_the_torch_build_has_no_kernels_for(tmp_path, capsys, monkeypatch):
    """A V100 with the CUDA 13 wheels PyPI serves (sm_75 ... sm_120): refused whatever the precision."""
    with fake_gpu("v100", CU130_ARCHS):
        err = _reject(tmp_path, capsys, monkeypatch)
    assert "has no kernels for this GPU, Tesla V100-SXM2-32GB (compute capability 7.0, sm_70)" in err
    assert "its arch list is sm_75 sm_80 sm_86 sm_90 sm_100 sm_120" in err
    assert "make install TORCH_INDEX=https://download.pytorch.org/whl/cu126" in err


def _old_run(folder, config_changes: dict, checkpoint: bool):
    """A run folder as an earlier run leaves it: config.json, a log line, maybe a checkpoint."""
    from train.config.parsing import parse_args, to_dict

    cfg = to_dict(parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET)]))
    for key, value in config_changes.items():
        section, leaf = key.split(".")
        cfg[section][leaf] = value
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    (folder / "launch").mkdir()  # launchers/submit.py's snapshot: not the run's own output
    if checkpoint:
        tag = folder / "checkpoints" / "step00000004"
        tag.mkdir(parents=True)
        (tag / "complete.json").write_text(json.dumps({"step": 4, "world_size": 1, "config": cfg}))


def test_run_folder_holding_another_config_is_refused(tmp_path, capsys, monkeypatch):
    _old_run(tmp_path / "run", {"optim.blr": 0.5}, checkpoint=False)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    err = _reject(tmp_path / "x", capsys, monkeypatch, "--output_dir", str(tmp_path / "run"))
    assert "holds a run with another config (sections differing: optim)" in err and "--run.overwrite true" in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text().startswith('{"step": 1, "loss": 9.0}')  # untouched
    # nothing added either: the run.lock the refused start made in the folder is gone with it
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_run_folder_holding_checkpoints_is_refused_without_resume(tmp_path, capsys, monkeypatch):
    _old_run(tmp_path / "run", {}, checkpoint=True)  # the same config: starting afresh would still lose them
    err = _reject(tmp_path / "x", capsys, monkeypatch, "--output_dir", str(tmp_path / "run"))
    assert "holds the checkpoints of a run (step00000004 ...); continue it with --resume auto" in err


def test_overwrite_starts_afresh_and_keeps_the_launch_snapshot(tmp_path):
    _old_run(tmp_path, {"optim.blr": 0.5}, checkpoint=True)
    run_pretrain(tmp_path, "--run.max_steps", "2", "--run.overwrite", "true")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # the old line is gone
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step*")) == ["step00000002"]
    assert (tmp_path / "launch").is_dir()
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["blr"] == 1.5e-3
