"""Every name the code reads is defined: pyflakes' undefined-name report over the repository's
Python files. The suite runs on CPUs, so a branch taken only on a GPU (a capability check, a
CUDA-only test) is never executed here, and a misspelt or unimported name on it would first fail
on the GPU. `benchmarks/` is left out: its scripts are records of past measurements, run as
they were."""
from __future__ import annotations

import subprocess
from pathlib import Path

from pyflakes import api, messages
from pyflakes.reporter import Reporter

REPO = Path(__file__).resolve().parent.parent
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class Collect(Reporter):
    """Keeps the undefined-name messages (and syntax errors); the rest of pyflakes' findings are style."""

    def __init__(self):
        super().__init__(None, None)
        self.found: list[str] = []

    def flake(self, message):
        if isinstance(message, UNDEFINED):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")


def test_every_name_read_is_defined():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    files = [f for f in files if not f.startswith("benchmarks/")]
    assert len(files) > 300
    reporter = Collect()
    for f in files:
        api.checkPath(str(REPO / f), reporter)
    assert not reporter.found, "\n".join(reporter.found)
