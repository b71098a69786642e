"""The runs study.py launches: each training command it builds (read back with the entry points' own
parser), what run_entry asks of them, which checkpoints an epoch's encoder comes from, the budget a
result records, the --jobs child command and the wall clock it keeps. No training runs: _timed,
_run and subprocess.run are stubbed."""
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest

from experiments.fashion_mnist import study
from experiments.fashion_mnist.entries import STUDY
from study_shards import fake_shards
from train.config.parsing import parse_args
from train.finetune import RECIPE

TRAIN, TEST = Path("train.json"), Path("test.json")


@pytest.fixture
def launched(monkeypatch):
    """[(run, cmd)] of every training run started; each ends with an eval.json and one metrics row."""
    runs = []

    def timed(run, cmd):
        runs.append((run, cmd))
        run.mkdir(parents=True, exist_ok=True)
        (run / "eval.json").write_text(json.dumps({"eval_top1": 50.0}))
        return 1.0

    monkeypatch.setattr(study, "_timed", timed)
    monkeypatch.setattr(study, "read_metrics", lambda run: [{"step": 1, "loss": 1.0, "images_per_s": 100.0}])
    return runs


def _options(cmd):
    """The config the entry point builds from `cmd` (fine-tuning starts from its recipe, as train.finetune)."""
    return parse_args((RECIPE if cmd[1] == "train.finetune" else []) + cmd[2:])


@pytest.mark.parametrize("name, epochs, keep, expect", [
    # a third of an epoch of 60000 images: one nominal epoch of round(60000 / 3) images, warmup a third of it;
    # MLO-MAE's level-II head is scored on the test split, every epoch's checkpoint kept
    ("mlomae", 1 / 3, True, dict(epoch_size=20000, epochs=1, warmup=1 / 3, eval_index="test.json", keep=1)),
    # whole epochs: the shard set's own epochs, warmup a third of 10
    ("mae", 10.0, False, dict(epoch_size=0, epochs=10, warmup=10 / 3, eval_index="", keep=0)),
])
def test_the_pretraining_command_gives_the_budget_warmup_and_test_split(tmp_path, launched, name, epochs, keep,
                                                                       expect):
    study.pretrain(STUDY[name], tmp_path, 0, epochs, tmp_path / TRAIN, tmp_path / TEST, 60000, keep)
    [(run, cmd)] = launched
    cfg = _options(cmd)
    assert cmd[:2] == ["-m", "train.pretrain"] and run == tmp_path
    assert cfg.data.train_index == str(tmp_path / TRAIN)
    assert cfg.data.epoch_size == expect["epoch_size"] and cfg.optim.epochs == expect["epochs"]
    assert cfg.optim.warmup_epochs == pytest.approx(expect["warmup"])
    assert cfg.data.eval_index == (str(tmp_path / expect["eval_index"]) if expect["eval_index"] else "")
    assert cfg.run.keep_every_epochs == expect["keep"]


def test_the_fine_tuning_command_gives_its_images_init_and_rpe(tmp_path, launched):
    # whole epochs of `samples` images (not the 60k of the shard set), from scratch, iRPE kept
    study.finetune(tmp_path / "a", 0, 1.0, 10000, TRAIN, TEST, None, True)
    # half an epoch of 10000 images: one nominal epoch of 5000, from the pretrained encoder, no iRPE
    study.finetune(tmp_path / "b", 0, 0.5, 10000, TRAIN, TEST, tmp_path / "encoder.safetensors", False)
    whole, half = (_options(cmd) for run, cmd in launched)
    assert (whole.data.epoch_size, whole.optim.epochs, whole.model.rpe, whole.model.init_from) == (10000, 1, True, "")
    assert (half.data.epoch_size, half.optim.epochs, half.model.rpe, half.model.init_from) == (
        5000, 1, False, str(tmp_path / "encoder.safetensors"))
    assert whole.data.eval_index == half.data.eval_index == "test.json"


def test_run_entry_fine_tunes_the_pretrained_encoder_and_gives_supervised_both_budgets(tmp_path, monkeypatch,
                                                                                       launched):
    monkeypatch.setattr(study, "load_encoder", lambda **kwargs: "encoder")
    monkeypatch.setattr(study, "evaluate", lambda *args: {"knn_top1": 70.0})
    monkeypatch.setattr(study, "feature_pool", lambda run: "cls")
    monkeypatch.setattr(study, "encoder_has_rpe", lambda run: True)  # as MAE+ / AdPE: kept when fine-tuning
    monkeypatch.setattr(study, "epoch_encoders", lambda run, epochs: {})
    decoded = types.SimpleNamespace(train_set=types.SimpleNamespace(num_samples=60000), get=lambda: ("train", "test"))
    a = types.SimpleNamespace(out=tmp_path, pretrain_samples=20000, finetune_epochs=1.0, finetune_samples=10000,
                              eval_epochs=[])  # the quick preset
    study.run_entry("mae", 0, a, TRAIN, TEST, decoded)
    study.run_entry("supervised", 0, a, TRAIN, TEST, decoded)
    runs = {str(run.relative_to(tmp_path)): _options(cmd) for run, cmd in launched}
    assert list(runs) == ["mae/seed0/pretrain", "mae/seed0/finetune", "supervised/seed0/finetune"]
    pre, fine, sup = runs.values()
    # 20000 of 60000 images: a third of an epoch, one nominal epoch of 20000
    assert (pre.optim.epochs, pre.data.epoch_size) == (1, 20000)
    assert fine.model.init_from == str(tmp_path / "mae" / "seed0" / "pretrain" / "encoder.safetensors")
    assert (fine.optim.epochs, fine.data.epoch_size, fine.model.rpe) == (1, 10000, True)
    # the ceiling sees as many images as pretraining and fine-tuning together: 20000 + 1.0 * 10000, from scratch
    assert (sup.optim.epochs, sup.data.epoch_size, sup.model.init_from, sup.model.rpe) == (1, 30000, "", False)


