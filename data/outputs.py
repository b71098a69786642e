"""Outputs never destroy inputs (docs/RELIABILITY.md): every command that writes a file a user
names checks, before it writes anything, that

- the output is not one of the command's inputs and does not lie inside an input folder (paths
  compared after resolving symbolic links), refused even with --overwrite;
- it replaces no existing file unless --overwrite says so;

and writes each file under a temporary name in the output's folder, renamed into place when it is
complete (`os.replace`), so an interrupted write leaves no half file under the final name.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from data.cli import InputError


def clashing_input(out: Path, inputs: Iterable[Path]) -> tuple[Path, str] | None:
    """(the input, how `out` meets it: "is" or "lies inside") for the first input `out` is or lies
    inside, after resolving symbolic links; None when it meets none."""
    target = Path(out).resolve()
    for given in inputs:
        source = Path(given).resolve()
        if target == source:
            return Path(given), "is"
        if source in target.parents:
            return Path(given), "lies inside"
    return None


def check_output(out: Path, inputs: Iterable[Path], overwrite: bool, option: str) -> None:
    """InputError when writing `out` (a file or a folder the command fills) would destroy an input
    (`out` is one, or lies inside an input folder) or replace an existing file or folder without
    `overwrite`. `option` names `out` in the message (e.g. "--out")."""
    clash = clashing_input(out, inputs)
    if clash is not None:
        source, how = clash
        raise InputError(f"{option} {out} {how} the input {source}: writing it would destroy the input "
                         f"(--overwrite never replaces an input); give another path")
    if not overwrite and os.path.lexists(out):
        raise InputError(f"{option} {out} exists already: pass --overwrite to replace it, or give another path")


def temporary_name(out: Path) -> Path:
    """A hidden name beside `out`, of this process: `.NAME.tmpPID`."""
    return out.with_name(f".{out.name}.tmp{os.getpid()}")


@contextlib.contextmanager
def written_whole(out: Path) -> Iterator[Path]:
    """A temporary path beside `out` for the block to write (a file or a folder); renamed to `out`
    when the block ends, removed when it raises. A folder already at `out` is replaced whole (moved
    aside, then removed), a file by `os.replace`."""
    tmp = temporary_name(out)
    try:
        yield tmp
        if out.is_dir() and not out.is_symlink():
            aside = out.with_name(f".{out.name}.old{os.getpid()}")
            out.rename(aside)
            tmp.rename(out)
            shutil.rmtree(aside)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)
        else:
            tmp.unlink(missing_ok=True)
