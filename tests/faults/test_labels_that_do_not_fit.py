"""Labels that do not fit, and samples an evaluation could not use.

An evaluation set is scored with what was fitted on a training set's labels, so both indexes must
give the same class names to the same integers: train.evaluate, finetune / linprobe with
data.eval_index and data.verify --train_index refuse a pair that does not (exit 2, naming both
indexes, the first difference and the fix) before any image is decoded, and so do they for a pair
that shares a shard (the accuracy would be measured on training samples). Samples an evaluation
skips are counted by kind and reported with the result; a set of which none could be used is an
error, not an accuracy of 0. Shard entries that climb out of the index's folder are refused when
the index is read. The training commands' log lines name the command."""
from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET, REPO
from PIL import Image

from data.faults import CorruptDataError, ShardIndexError
from data.shard_index import PipeShard, ShardSet, check_held_out, check_scored_against
from data.verify import main as verify
from data.write_shards import main as write_shards
from train import evaluate, finetune, linprobe
from train.run import command, trainer
from train.run.cli import cli
from train.run.evaluation import classification_accuracy, eval_summary


def image_folder(root: Path, classes: list[str], per_class: int = 4) -> Path:
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(np.full((12, 12, 3), 40 * c + 7 * i, dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((12, 12, 3), value, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_tar(path: Path, samples: list[tuple[str, bytes, int]]) -> None:
    """(key, image bytes, label) per sample: `<key>.png` + `<key>.cls`."""
    with tarfile.open(path, "w") as tar:
        for key, image, label in samples:
            for ext, data in (("png", image), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def index_like(source: Path, name: str, **changes) -> Path:
    """A copy of the index `source` (beside it: the same shard entries) with `changes` applied."""
    out = source.with_name(f"{name}.json")
    out.write_text(json.dumps(json.loads(source.read_text()) | changes))
    return out


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, Path]:
    """train: 2 classes (class0, class1) x 4 images in 2 shards; test sets that fit it (`same`, `fewer`:
    class0 only; `damaged`: 2 of 6 images undecodable; `all_bad`: none decodes) and that do not
    (`swapped`: the names in the other order; `more`: a third class; `recorded`: index_shards-style,
    labels_seen holding 2 of 2 classes)."""
    root = tmp_path_factory.mktemp("label_sets")
    train_dir = root / "train"
    for name, classes in (("train", ["class0", "class1"]), ("fewer", ["class0"]),
                          ("more", ["class0", "class1", "class2"])):
        write_shards(["imagefolder", str(image_folder(root / "images" / name, classes)),
                      str(train_dir if name == "train" else root / name), "--name", name, "--samples_per_shard", "4",
                      "--workers", "1"])
    train = train_dir / "train.json"
    (root / "damaged").mkdir()
    write_tar(root / "damaged" / "damaged-0.tar",
              [(f"k{i}", b"\x89PNG garbage" if i in (1, 4) else png(30 * i), i % 2) for i in range(6)])
    (root / "damaged" / "damaged.json").write_text(json.dumps({"shards": [{"file": "damaged-0.tar", "samples": 6}],
                                                               "classes": ["class0", "class1"]}))
    write_tar(root / "damaged" / "all_bad-0.tar", [(f"b{i}", b"\xff\xd8 not a jpeg", 0) for i in range(3)])
    (root / "damaged" / "all_bad.json").write_text(json.dumps({"shards": [{"file": "all_bad-0.tar", "samples": 3}],
                                                               "classes": ["class0", "class1"]}))
    return {"train": train, "same": train, "swapped": index_like(train, "swapped", classes=["class1", "class0"]),
            "fewer": root / "fewer" / "fewer.json", "more": root / "more" / "more.json",
            "recorded": index_like(train, "recorded", labels_seen=[0, 1, 2]),
            "damaged": root / "damaged" / "damaged.json", "all_bad": root / "damaged" / "all_bad.json"}


# --- what "fits" means, from the indexes alone ---

@pytest.mark.parametrize("test, message", [
    ("same", None),
    ("fewer", None),  # a test set of the first training classes, named alike
    ("swapped", r"--test_index .*swapped.json does not fit --train_index .*train.json: label 0 is class 'class1' in "
                r"--test_index and 'class0' in --train_index, so their labels mean other classes; give both the same "
                r"class list"),
    ("more", r"--test_index .*more.json does not fit --train_index .*train.json: --test_index may hold label 2 "
             r"\(class 'class2'\), --train_index names 2 classes, so that class can never be predicted"),
    ("recorded", r"--test_index .*recorded.json records label 2 \(its labels_seen\) but names 2 classes: re-index"),
])
def test_an_evaluation_set_fits_when_its_labels_name_the_training_classes(sets, test, message):
    train, scored = ShardSet.from_index(sets["train"]), ShardSet.from_index(sets[test])
    if message is None:
        check_scored_against(scored, train, "--test_index", "--train_index")
        return
    with pytest.raises(ShardIndexError, match=message):
        check_scored_against(scored, train, "--test_index", "--train_index")


def test_a_training_index_whose_recorded_labels_pass_its_classes_is_refused_too(sets):
    train, scored = ShardSet.from_index(sets["recorded"]), ShardSet.from_index(sets["train"])
    with pytest.raises(ShardIndexError, match=r"--train_index .*recorded.json records label 2"):
        check_scored_against(scored, train, "--test_index", "--train_index")


def test_an_evaluation_set_that_shares_a_training_shard_is_refused(sets, tmp_path):
    """The same index, a copy of it, or an index naming one of its shards by another path: each
    would score samples the model was fitted on."""
    train = ShardSet.from_index(sets["train"])
    first = train.files[0]
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "other.tar").write_bytes(first.read_bytes())  # the same bytes, another shard
    (tmp_path / "link").symlink_to(first.parent)  # the training shards' folder by another path
    absolute = tmp_path / "absolute.json"
    absolute.write_text(json.dumps({"shards": [{"file": str(tmp_path / "elsewhere" / "other.tar"), "samples": 4},
                                               {"file": str(tmp_path / "link" / first.name), "samples": 4}],
                                   "classes": ["class0", "class1"]}))
    for scored, says in ((sets["same"], r"--test_index .*train.json is the same index as --train_index: its accuracy "
                                        r"would be measured on samples the model was fitted on; point --test_index at "
                                        r"a held-out split"),
                         (sets["swapped"], r"--test_index .*swapped.json lists 2 of the shards --train_index "
                                           r".*train.json lists \(e.g. .*train-00000[01].tar\)"),
                         (absolute, rf"--test_index .*absolute.json lists 1 of the shards .*\(e.g. .*{first.name}\)")):
        with pytest.raises(ShardIndexError, match=says):
            check_held_out(ShardSet.from_index(scored), train, "--test_index", "--train_index")
    check_held_out(ShardSet.from_index(sets["fewer"]), train, "--test_index", "--train_index")  # shards of its own
    copy = ShardSet.from_index(tmp_path / "absolute.json")
    check_held_out(ShardSet(copy.files[:1], (4,), copy.classes), train, "--test_index", "--train_index")
    piped = ShardSet((PipeShard("pipe:cat a.tar"),), (4,), ("class0",))
    with pytest.raises(ShardIndexError, match=r"lists 1 of the shards .*\(e.g. pipe:cat a.tar\)"):
        check_held_out(piped, piped, "--test_index", "--train_index")


# --- the commands ---

def run(main, argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        cli(lambda: main(argv))
        status = 0
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


def evaluate_argv(sets, test: str, out: Path) -> list[str]:
    return ["--train_index", str(sets["train"]), "--test_index", str(sets[test]), "--random_init", "vit_debug_patch4",
            "--num_workers", "0", "--out", str(out)]


def test_evaluate_refuses_a_test_index_of_other_classes_before_decoding(sets, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(evaluate, "checked_encoder", lambda a: pytest.fail("the encoder was loaded"))
    status, _, err = run(evaluate.main, evaluate_argv(sets, "swapped", tmp_path / "e.json"), capsys)
    assert status == 2 and err.count("\n") == 1 and "label 0 is class 'class1' in --test_index" in err, err
    assert not (tmp_path / "e.json").exists()


def test_evaluate_refuses_to_score_the_training_shards(sets, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(evaluate, "checked_encoder", lambda a: pytest.fail("the encoder was loaded"))
    status, _, err = run(evaluate.main, evaluate_argv(sets, "same", tmp_path / "e.json"), capsys)
    assert status == 2 and err.count("\n") == 1 and "is the same index as --train_index" in err, err
    assert not (tmp_path / "e.json").exists()


def test_evaluate_reports_the_samples_it_skipped_by_kind(sets, tmp_path, capsys):
    status, out, err = run(evaluate.main, evaluate_argv(sets, "damaged", tmp_path / "e.json"), capsys)
    assert status == 0, err
    result = json.loads((tmp_path / "e.json").read_text())
    assert (result["test_samples"], result["test_listed"], result["test_skipped"]) == (4, 6, {"undecodable_image": 2})
    assert (result["train_samples"], result["train_listed"], result["train_skipped"]) == (8, 8, {})
    summary, printed = out.strip().splitlines()[-2:]
    assert json.loads(printed) == result
    assert summary.endswith(" on 4 of 6 test samples (2 skipped: undecodable_image 2); fitted on 8 of 8 training "
                            "samples") and f"kNN top-1 {result['knn_top1']:.2f}%" in summary


def test_evaluate_on_a_test_set_of_fewer_classes_scores_it(sets, tmp_path, capsys):
    status, _, err = run(evaluate.main, evaluate_argv(sets, "fewer", tmp_path / "e.json"), capsys)
    assert status == 0, err
    assert json.loads((tmp_path / "e.json").read_text())["test_samples"] == 4


def test_a_test_set_of_which_no_sample_decodes_is_refused_not_scored_0(sets, tmp_path, capsys):
    status, _, err = run(evaluate.main, evaluate_argv(sets, "all_bad", tmp_path / "e.json"), capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert "none of the 3 samples of the shard index" in err and "could be used (3 skipped: undecodable_image 3)" \
        in err and "python -m data.verify" in err
    assert not (tmp_path / "e.json").exists()


def training_argv(entry, sets, test: str, out: Path) -> list[str]:
    section = "finetune" if entry is finetune else "linprobe"
    return ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(out), "--run.progress",
            "false", "--data.source", "shards", "--model.in_chans", "3", "--optim.name", "adamw",
            f"--{section}.num_classes", "2", "--data.train_index", str(sets["train"]), "--data.eval_index",
            str(sets[test]), "--data.num_workers", "0"]


@pytest.mark.parametrize("entry", [finetune, linprobe], ids=["finetune", "linprobe"])
def test_training_commands_refuse_an_evaluation_index_of_other_classes_before_start(entry, sets, tmp_path, capsys):
    status, _, err = run(entry.main, training_argv(entry, sets, "swapped", tmp_path / "run"), capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert "data.eval_index" in err and "does not fit data.train_index" in err and "label 0 is class 'class1'" in err
    assert not (tmp_path / "run").exists() and not torch.distributed.is_initialized()


@pytest.mark.parametrize("entry", [finetune, linprobe], ids=["finetune", "linprobe"])
def test_training_commands_refuse_to_evaluate_on_their_training_shards_before_start(entry, sets, tmp_path, capsys):
    status, _, err = run(entry.main, training_argv(entry, sets, "same", tmp_path / "run"), capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert "data.eval_index" in err and "is the same index as data.train_index" in err
    assert not (tmp_path / "run").exists() and not torch.distributed.is_initialized()


def test_classification_accuracy_counts_skipped_samples_and_refuses_an_empty_score(sets):
    def predict(images):  # class 1 for bright images: a real function of the pixels
        return torch.stack([-images.mean((1, 2, 3)), images.mean((1, 2, 3))], 1)

    args = (28, 1.0, 0, 1, torch.device("cpu"), torch.float32)
    result = classification_accuracy(predict, ShardSet.from_index(sets["damaged"]), *args, num_workers=0)
    assert (result["eval_samples"], result["eval_listed"], result["eval_skipped_undecodable_image"]) == (4, 6, 2)
    assert not [k for k in result if k.startswith("eval_skipped_") and k != "eval_skipped_undecodable_image"]
    assert eval_summary(result).endswith("on 4 of 6 evaluation samples (2 skipped: undecodable_image 2)")
    with pytest.raises(CorruptDataError, match=r"none of the 3 samples of the shard index .*all_bad.json"):
        classification_accuracy(predict, ShardSet.from_index(sets["all_bad"]), *args, num_workers=0)


def test_a_linear_probe_logs_as_linprobe_and_reports_what_its_evaluation_skipped(sets, tmp_path):
    out = tmp_path / "run"
    argv = training_argv(linprobe, sets, "damaged", out) + ["--run.max_steps", "1"]
    proc = subprocess.run([sys.executable, str(REPO / "train" / "linprobe.py"), *argv], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert lines and not [line for line in lines if line.startswith("[pretrain]")], lines
    [said] = [line for line in lines if "of data.eval_index" in line]
    assert said.startswith("[linprobe] step 1: top-1 ") and said.endswith(
        " on 4 of 6 evaluation samples (2 skipped: undecodable_image 2) of data.eval_index")
    [row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval_top1" in line]
    assert (row["eval_samples"], row["eval_listed"], row["eval_skipped_undecodable_image"]) == (4, 6, 2)
    assert json.loads((out / "eval.json").read_text())["eval_skipped_undecodable_image"] == 2


def test_log_lines_name_the_command_and_pretraining_keeps_its_name(caplog):
    caplog.set_level(logging.INFO, logger="pretrain")
    try:
        for name in ("finetune", "linprobe", "pretrain"):
            command.name_log_lines(name)
            trainer.log.info("a line")
            assert caplog.records[-1].name == name
        assert not trainer.log.filters  # pretraining: the logger as it is
    finally:
        command.name_log_lines("pretrain")


def test_verify_checks_an_evaluation_index_against_the_training_index(sets, capsys):
    assert verify([str(sets["swapped"]), "--train_index", str(sets["train"]), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "the index " in err and "does not fit --train_index" in err and "label 0 is class 'class1'" in err
    assert verify([str(sets["same"]), "--train_index", str(sets["train"]), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is the same index as --train_index" in err, err
    assert verify([str(sets["fewer"]), "--train_index", str(sets["train"]), "--workers", "1"]) == 0


def test_verify_finds_labels_past_the_classes_of_their_index(sets, capsys):
    one_class = index_like(sets["train"], "one_class", classes=["class0"])  # the shards hold labels 0 and 1
    assert verify([str(one_class), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 2 and all("label_out_of_range x2 (" in line for line in bad), out  # 2 of 4 per shard
    assert "label 1, the index names 1 classes" in bad[0] and "0 of 2 shards good, 2 bad" in out


def test_scores_refuse_a_label_one_past_the_last_class_naming_the_index():
    """2 classes are labels 0 and 1: a test sample labelled 2 (shards whose index does not record
    their labels) is refused naming the index, not scored as a class the training set never had."""
    from train.run.evaluation import Coverage, Features, scores

    features = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    train = Features(features, torch.tensor([0, 1, 0, 1]), Coverage(Path("train.json"), 4, 4, {}))
    test = Features(features, torch.tensor([0, 1, 2, 0]), Coverage(Path("test.json"), 4, 4, {}))
    with pytest.raises(ShardIndexError, match=r"the shard index test.json holds label 2, past the 2 classes of the "
                                              r"training index: python -m data.verify test.json names the samples"):
        scores(train, test, 2)
    assert set(scores(train, test._replace(labels=torch.tensor([0, 1, 1, 0])), 2)) == {"knn_top1", "linear_probe_top1"}


# --- shard entries that climb out of the index's folder ---

@pytest.mark.parametrize("entry", ["../../etc/passwd", "sub/../../x.tar", "sub/../train-000000.tar"])
def test_an_entry_with_dot_dot_is_refused_when_the_index_is_read(sets, entry):
    index = index_like(sets["train"], "climbing", shards=[{"file": entry, "samples": 4}])
    with pytest.raises(ShardIndexError, match=rf"entry '{entry}' climbs with '\.\.'.*by its absolute path"):
        ShardSet.from_index(index)


def test_an_absolute_entry_is_read_as_it_is(sets):
    shard = sets["train"].parent / "train-000000.tar"
    index = index_like(sets["train"], "absolute", shards=[{"file": str(shard.resolve()), "samples": 4}])
    assert ShardSet.from_index(index).files == (shard.resolve(),)


@pytest.mark.parametrize("seen", ["0,1", [0, "1"], [0, True]])
def test_recorded_labels_that_are_not_a_list_of_integers_are_refused(sets, seen):
    with pytest.raises(ShardIndexError, match=r"'labels_seen' must be a list of integer labels.*re-index"):
        ShardSet.from_index(index_like(sets["train"], "seen", labels_seen=seen))
