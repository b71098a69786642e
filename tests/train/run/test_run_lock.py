"""One run per run folder (train/run/run_lock.py): a second run into a folder another is using is
refused before it reads or writes anything there."""
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, run_pretrain

from train.run.run_lock import LOCK_NAME, hold_run_lock, release_run_lock, sign_run_lock

HOLD = ("import sys, time\nfrom pathlib import Path\nfrom train.run.run_lock import hold_run_lock, sign_run_lock\n"
        "hold_run_lock(Path(sys.argv[1]))\nsign_run_lock(Path(sys.argv[1]))\nprint('held', flush=True)\n"
        "time.sleep(120)\n")


@pytest.fixture
def held_by_another_process(tmp_path):
    """A process holding tmp_path/run's lock, as a run does from its start to its end."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    yield tmp_path / "run", proc.pid
    proc.kill()
    proc.wait()


def test_a_second_run_into_a_folder_in_use_is_refused_and_touches_nothing(held_by_another_process):
    run_dir, pid = held_by_another_process
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # the other run's, still being written
    before = sorted(p.name for p in run_dir.iterdir())
    proc = run_pretrain(run_dir, "--run.max_steps", "2", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"output_dir {run_dir} is in use by another run (pid {pid} on " in proc.stderr
    assert f"{run_dir / LOCK_NAME}): wait for it to end, or choose another --output_dir" in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == before
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def test_the_lock_is_held_for_the_run_and_let_go_at_its_end(tmp_path):
    """Taken again in the same process: a no-op; released: another process takes it."""
    run_dir = tmp_path / "run"
    hold_run_lock(run_dir)
    hold_run_lock(run_dir)
    sign_run_lock(run_dir)
    try:
        taken = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(120)", ""), str(run_dir)], cwd=REPO,
                               capture_output=True, text=True)
        assert taken.returncode == 1 and "is in use by another run (pid" in taken.stderr, taken.stderr
    finally:
        release_run_lock(run_dir)
    taken = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(120)", ""), str(run_dir)], cwd=REPO,
                           capture_output=True, text=True)
    assert taken.returncode == 0 and taken.stdout.strip() == "held", taken.stderr


def test_a_run_refused_before_start_leaves_no_lock_and_no_folder(tmp_path):
    new = tmp_path / "new"
    proc = run_pretrain(new, "--resume", str(tmp_path / "nowhere" / "step00000002"), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert not new.exists()
    hold_run_lock(new)  # and the lock is free: nothing of the refused run holds it
    release_run_lock(new)


def test_a_resume_waits_for_a_lock_let_go_soon_after(tmp_path, caplog):
    """A requeued job may start before a dead node's lock has expired (a network file system's
    lease): a resume waits for it, saying so, and takes it once it is let go."""
    import logging

    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD.replace("time.sleep(120)", "time.sleep(3)"), str(run_dir)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    caplog.set_level(logging.WARNING, logger="pretrain")
    try:
        start = time.monotonic()
        hold_run_lock(run_dir, wait_s=60)
        assert time.monotonic() - start > 1.0  # taken only once the holder let go (it holds it 3 s)
        assert "is locked (pid " in caplog.text and "waiting up to 60 s for it" in caplog.text
    finally:
        release_run_lock(run_dir)
        holder.kill()
        holder.wait()


def test_ranks_without_the_lock_delete_nothing(tmp_path, monkeypatch):
    """Only the rank holding the lock clears a folder (--run.overwrite, a start that never
    trained): a second job's rank 1, whose rank 0 was refused, deleted a live run's checkpoints."""
    from conftest import CPU_DS, DEBUG_PRESET

    from train.config.parsing import parse_args
    from train.run.prestart import check_before_start

    run_dir = tmp_path / "run"
    run_pretrain(run_dir, "--run.max_steps", "2", "--run.ckpt_every", "2")
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    monkeypatch.setenv("RANK", "1")
    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(run_dir),
                      "--run.overwrite", "true", "--optim.blr", "0.5"])
    check_before_start(cfg)
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_a_lock_file_a_refused_run_removed_is_not_held_twice(tmp_path):
    """A refused run removes the lock file it made; a run that was waiting on that file takes the
    file there now, so a third run is refused instead of holding the folder beside it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    hold_run_lock(run_dir)  # made run.lock
    waiter = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
         "from train.run.run_lock import hold_run_lock, sign_run_lock\n"
         "hold_run_lock(Path(sys.argv[1]), wait_s=60)\nsign_run_lock(Path(sys.argv[1]))\nprint('held', flush=True)\n"
         "time.sleep(60)\n", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "waiting up to 60 s for it" in waiter.stderr.readline()  # it has opened the file and waits
        release_run_lock(run_dir, refused=True)  # removes the file it made
        assert waiter.stdout.readline().strip() == "held"
        with pytest.raises(Exception, match="is in use by another run"):
            hold_run_lock(run_dir)
    finally:
        release_run_lock(run_dir)
        waiter.kill()
        waiter.wait()


@pytest.mark.parametrize("resume", [["--resume", "auto"], []])
def test_only_a_resume_waits_for_an_existing_folder_s_lock(tmp_path, monkeypatch, resume):
    """A requeued job resumes (--resume auto) and may find a dead node's lock not yet expired: it
    waits RESUME_WAIT_S for it; a fresh start into a folder in use is refused at once."""
    from conftest import CPU_DS, DEBUG_PRESET

    import train.run.prestart as prestart
    from train.config.parsing import parse_args
    from train.run.run_lock import RESUME_WAIT_S

    waits = []
    monkeypatch.setattr(prestart, "hold_run_lock", lambda run_dir, wait_s=0.0: waits.append(wait_s))
    monkeypatch.setenv("WORLD_SIZE", "1")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(run_dir), *resume])
    prestart.check_before_start(cfg)
    assert waits == [RESUME_WAIT_S if resume else 0.0]


def test_signing_replaces_a_longer_signature_of_an_earlier_run(tmp_path):
    """The file stays after a run: the next run's shorter stamp must not leave the tail of the old one."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).write_text("pid 4194301 on a-very-long-node-name.cluster.example.org since 2024-01-01 "
                                     "00:00:00\n")
    hold_run_lock(run_dir)
    try:
        sign_run_lock(run_dir)
        text = (run_dir / LOCK_NAME).read_text()
    finally:
        release_run_lock(run_dir)
    stamp = rf"pid {os.getpid()} on {re.escape(socket.gethostname())} since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\n"
    assert re.fullmatch(stamp, text), repr(text)


def test_a_refused_run_keeps_a_lock_file_it_did_not_make(tmp_path):
    """A run refused before start leaves the folder as it found it: the last run's run.lock (its
    signature) stays, unchanged; only a lock file the refused run made is removed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).write_text("pid 7 on node since 2024-01-01 00:00:00\n")  # the last run's signature
    hold_run_lock(run_dir)
    release_run_lock(run_dir, refused=True)
    assert (run_dir / LOCK_NAME).read_text() == "pid 7 on node since 2024-01-01 00:00:00\n"
