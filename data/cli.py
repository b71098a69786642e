"""How every command of the repository refuses bad input: one line on stderr that names the problem
and the fix, exit status 2, before any work and with nothing written (docs/RELIABILITY.md).

- `Parser`: argparse whose errors (a misspelt option, a missing or unreadable value) are that
  one line instead of a usage block;
- `InputError` and `refusing(main)`: a command raises InputError (or FileNotFoundError) while it
  checks its input; `refusing` turns it into the line and the status;
- `read_json`: a JSON file that is missing or malformed is refused with its path, line and column;
- `regular_file`: a path that must be a regular file is refused when it is missing, a folder or a
  special file (a FIFO would block the reader forever; a device never ends), without opening it.

data/ is the lowest layer, so the data tools use this directly; train/run/cli.py builds the training
commands' statuses (3, 130, 143) on it.
"""
from __future__ import annotations

import argparse
import json
import stat
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn


class InputError(ValueError):
    """Input a command refuses before it starts; the message names the problem and the fix."""


def one_line(message: str) -> str:
    """A message as one line (an exception's text may hold several: a list after a colon stays a list)."""
    out = ""
    for part in (p.strip() for p in str(message).splitlines()):
        if part:
            out += part if not out else (f" {part}" if out.endswith(":") else f"; {part}")
    return out


def refuse(message: str) -> NoReturn:
    """Print `error: <message>` as one line on stderr and exit 2."""
    print(f"error: {one_line(message)}", file=sys.stderr)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit 2; `--help` is unchanged."""

    def error(self, message: str) -> NoReturn:
        refuse(f"{message} (--help lists the options)")


def refusing(main: Callable[[], Any], refused: tuple[type[BaseException], ...] = ()) -> Any:
    """Run `main()`; InputError, FileNotFoundError and `refused` end it with one line and exit 2."""
    try:
        return main()
    except (InputError, FileNotFoundError, NotADirectoryError, *refused) as e:
        refuse(str(e))


SPECIAL_FILES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def regular_file(path: str | Path, what: str, fix: str = "") -> Path:
    """`path` when it is a regular file (symbolic links followed); else InputError naming `what`, the
    path and what it is instead, then `fix` (e.g. "give an exported encoder.safetensors"). Judged
    from `stat` alone: a FIFO is never opened, so the check cannot block."""
    path = Path(path)
    hint = f": {fix}" if fix else ""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist{hint}") from None
    except OSError as e:  # a path under a file, a loop of links, no permission on a folder above it
        raise InputError(f"{what} {path} cannot be read ({e.strerror}){hint}") from None
    if stat.S_ISDIR(mode):
        raise InputError(f"{what} {path} is a folder{hint or '; give the file itself'}")
    for is_kind, kind in SPECIAL_FILES:
        if is_kind(mode):
            raise InputError(f"{what} {path} is {kind}, not a regular file{hint}")
    return path


def read_json(path: str | Path, what: str) -> Any:
    """The JSON value in `path`; InputError naming `what`, the path and, when malformed, its line and column."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{what} {path} is a folder; give the JSON file itself")
    if path.exists():
        regular_file(path, what, "give the JSON file itself")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{what} {path} cannot be read ({e})") from None
    try:
        return json.loads(text, object_pairs_hook=_object_without_repeats)
    except json.JSONDecodeError as e:
        raise InputError(f"{what} {path}:{e.lineno}:{e.colno} is not valid JSON ({e.msg}): fix the file at line "
                         f"{e.lineno}, column {e.colno}") from None
    except RecursionError:  # json's error for arrays/objects nested past the interpreter's recursion limit
        raise InputError(f"{what} {path} is nested too deep to be read as JSON (arrays or objects inside one another "
                         f"past Python's recursion limit): fix or replace the file") from None
    except _RepeatedKey as e:
        raise InputError(f"{what} {path} gives the key {e.args[0]!r} twice in one object, and JSON readers keep "
                         f"only the last (DeepSpeed refuses the file): keep one of them") from None


class _RepeatedKey(ValueError):
    pass


def _object_without_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: the object as a dict, _RepeatedKey naming a key given twice in it."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out
