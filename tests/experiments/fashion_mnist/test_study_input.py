"""study.py's input: options that could not give a run refused in one line before any work, a
result.json written whole or not at all and refused in one line when cut short, and the report of
`--report FILE` naming its own preset."""
import json
import types
from pathlib import Path

import pytest

from experiments.fashion_mnist import study
from study_shards import fake_shards

BUDGET = {"pretrain_samples": 180000, "finetune_epochs": 1.0, "finetune_samples": 60000, "eval_epochs": [1]}


def _refused(capsys, argv, out):
    with pytest.raises(SystemExit) as status:
        study.main([*argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert status.value.code == 2 and len(err.splitlines()) == 1, err
    assert not out.exists()  # refused before any run folder
    return err


@pytest.mark.parametrize("argv, said", [
    (["--finetune_epochs", "0"], "--finetune_epochs 0: give a positive number of epochs"),
    (["--finetune_epochs", "-1"], "--finetune_epochs -1: give a positive number of epochs"),
    (["--finetune_epochs", "nan"], "--finetune_epochs nan: give a positive number of epochs"),
    (["--finetune_samples", "0"], "--finetune_samples 0: give a positive number of training images"),
    (["--eval_epochs", "x"], "--eval_epochs 'x': give comma-separated whole epochs"),
    (["--eval_epochs", "1.5"], "--eval_epochs '1.5': give comma-separated whole epochs"),
    (["--seeds", "0,1,0"], "--seeds gives 0 more than once: name each once"),
    (["--only", "mae,random_init,mae"], "--only gives mae more than once: name each once"),
])
def test_options_that_cannot_give_a_run_are_refused_up_front(tmp_path, capsys, argv, said):
    # --status does no work: a refusal there is a refusal before any run
    assert said in _refused(capsys, ["--preset", "ablation", *argv, "--status"], tmp_path / "runs")


@pytest.mark.parametrize("argv, said", [
    # 10 epochs: epoch 10 is the last one, already evaluated as the final encoder
    (["--preset", "full", "--eval_epochs", "10"], "--eval_epochs [10]: give whole epochs before the last"),
    # 1.5 epochs: the shard stream has no half-epoch past the first
    (["--preset", "quick", "--pretrain_samples", "90000"],
     "--pretrain_samples 90000: give fewer than one epoch (60000) or whole epochs"),
])
def test_budgets_the_training_set_cannot_give_are_refused_before_any_entry_runs(tmp_path, monkeypatch, capsys,
                                                                                  argv, said):
    # these need the training set's size: checked past --status, so the shards are faked and no entry may run
    shards, ran = fake_shards(tmp_path, monkeypatch), []
    monkeypatch.setattr(study, "run_entry", lambda name, seed, *args: ran.append((name, seed)))
    assert said in _refused(capsys, [*argv, "--shards", str(shards), "--only", "mae", "--no_report"],
                            tmp_path / "runs")
    assert ran == []


def _result(entry, seed):
    return {"entry": entry, "label": entry.upper(), "seed": seed, "knn_top1": 70.0, "linear_probe_top1": 78.0,
            "finetune_top1": 85.0, "device": "cpu", "torch_threads": 1, "budget": BUDGET}


def test_a_result_cut_short_is_refused_before_any_entry_runs(tmp_path, monkeypatch, capsys):
    shards, out = fake_shards(tmp_path, monkeypatch), tmp_path / "runs"
    cut = out / "mae" / "seed1" / "result.json"
    cut.parent.mkdir(parents=True)
    cut.write_text(json.dumps(_result("mae", 1))[:30])
    ran = []
    monkeypatch.setattr(study, "run_entry", lambda name, seed, *args: ran.append((name, seed)))
    with pytest.raises(SystemExit) as status:
        study.main(["--preset", "ablation", "--shards", str(shards), "--only", "mae", "--out", str(out), "--no_report"])
    err = capsys.readouterr().err
    assert status.value.code == 2 and len(err.splitlines()) == 1
    assert f"{cut} is not readable JSON (a write cut short): delete it and the entry reruns from its checkpoints" in err
    assert ran == []


class Killed(BaseException):
    """The process killed part-way through a write."""


def test_result_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "load_encoder", lambda **kwargs: "encoder")
    monkeypatch.setattr(study, "evaluate", lambda *args: {"knn_top1": 70.0, "linear_probe_top1": 78.0})
    monkeypatch.setattr(study, "finetune", lambda *args, **kwargs: {"finetune_top1": 85.0})
    decoded = types.SimpleNamespace(train_set=types.SimpleNamespace(num_samples=60000), get=lambda: ("train", "test"))
    a = types.SimpleNamespace(out=tmp_path, pretrain_samples=60000, finetune_epochs=1.0, finetune_samples=60000,
                              eval_epochs=[])
    write_text = Path.write_text

    def cut_short(path, text, *args, **kwargs):  # half the file reaches the disk, then the kill
        write_text(path, text[: len(text) // 2], *args, **kwargs)
        raise Killed

    monkeypatch.setattr(Path, "write_text", cut_short)
    with pytest.raises(Killed):
        study.run_entry("random_init", 0, a, Path("train.json"), Path("test.json"), decoded)
    assert not (tmp_path / "random_init" / "seed0" / "result.json").exists()  # not a cut one the study then reads
    monkeypatch.setattr(Path, "write_text", write_text)
    result = study.run_entry("random_init", 0, a, Path("train.json"), Path("test.json"), decoded)
    assert json.loads((tmp_path / "random_init" / "seed0" / "result.json").read_text()) == result
    assert result["finetune_top1"] == 85.0 and result["budget"]["pretrain_samples"] == 60000


def test_the_report_of_report_file_names_its_own_preset(tmp_path, monkeypatch):
    shards = fake_shards(tmp_path, monkeypatch)
    monkeypatch.setattr(study, "run_entry", lambda name, seed, *args: _result(name, seed))
    report = tmp_path / "RESULTS_mine.md"
    study.main(["--preset", "ablation", "--shards", str(shards), "--seeds", "0", "--only", "mae,random_init",
                "--out", str(tmp_path / "runs"), "--report", str(report)])
    head = report.read_text().splitlines()[2]
    assert head.startswith("Generated by `python -m experiments.fashion_mnist.report --preset ablation`")
    assert "Still to run" not in report.read_text()  # the entries of this call, all run


def _recorded_entry(monkeypatch, tmp_path, name, seed):
    """run_entry with training and evaluation stubbed out: what it asked of load_encoder and evaluate."""
    seen = []
    monkeypatch.setattr(study, "load_encoder", lambda **kwargs: seen.append(("load", kwargs)) or "encoder")
    monkeypatch.setattr(study, "evaluate", lambda enc, train, test, pool="cls": seen.append(("evaluate", pool)) or
                        {"knn_top1": 70.0})
    monkeypatch.setattr(study, "finetune", lambda *args, **kwargs: {})
    monkeypatch.setattr(study, "pretrain", lambda *args, **kwargs: {})
    monkeypatch.setattr(study, "feature_pool", lambda run: "avg")  # energy's patch-mean features
    monkeypatch.setattr(study, "encoder_has_rpe", lambda run: False)
    monkeypatch.setattr(study, "epoch_encoders", lambda run, epochs: {1: tmp_path / "epoch1.safetensors"})
    decoded = types.SimpleNamespace(train_set=types.SimpleNamespace(num_samples=60000), get=lambda: ("train", "test"))
    a = types.SimpleNamespace(out=tmp_path / "runs", pretrain_samples=180000, finetune_epochs=1.0,
                              finetune_samples=600, eval_epochs=[1])
    study.run_entry(name, seed, a, Path("train.json"), Path("test.json"), decoded)
    return seen


def test_random_init_draws_its_weights_from_the_runs_seed(tmp_path, monkeypatch):
    seen = _recorded_entry(monkeypatch, tmp_path, "random_init", 1)
    assert [kw["seed"] for what, kw in seen if what == "load"] == [1]  # seed 1's control, not seed 0's again


def test_every_evaluation_of_a_pretrained_encoder_uses_its_feature_pool(tmp_path, monkeypatch):
    # energy's features are the patch mean: the earlier-epoch curve and the final evaluation alike
    seen = _recorded_entry(monkeypatch, tmp_path, "energy", 0)
    assert [pool for what, pool in seen if what == "evaluate"] == ["avg", "avg"]
