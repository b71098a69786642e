"""Resuming with changed options: those that break the resume stay refused; the others are said
at start, one line each, and recorded in the run folder's resumes.jsonl with the step."""
import json

import pytest
from conftest import CPU_DS, DEBUG_PRESET, run_pretrain

from train.config.errors import ConfigError
from train.config.options import parse_args
from train.run.folder import read_metrics
from train.run.trainer import check_before_start


def test_a_resume_with_another_lr_is_said_and_recorded_and_another_model_refused(tmp_path):
    run_pretrain(tmp_path, "--run.max_steps", "2", "--run.ckpt_every", "2")
    another_model = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir",
                                str(tmp_path), "--resume", "auto", "--model.drop_path_rate", "0.1"])
    with pytest.raises(ConfigError, match="--resume: the checkpoint was trained with model="):
        check_before_start(another_model)  # the main entry turns it into exit 2
    assert not (tmp_path / "resumes.jsonl").exists()  # refused before anything was written
    proc = run_pretrain(tmp_path, "--resume", "auto", "--run.max_steps", "3", "--run.ckpt_every", "2", "--optim.blr", "3e-3")
    assert "resumed with optim.blr changed: 0.0015 -> 0.003" in proc.stderr
    assert "resumed with run.max_steps changed: 2 -> 3" in proc.stderr
    records = [json.loads(line) for line in (tmp_path / "resumes.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["step"] == 2
    assert records[0]["changes"] == {"optim.blr": [0.0015, 0.003], "run.max_steps": [2, 3]}
    assert records[0]["from"].endswith("step00000002")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["blr"] == 3e-3  # the newest config


def test_another_global_batch_on_the_same_ranks_is_refused():
    from train.config.ds_config import BatchPlan
    from train.config.options import to_dict
    from train.run.build import check_resume_compatible

    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET)])
    meta = {"world_size": 1, "global_batch": 16, "config": json.loads(json.dumps(to_dict(cfg)))}
    check_resume_compatible(meta, cfg, BatchPlan(micro=16, accum=1, world=1))  # the same batch: fine
    with pytest.raises(ConfigError, match="global batch 16, this run has 32"):
        check_resume_compatible(meta, cfg, BatchPlan(micro=16, accum=2, world=1))
