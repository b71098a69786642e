"""A crash while a checkpoint is written, and checkpoints damaged afterwards: the previous
complete tag is the one resumed from; a partial or damaged tag is never picked. A run resumed from
an older tag keeps what it saves and is the one `--resume auto` continues."""
import json

import pytest
from conftest import run_pretrain

from train.engine.checkpoint import COMPLETE, LATEST, check_files, find_resume, latest_complete, prune, tag_for
from train.run.folder import read_metrics


def test_killed_while_writing_step_4_resumes_from_step_2_and_repeats_its_losses(tmp_path):
    args = ("--run.max_steps", "6", "--run.ckpt_every", "2")
    proc = run_pretrain(tmp_path, *args, faults="checkpoint_write@4", check=False)
    assert proc.returncode == -9  # SIGKILL with step 4's files written, before the tag was declared complete
    root = tmp_path / "checkpoints"
    assert (root / "step00000004.partial" / "model.safetensors").is_file()  # the files are there
    assert not (root / "step00000004").exists()  # but under the temporary name
    assert (root / LATEST).read_text() == "step00000002"
    before_crash = {r["step"]: r for r in read_metrics(tmp_path)}
    assert max(before_crash) == 4  # steps 3 and 4 ran and were logged before the crash

    proc = run_pretrain(tmp_path, *args, "--resume", "auto")
    assert "step00000002 at step 2" in proc.stdout + proc.stderr
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for step in (3, 4):  # computed again from step 2: the values of the run before it crashed
        assert rows[step - 1]["loss"] == before_crash[step]["loss"]
        assert rows[step - 1]["grad_norm"] == pytest.approx(before_crash[step]["grad_norm"], rel=1e-6)
    assert sorted(p.name for p in root.glob("step*")) == [tag_for(s) for s in (2, 4, 6)]  # partial replaced
    assert check_files(root / tag_for(4)) is None


def _tag(root, step, files=None):
    d = root / tag_for(step)
    d.mkdir(parents=True)
    for name, data in (files or {}).items():
        (d / name).write_bytes(data)
    sizes = {name: len(data) for name, data in (files or {}).items()}
    (d / COMPLETE).write_text(json.dumps({"step": step, "world_size": 1, "files": sizes}))
    return d


def test_a_damaged_newest_tag_falls_back_to_the_one_before(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    good = _tag(root, 2, {"model.pt": b"x" * 100})
    bad = _tag(root, 4, {"model.pt": b"x" * 100, "rng_rank0.pt": b"y" * 10})
    (root / LATEST).write_text(bad.name)
    assert latest_complete(root) == bad
    (bad / "model.pt").write_bytes(b"x" * 60)  # truncated (disk full, cut copy)
    assert latest_complete(root) == good
    assert "has 60 bytes, 100 were written" in caplog.text
    (bad / "model.pt").write_bytes(b"x" * 100)
    (bad / "rng_rank0.pt").unlink()
    assert latest_complete(root) == good and "rng_rank0.pt is missing" in caplog.text
    (bad / COMPLETE).write_text("{not json")
    assert latest_complete(root) == good
    with pytest.raises(FileNotFoundError, match="resume from an earlier tag"):  # named explicitly: refused
        (bad / COMPLETE).write_text(json.dumps({"step": 4, "world_size": 1, "files": {"rng_rank0.pt": 10}}))
        find_resume(str(bad), tmp_path)


def test_prune_removes_partial_saves_older_than_what_it_keeps(tmp_path):
    root = tmp_path / "checkpoints"
    for s in (1, 2, 3):
        _tag(root, s)
    (root / f"{tag_for(2)}.partial").mkdir()  # a crashed save, superseded
    (root / f"{tag_for(4)}.partial").mkdir()  # a save in progress / crashed after the newest
    prune(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == [tag_for(3), f"{tag_for(4)}.partial"]



def test_a_run_resumed_from_an_older_tag_keeps_its_saves_and_is_the_one_continued(tmp_path):
    """A run to step 6 keeps tags 4-6; a new run from step 4 keeping 1 tag saves step 5: pruning
    counts only the tags up to the one just saved (it used to keep the first run's step 6 as the
    newest and delete step 5, which `latest` named), and `--resume auto` continues the new run."""
    every = ("--run.ckpt_every", "1")
    run_pretrain(tmp_path, "--run.max_steps", "6", *every, "--run.keep_checkpoints", "3")
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step*")) == [tag_for(s) for s in (4, 5, 6)]
    run_pretrain(tmp_path, "--run.max_steps", "5", *every, "--run.keep_checkpoints", "1",
                 "--resume", str(root / tag_for(4)))
    assert (root / LATEST).read_text() == tag_for(5) and check_files(root / tag_for(5)) is None
    # step 6 is the first run's, left until this run saves its own step 6
    assert sorted(p.name for p in root.glob("step*")) == [tag_for(5), tag_for(6)]
    proc = run_pretrain(tmp_path, "--run.max_steps", "6", *every, "--run.keep_checkpoints", "1", "--resume", "auto")
    assert f"{tag_for(5)} at step 5" in proc.stdout + proc.stderr
    assert sorted(p.name for p in root.glob("step*")) == [tag_for(6)] and (root / LATEST).read_text() == tag_for(6)


def test_a_metrics_line_cut_short_by_a_crash_does_not_stop_the_resume(tmp_path):
    """Half a record (and NUL bytes, as a power loss leaves) at the end of metrics.jsonl made
    every later `--resume auto` end in a JSONDecodeError traceback after loading the checkpoint."""
    run_pretrain(tmp_path, "--run.max_steps", "3", "--run.ckpt_every", "2")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 2.2')
        f.write("\0" * 16)
    assert len(read_metrics(tmp_path)) == 3  # readers leave the cut line out
    proc = run_pretrain(tmp_path, "--resume", "auto", "--run.max_steps", "4", "--run.ckpt_every", "2")
    assert "line(s) that are no complete JSON record dropped (a write cut short)" in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert "\0" not in (tmp_path / "metrics.jsonl").read_text()