def test_an_epochs_encoder_comes_from_the_checkpoint_at_that_epochs_end(tmp_path, monkeypatch):
    (tmp_path / "meta.json").write_text(json.dumps({"steps_per_epoch": 468}))
    (tmp_path / "epoch3").mkdir()
    (tmp_path / "epoch3" / "encoder.safetensors").write_bytes(b"exported before")
    exported = []
    monkeypatch.setattr(study, "export_checkpoint", lambda src, out: exported.append((src.name, out)))
    found = study.epoch_encoders(tmp_path, [1, 3, 10])
    # epoch k ends at step k * 468; epoch 3's encoder is there already and is not exported again
    assert exported == [("step00000468", tmp_path / "epoch1" / "encoder.safetensors"),
                        ("step00004680", tmp_path / "epoch10" / "encoder.safetensors")]
    assert found == {k: tmp_path / f"epoch{k}" / "encoder.safetensors" for k in (1, 3, 10)}


def test_the_wall_clock_is_kept_only_for_a_run_that_ran_through(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "_run", lambda cmd: 42.0)
    fresh, resumed, rerun = (tmp_path / n for n in ("fresh", "resumed", "rerun"))
    for run in (fresh, resumed, rerun):
        run.mkdir()
    (resumed / "checkpoints").mkdir()
    (resumed / "checkpoints" / "latest").write_text("step00000100")  # killed part-way: its time is not a measurement
    (rerun / "seconds.json").write_text(json.dumps({"seconds": 7.0}))  # measured when it ran through
    assert study._timed(fresh, []) == 42.0 and json.loads((fresh / "seconds.json").read_text()) == {"seconds": 42.0}
    assert math.isnan(study._timed(resumed, [])) and not (resumed / "seconds.json").exists()
    assert study._timed(rerun, []) == 7.0 and json.loads((rerun / "seconds.json").read_text()) == {"seconds": 7.0}


def _budget(pretrain_samples, eval_epochs):
    return types.SimpleNamespace(pretrain_samples=pretrain_samples, finetune_epochs=1.0, finetune_samples=60000,
                                 eval_epochs=eval_epochs)


def test_the_budget_a_result_records_names_its_evaluated_epochs(tmp_path):
    assert study.budget_of(_budget(600000, [1, 3])) == {"pretrain_samples": 600000, "finetune_epochs": 1.0,
                                                        "finetune_samples": 60000, "eval_epochs": [1, 3]}
    assert "eval_epochs" not in study.budget_of(_budget(20000, []))  # as the quick preset's results record it
    # a finished run is reused with the same budget, refused with other evaluated epochs
    done = tmp_path / "mae" / "seed0" / "result.json"
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({"entry": "mae", "budget": study.budget_of(_budget(600000, [1, 3]))}))
    a = _budget(600000, [1, 3])
    a.out = tmp_path
    assert study.run_entry("mae", 0, a, TRAIN, TEST, None)["entry"] == "mae"
    a.eval_epochs = [1]
    with pytest.raises(SystemExit, match="this study asks for"):
        study.run_entry("mae", 0, a, TRAIN, TEST, None)


def test_a_jobs_child_runs_with_the_parents_budget(tmp_path, monkeypatch):
    shards = fake_shards(tmp_path, monkeypatch)
    children = []

    def child(cmd, **kwargs):  # the child process, run here: the budget its own option parsing arrives at
        assert cmd[:3] == [sys.executable, "-m", "experiments.fashion_mnist.study"]
        monkeypatch.setattr(study, "run_entry", lambda name, seed, a, *rest: children.append((name, seed, a)))
        study.main(cmd[3:])
        out = tmp_path / "runs" / "mae" / "seed0" / "result.json"
        out.write_text(json.dumps({"entry": "mae"}))
        return types.SimpleNamespace(returncode=0)

    # study's own handle on subprocess, so that nothing else in this process launches through `child`
    monkeypatch.setattr(study, "subprocess", types.SimpleNamespace(run=child, STDOUT=subprocess.STDOUT))
    # the full preset with earlier epochs other than its own 1,3
    a = types.SimpleNamespace(jobs=2, shards=shards, pretrain_samples=600000, finetune_epochs=1.0,
                              finetune_samples=60000, eval_epochs=[2], out=tmp_path / "runs", preset="full")
    assert study.run_parallel(a, [(0, "mae")]) == [{"entry": "mae"}]
    [(name, seed, got)] = children
    assert (name, seed, got.out, got.no_report) == ("mae", 0, tmp_path / "runs", True)
    assert study.budget_of(got) == study.budget_of(a) == {"pretrain_samples": 600000, "finetune_epochs": 1.0,
                                                          "finetune_samples": 60000, "eval_epochs": [2]}
