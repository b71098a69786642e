"""Runs of the pretraining entry point (train.run.cli's `cli` around train/pretrain.py's `main`) in this
process, with one checkpoint file failing to be written as on a full disk, or with every fsync
recorded: what tests/faults/test_save_faults.py checks, in a process of its own (the engine,
DeepSpeed's cached process groups and the stop-signal handlers stay out of the test session).

    python tests/faults/failing_saves.py RECORD.json SCENARIOS.json

Each scenario is {"argv": [...], "fail": FILE or null, "in": FOLDER, "rank": R or null, "fsync": bool}:
writes of FILE (a name: model.safetensors, __0_0.distcp, rng_rank1.pt, ...) in a folder whose path
ends with FOLDER (step00000004.partial, or step00000004.partial/optim) fail with ENOSPC, on rank R
or on every rank. Under a
launcher's environment (RANK, WORLD_SIZE, ...) every rank runs the same scenarios, and rank r
writes RECORD_rank<r>.json: per scenario the exit status, the stderr lines, the paths fsynced.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import sys
from pathlib import Path
from unittest import mock

from torch.distributed.checkpoint.filesystem import FileSystem

from train.engine import state_files
from train.pretrain import main
from train.run.cli import cli


class FullDisk:
    """A file opened for writing whose writes fail as they do on a full disk; the rest is the file's."""

    def __init__(self, file):
        self.file = file

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def failing_writes(name: str, folder: str, stack: contextlib.ExitStack) -> None:
    """While `stack` is open, `name` in a folder whose path ends with `folder` opens as a FullDisk, through both
    ways a checkpoint file is opened: state_files' `open` (the engine's files, the RNG files) and
    DCP's FileSystem (its shards and metadata)."""
    def hit(path) -> bool:
        return Path(path).name == name and Path(path).parent.as_posix().endswith(f"/{folder}")

    def opener(path, *args, **kwargs):
        f = open(path, *args, **kwargs)
        return FullDisk(f) if hit(path) else f

    real_stream = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real_stream(self, path, mode) as stream:
            yield FullDisk(stream) if hit(path) else stream

    stack.enter_context(mock.patch.object(state_files, "open", opener, create=True))
    stack.enter_context(mock.patch.object(FileSystem, "create_stream", create_stream))


def recording_fsyncs(synced: list[str], stack: contextlib.ExitStack) -> None:
    """While `stack` is open, every os.fsync (ours and DCP's) appends the path of its file or folder
    to `synced`."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    stack.enter_context(mock.patch.object(os, "fsync", fsync))


def run(scenario: dict) -> dict:
    rank = int(os.environ.get("RANK", "0"))
    synced: list[str] = []
    err = io.StringIO()
    with contextlib.ExitStack() as stack, contextlib.redirect_stderr(err):
        if scenario.get("fail") and scenario.get("rank") in (None, rank):
            failing_writes(scenario["fail"], scenario["in"], stack)
        if scenario.get("fsync"):
            recording_fsyncs(synced, stack)
        try:
            cli(lambda: main(scenario["argv"]))
            status = 0
        except SystemExit as e:
            status = e.code
    return {"status": status, "stderr": err.getvalue().splitlines(), "fsynced": synced}


if __name__ == "__main__":
    record, scenarios = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    results = [run(scenario) for scenario in scenarios]
    rank = int(os.environ.get("RANK", "0"))
    record.with_name(f"{record.stem}_rank{rank}.json").write_text(json.dumps(results))
    sys.stdout.flush()
    sys.stderr.flush()
    # as tests/distributed/rank_end.py explains: what is under test is in the record, not the order in
    # which the interpreter's shutdown frees gloo's objects (a failed run leaves its process group up)
    os._exit(0)
