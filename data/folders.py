"""Whether a folder or a file can be written before anything is: the output places of the shard
writer (data/write_shards.py), of a run (train/run/folder.py) and of every command that writes a
file (an export, an evaluation, a benchmark record) are checked with it before they start."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def unwritable(path: Path) -> str:
    """Why `path` cannot be (or become) a folder this process writes into, '' when it can: it is a
    file, a file stands where it would be created, or its nearest existing folder refuses a new
    entry (tried: an empty folder made and removed at once, since permission bits say nothing of
    read-only file systems)."""
    if path.exists() and not path.is_dir():
        return "is a file, not a folder: give a folder (it is created if missing)"
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be created, {existing} is a file; give another path"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write_check_", dir=existing))
    except OSError as e:
        return f"cannot be written: {existing} refuses a new entry ({e.strerror}); give a folder you can write to"
    return ""


def unwritable_file(path: Path) -> str:
    """Why `path` cannot be written as a file (its folder created if missing), '' when it can."""
    if path.is_dir():
        return "is a folder: give a file name"
    problem = unwritable(path.parent)
    return f"cannot be written: its folder {path.parent} {problem}" if problem else ""


def is_file_named(path: Path) -> bool:
    """path.is_file(); False also for a name the system refuses to look up (longer than it allows),
    which pathlib raises as OSError: no file can be there."""
    try:
        return path.is_file()
    except OSError:
        return False
