"""JSON nested deeper than Python's recursion limit (json raises RecursionError, not a ValueError) in
a file a run reads: a preset or ds_config is refused in one line before anything is written; a line
of metrics.jsonl is dropped as a line cut short is; an old tag's complete.json makes neither the
resume nor the pruning after a save end in a traceback."""
import warnings

import pytest
from conftest import CPU_DS, DEBUG_PRESET, run_pretrain

from train.engine.checkpoint import COMPLETE, LATEST, tag_for
from train.run.cli import cli
from train.run.folder import read_metrics
from train.run.command import main as pretrain

DEEP = "[" * 100_000 + "]" * 100_000


def refused_in_one_line(argv: list[str], capsys) -> str:
    """Pretraining's stderr for `argv`, which it refuses before start: exit 2, one line."""
    capsys.readouterr()
    with warnings.catch_warnings(), pytest.raises(SystemExit) as status:
        warnings.simplefilter("ignore")
        cli(lambda: pretrain(argv))
    err = capsys.readouterr().err
    assert status.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
    return err


@pytest.mark.parametrize("option", ["--config", "--ds_config"])
def test_a_config_file_nested_too_deep_is_refused_in_one_line(tmp_path, capsys, option):
    (tmp_path / "deep.json").write_text(DEEP)
    files = {"--ds_config": str(CPU_DS), "--config": str(DEBUG_PRESET), option: str(tmp_path / "deep.json")}
    argv = [arg for pair in files.items() for arg in pair] + ["--output_dir", str(tmp_path / "run")]
    err = refused_in_one_line(argv, capsys)
    assert f"{tmp_path / 'deep.json'} is nested too deep to be read as JSON" in err and "fix or replace the file" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep.json"]


def test_a_resume_and_its_pruning_pass_json_nested_too_deep_in_the_run_folder(tmp_path):
    """A deep line in metrics.jsonl, and an old tag whose complete.json is deep: `--resume auto`
    drops the line with the warning for malformed lines, resumes from the newest readable tag, and
    the first save's pruning keeps the unreadable tag (it cannot say it is unpinned) instead of
    ending the run after training."""
    run_pretrain(tmp_path, "--run.max_steps", "2", "--run.ckpt_every", "2")
    root = tmp_path / "checkpoints"
    old = root / tag_for(1)
    old.mkdir()
    (old / COMPLETE).write_text(DEEP)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(DEEP + "\n")
    proc = run_pretrain(tmp_path, "--resume", "auto", "--run.max_steps", "3", "--run.ckpt_every", "1",
                        "--run.keep_checkpoints", "1")
    assert "Traceback" not in proc.stderr
    assert f"{tag_for(2)} at step 2" in proc.stdout + proc.stderr
    assert "1 line(s) that are no complete JSON record dropped" in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert sorted(p.name for p in root.glob("step*")) == [tag_for(1), tag_for(3)]
    assert (root / LATEST).read_text() == tag_for(3) and (old / COMPLETE).read_text() == DEEP


def test_a_run_folder_whose_config_json_is_nested_too_deep_is_refused_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(DEEP)
    err = refused_in_one_line(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(run)],
                              capsys)
    assert "holds a config.json that is not readable JSON" in err
    assert sorted(p.name for p in run.iterdir()) == ["config.json"] and (run / "config.json").read_text() == DEEP


def test_an_init_folder_whose_config_json_is_nested_too_deep_is_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(DEEP)
    err = refused_in_one_line(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir",
                               str(tmp_path / "run"), "--model.init_from", str(folder)], capsys)
    assert f"model.init_from {folder}: not an encoder this code reads" in err
