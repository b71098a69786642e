"""One run per run folder: global rank 0 holds an exclusive lock on `<output_dir>/run.lock` from
its checks before start (a folder that exists) or the folder's making (a new one) to the run's
end, so that a second run into the same folder (started
alongside, or a duplicate job resuming the same folder) is refused in one line instead of
clearing, pruning or interleaving the first one's files. The file stays after a run (removing a
lock file races with the next run's open) and says which process held it last; a run refused
before start leaves the folder as it found it. A resume waits a while for the lock
(RESUME_WAIT_S): a network file system keeps the lock of a node that died until its lease ends,
and a requeued job may start before that. A file system without locks (some network mounts) is
said in a warning and the run goes on unguarded."""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from train.config.errors import ConfigError

log = logging.getLogger("pretrain")
LOCK_NAME = "run.lock"
RESUME_WAIT_S = 180.0  # NFSv4's lease (90 s by default) twice over


@dataclass
class _Held:
    fd: int
    made_file: bool  # this process created run.lock (and, made_dir, the folder): undone on a refusal
    made_dir: bool


_held: dict[Path, _Held] = {}  # run folder (resolved) -> this process's lock on it


def hold_run_lock(run_dir: Path, wait_s: float = 0.0) -> None:
    """Take the folder's lock (creating the folder) for this process, waiting up to `wait_s` for
    it, or raise ConfigError naming the process that holds it. Taking it again in the same process
    is a no-op."""
    key = run_dir.resolve()
    if key in _held:
        return
    made_dir = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    made_file = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(fd, path):
                break
            # a refused run removed the file it had made while this one waited: lock the one there now
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            continue
        except OSError as e:
            held = e.errno in (errno.EWOULDBLOCK, errno.EACCES)
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that has not said which"
            if held and time.monotonic() < deadline:
                if not said:
                    log.warning("output_dir %s is locked (%s): waiting up to %.0f s for it", run_dir, holder, wait_s)
                    said = True
                time.sleep(min(2.0, wait_s))
                continue
            os.close(fd)
            if held:
                raise ConfigError(f"output_dir {run_dir} is in use by another run ({holder}; {path}): wait for it to "
                                  f"end, or choose another --output_dir") from None
            log.warning("output_dir %s: its file system takes no lock (%s), so nothing stops a second run from "
                        "writing into it alongside this one", run_dir, e.strerror)
            return
    _held[key] = _Held(fd, made_file, made_dir)


def _same_file(fd: int, path: Path) -> bool:
    """The open lock file is still the one at `path` (not unlinked or replaced since it was opened)."""
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def sign_run_lock(run_dir: Path) -> None:
    """Say in the lock file which process holds it (once its checks have passed: a refused run
    changes nothing)."""
    held = _held.get(run_dir.resolve())
    if held is not None:
        os.ftruncate(held.fd, 0)
        stamp = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        os.pwrite(held.fd, stamp.encode(), 0)


def release_run_lock(run_dir: Path, refused: bool = False) -> None:
    """Let the folder go (the run ended, or was refused: then what taking the lock created is
    removed again). Nothing if this process does not hold it."""
    held = _held.pop(run_dir.resolve(), None)
    if held is None:
        return
    if refused and held.made_file:
        (run_dir / LOCK_NAME).unlink(missing_ok=True)
        if held.made_dir and not any(run_dir.iterdir()):
            run_dir.rmdir()
    os.close(held.fd)  # closing the file releases the lock
