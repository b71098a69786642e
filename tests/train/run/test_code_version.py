"""Which code a run used (train/run/code_version.py) and the checkout's commit in meta.json
(train/run/folder.py git_commit), on small git repositories made in tmp_path."""
import shutil
import subprocess
from pathlib import Path

import pytest

import train.run.folder as folder
from train.run import code_version


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A git repository with one commit, its own user config, and runs/ ignored (as this checkout's)."""
    repo = tmp_path / "checkout"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.name", "t")
    git(repo, "config", "user.email", "t@t")
    git(repo, "config", "commit.gpgsign", "false")
    (repo / ".gitignore").write_text("runs/\n")
    (repo / "a.py").write_text("X = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "start")
    return repo


def test_a_snapshot_inside_a_checkout_records_no_commit_and_the_checkout_its_own(checkout):
    """launchers/submit.py snapshots into <run>/launch/code, and a run folder may lie in a checkout's
    ignored runs/: git finds that checkout above the snapshot, whose commit is not the snapshot's code."""
    snap = checkout / "runs" / "x" / "launch" / "code"
    for pkg in code_version.PACKAGES:
        shutil.copytree(code_version.ROOT / pkg, snap / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert git(snap, "rev-parse", "--show-toplevel") == str(checkout)  # git does see the checkout from there
    described = code_version.describe(snap)
    assert described["git_commit"] is None
    assert described["path"] == str(snap) and described["source_sha256"] == code_version.source_hash(code_version.ROOT)
    assert code_version.describe(checkout)["git_commit"] == git(checkout, "rev-parse", "HEAD")


def test_git_commit_says_dirty_only_after_a_tracked_file_changed(checkout, monkeypatch):
    monkeypatch.setattr(folder, "REPO", checkout)
    head = git(checkout, "rev-parse", "HEAD")
    assert folder.git_commit() == {"commit": head, "dirty": False}
    (checkout / "new.py").write_text("Y = 2\n")  # untracked: not a change of the checkout's code
    assert folder.git_commit() == {"commit": head, "dirty": False}
    (checkout / "a.py").write_text("X = 2\n")
    assert folder.git_commit() == {"commit": head, "dirty": True}
