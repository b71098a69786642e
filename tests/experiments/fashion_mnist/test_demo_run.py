"""`make demo` end to end on tiny Fashion-MNIST-like shards: the real pretraining subprocess with
the MAE demo preset, then the frozen-feature evaluation of both encoders, and what keeps it quick on
2 cores (OpenMP threads that sleep beside the decode worker; each evaluation split decoded once, on a
seeded train subset)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import fake_fashion_mnist

from experiments.fashion_mnist import common, demo
from train import evaluate
from train.run.folder import read_metrics


def test_cpu_training_env_sleeps_openmp_threads_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert common.cpu_training_env()["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert common.cpu_training_env()["OMP_WAIT_POLICY"] == "ACTIVE"


def test_demo_pretrains_then_evaluates_both_encoders_on_splits_decoded_once(tmp_path, monkeypatch):
    # the idx files of a 256 / 64-image Fashion-MNIST where the Debian package's would be
    monkeypatch.setattr(common, "FASHION_MNIST_DIR", fake_fashion_mnist(tmp_path / "idx", train=256, test=64))
    monkeypatch.setattr(common, "SHARDS", tmp_path / "shards")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    envs, decoded, evaluated = [], [], []
    real_popen, real_decode, real_evaluate = subprocess.Popen, evaluate.decode_all, evaluate.evaluate
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: (cmd[0] != "git" and envs.append(kw.get("env")))
                        or real_popen(cmd, **kw))  # git: the record's commit
    monkeypatch.setattr(demo, "decode_all", lambda split, *a: decoded.append(split.num_samples) or real_decode(split, *a))
    monkeypatch.setattr(demo, "evaluate", lambda model, train, test, pool: evaluated.append(
        (type(train), len(train.labels), len(test.labels))) or real_evaluate(model, train, test, pool))

    result = demo.main(["--epochs", "1", "--eval_train", "100", "--out", str(tmp_path / "run")])

    assert json.loads((tmp_path / "shards" / "train.json").read_text())["num_samples"] == 256  # written from the idx
    assert [env["OMP_WAIT_POLICY"] for env in envs] == ["PASSIVE"]  # the one pretraining subprocess
    assert decoded == [100, 64]  # the train subset and the test split, once each
    assert set(result["git"]) == {"commit", "dirty"}  # the code measured
    assert evaluated == [(evaluate.DecodedSet, 100, 64)] * 2  # pretrained and random init share them
    run = tmp_path / "run"
    assert (run / "encoder.safetensors").is_file()
    assert json.loads((run / "eval.json").read_text()) == result
    assert (result["eval_train_samples"], result["eval_test_samples"]) == (100, 64)
    assert result["final_train_metrics"]["loss"] > 0
    assert [r["step"] for r in read_metrics(run) if "loss" in r][-1] == 256 // 128  # 1 epoch of the given shards
    for scores in (result, result["random_init"]):
        assert 0 <= scores["knn_top1"] <= 100 and 0 <= scores["linear_probe_top1"] <= 100
    assert result["torch"] and result["device"]  # the timing's machine is recorded beside it
    assert result["pretrain_seconds"] > 0
    again = demo.main(["--epochs", "1", "--eval_train", "100", "--out", str(tmp_path / "run")])
    assert again["pretrain_seconds"] is None  # resumed: this call's wall clock is not the run's pretraining
    assert again["knn_top1"] == result["knn_top1"]


def test_a_stopped_pretraining_ends_the_demo_in_one_line_naming_how_to_continue(capsys):
    """The child's status 130 (Ctrl-C: it saved and said where) ended the demo in a
    CalledProcessError traceback; any other failure keeps its status too."""
    import sys

    import pytest

    for status in (130, 143, 1):
        with pytest.raises(SystemExit) as e:
            demo.run_pretraining([sys.executable, "-c", f"raise SystemExit({status})"])
        assert e.value.code == status
        err = capsys.readouterr().err
        assert ("run the same command again (make demo) to continue it and evaluate" in err) == (status != 1)
    demo.run_pretraining([sys.executable, "-c", "pass"])  # a pretraining that ended well: the demo goes on


def _stubbed_demo(monkeypatch, tmp_path, objective_config, losses):
    """demo.main with shards, pretraining, decoding and evaluation stubbed (the flow and the record
    only): the fake pretraining writes config.json and metrics.jsonl into the --output_dir it is
    given; returns the list of (encoder, pool) each evaluation received and of run folders."""
    import types

    split = types.SimpleNamespace(num_samples=100, files=["shard0"])
    monkeypatch.setattr(demo, "REPO", tmp_path)  # runs/<name> under tmp_path
    monkeypatch.setattr(demo, "fashion_mnist_shards", lambda: ("train.json", "test.json"))
    monkeypatch.setattr(demo, "ShardSet", types.SimpleNamespace(from_index=lambda index: split))
    monkeypatch.setattr(demo, "subsample", lambda s, n, seed: s)
    monkeypatch.setattr(demo, "decode_all", lambda *a: "decoded")
    monkeypatch.setattr(demo, "load_encoder", lambda **k: "random init" if "random_init" in k else "pretrained")
    evaluated, runs = [], []
    monkeypatch.setattr(demo, "evaluate", lambda enc, train, test, pool: evaluated.append((enc, pool))
                        or {"knn_top1": 50.0, "linear_probe_top1": 60.0})

    def fake_pretraining(cmd):
        run = Path(cmd[cmd.index("--output_dir") + 1])
        runs.append(run)
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.json").write_text(json.dumps({**objective_config, "model": {"name": "vit_mini_patch4"}}))
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in losses))

    monkeypatch.setattr(demo, "run_pretraining", fake_pretraining)
    return evaluated, runs


def test_demo_records_the_last_logged_losses_and_evaluates_both_encoders_on_the_objectives_pool(tmp_path,
                                                                                                monkeypatch):
    losses = [{"step": 25, "loss": 3.0, "lr": 1e-3}, {"step": 30, "grad_norm": 1.0},
              {"step": 50, "loss": 1.0, "lr": 1e-4}]
    evaluated, _ = _stubbed_demo(monkeypatch, tmp_path, {"objective": "energy", "energy": {"pool": "avg"}}, losses)
    result = demo.main(["--method", "energy", "--out", str(tmp_path / "run"), "--eval_train", "0"])
    assert result["final_train_metrics"] == {"loss": 1.0}  # the last row with a loss, its loss keys only
    # energy's cls token is never trained: both encoders are read average-pooled
    assert evaluated == [("pretrained", "avg"), ("random init", "avg")] and result["features"] == "avg"


def test_demo_run_folder_is_named_by_method_variant_and_epochs(tmp_path, monkeypatch, capsys):
    _, runs = _stubbed_demo(monkeypatch, tmp_path, {"objective": "mae"}, [{"step": 1, "loss": 1.0}])
    for argv in ([], ["--epochs", "1"], ["--method", "energy"], ["--method", "energy", "--epochs", "0.5"],
                 ["--method", "mixedae", "--variant", "naive_mixing", "--epochs", "1"]):
        demo.main([*argv, "--skip_control"])
    assert [r.relative_to(tmp_path / "runs").as_posix() for r in runs] == \
        ["demo", "demo_mae_1ep", "demo_energy", "demo_energy_0.5ep",
         "demo_mixedae_naive_mixing_1ep"]  # runs/demo: MAE at its preset's epochs only
    # --help and the page state that rule, the epochs included
    capsys.readouterr()
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    assert "runs/demo_<method>[_<variant>][_<N>ep], _<N>ep for --epochs N" in " ".join(capsys.readouterr().out.split())
    page = " ".join((common.REPO / "docs" / "FASHION_MNIST.md").read_text().split())
    assert "runs go to `runs/demo_<method>[_<variant>][_<N>ep]`" in page and "`runs/demo` for MAE" in page



@pytest.mark.parametrize("method, variant", [("mixedae", "naive_mixing"), ("mlomae", "straight_through"), ("mae", "")],
                         ids=["mixedae naive_mixing", "mlomae straight_through (its own head)", "mae"])
def test_the_table_lines_up_under_its_headers_and_says_what_each_row_was_fitted_on(tmp_path, monkeypatch, capsys,
                                                                                   method, variant):
    """Each number ends where its column's header ends, whatever the method and variant names'
    lengths; the encoders' rows name the train subset they were fitted on, the raw-pixel baselines
    (fitted on the whole train split) say so on their own row."""
    import re

    _, runs = _stubbed_demo(monkeypatch, tmp_path, {"objective": method}, [{"step": 1, "loss": 1.0}])
    pretraining = demo.run_pretraining

    def with_head_result(cmd):  # an objective with its own classifier has its head's result in eval.json
        pretraining(cmd)
        (runs[-1] / "eval.json").write_text(json.dumps({"eval_top1": 71.5}))

    monkeypatch.setattr(demo, "run_pretraining", with_head_result)
    demo.main(["--method", method, *(["--variant", variant] if variant else []), "--eval_train", "0"])
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("Fashion-MNIST test top-1 (%), vit_mini_patch4, frozen cls features")
    header, rows = lines[at + 1], lines[at + 2:-1]
    ends = [header.index(name) + len(name) for name in ("linear probe", "kNN (k=20)")]
    pretrained = f"{method.upper()} {variant}".strip() + " pretrained"
    labels = [pretrained, *([f"{method.upper()} own head"] if method == "mlomae" else []), "random init", "raw pixels"]
    assert [row.split("  ")[0] for row in rows] == labels, rows
    for row in rows:
        numbers = [m.end() for m in re.finditer(r"\d+\.\d+", row)][:2]
        assert numbers == (ends[:1] if "own head" in row else ends), (header, row)
    assert [row.split("  ")[0] for row in rows if row.endswith("   fitted on 100 train samples")] == \
        [pretrained, "random init"]
    assert rows[-1].endswith("   logistic regression / 5-NN on the pixels, fitted on all 60000 train images")
    assert not any("fitted on" in line for line in lines[at:at + 2])  # the title and headers: the rows say it
