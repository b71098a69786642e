"""How every command of the repository refuses bad input: one line on stderr that names the problem
and the fix, exit status 2, before any work and with nothing written (docs/RELIABILITY.md).

- `Parser`: argparse whose errors (a misspelt option, a missing or unreadable value) are that
  one line instead of a usage block, naming the option a misspelt one most likely means
  (`did_you_mean`: the training commands' flags use it too);
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
import difflib
import json
import re
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn


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


OPTION_WORD = re.compile(r"--[A-Za-z]")  # an option's word: `--` then a letter (-1 or -0.5 is a value)


def is_option_word(word: str) -> bool:
    return OPTION_WORD.match(word) is not None


def _spelling(name: str) -> str:
    """An option's name as compared: no leading dashes, '-' and '_' alike (--dry_run is --dry-run)."""
    return name.lstrip("-").replace("-", "_")


def did_you_mean(word: str, names: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The one of `names` (options as typed: --max_train) that `word` most likely misspells: the
    same name with '-' and '_' swapped, else difflib's closest above `cutoff`; None when none is close."""
    by_spelling = {_spelling(name): name for name in names}
    close = difflib.get_close_matches(_spelling(word), by_spelling, n=1, cutoff=cutoff)
    return by_spelling[close[0]] if close else None


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit 2, naming for each
    option it does not know the one meant where one is close (--fromat: did you mean --format?);
    `--help` is unchanged."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)  # read by error(): argparse passes it no words
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        refuse(f"{message}{self._suggestions(message)} (--help lists the options)")

    def _long_options(self) -> set[str]:
        """The --options of this parser and of its sub-commands' parsers."""
        names = {s for s in self._option_string_actions if s.startswith("--")}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    names |= sub._long_options() if isinstance(sub, Parser) else \
                        {s for s in sub._option_string_actions if s.startswith("--")}
        return names

    def _unknown_options(self) -> list[str]:
        """The --words of the command line (up to a bare --) that name no option, whole or abbreviated."""
        known = self._long_options()
        unknown = []
        for word in getattr(self, "_given", []):
            if word == "--":
                break
            name = word.split("=", 1)[0]
            if is_option_word(name) and name not in known and \
                    not (self.allow_abbrev and any(k.startswith(name) for k in known)):
                unknown.append(name)
        return unknown

    def _suggestions(self, message: str) -> str:
        """'; did you mean --format?' for the one unknown option the message names, else
        '; --fromat: did you mean --format?' for each unknown option with a close one ('' when none)."""
        unknown = self._unknown_options()
        close = {word: did_you_mean(word, self._long_options()) for word in unknown}
        if len(unknown) == 1 and close[unknown[0]] and unknown[0] in message:
            return f"; did you mean {close[unknown[0]]}?"
        return "".join(f"; {word}: did you mean {meant}?" for word, meant in close.items() if meant)


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
