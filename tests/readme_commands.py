"""The commands a user copies from the README and the docs pages (docs/*.md), for the tests that run
them as written (tests/test_readme_commands.py).

A markdown file is read as a `Doc` (its path relative to the repository root, which every message
names, and its text). A command is found by a stable anchor (the start of its indented line, or the
words before a `quoted` span in the prose) and turned into argv with only what a test must change:
`python` -> this interpreter, and the page's paths (`shards/...`, `runs/...`, `/data/...`,
`/scratch/...`) -> folders of the test. A path of those kinds left unmapped is an error, so a path
that changes never makes a test write into the repository or read the machine's /data. A command a
page gives more than once (in different sections) is told apart by the words it follows (`after`).
Every failure names the file and line (`docs/DATA.md:42`).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from conftest import PROCESS_GROUP_ENV

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CODE = "    "  # a markdown code line: indented by four spaces
USER_FOLDERS = ("shards/", "runs/", "/data/", "/scratch/")  # where commands read and write data: always mapped


@dataclass(frozen=True)
class Doc:
    """A markdown file of the repository: `name` (relative to the root, as messages name it) and its text."""

    name: str
    text: str

    @classmethod
    def read(cls, name: str) -> Doc:
        return cls(name, (REPO / name).read_text())

    def replace(self, old: str, new: str) -> Doc:
        return Doc(self.name, self.text.replace(old, new))

    def sub(self, pattern: str, repl: str) -> Doc:
        return Doc(self.name, re.sub(pattern, repl, self.text))


def _doc(doc: Doc | str) -> Doc:
    """A Doc as it is; bare text is README.md's."""
    return doc if isinstance(doc, Doc) else Doc("README.md", doc)


@dataclass(frozen=True)
class Snippet:
    """Text of a page (continuation lines joined), the line it starts on (1-based) and the page."""

    line: int
    text: str
    file: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def argv(self, paths: dict[str, Path], optional: bool = False) -> list[str]:
        """As argv: `[...]` groups dropped (kept without brackets with optional=True), the `# comment`
        dropped, a leading `python` -> sys.executable, and each path equal to or under a key of
        `paths` moved to that key's value."""
        text = re.sub(r"\[([^\]]*)\]", r"\1" if optional else "", self.text)
        argv = [_mapped(token, paths) for token in shlex.split(text, comments=True)]
        unmapped = [t for t in argv if t.startswith(USER_FOLDERS)]
        if unmapped:
            raise ValueError(f"{self.where}: the test maps no folder for {unmapped} ({self.file}'s path changed? "
                             f"mapped: {sorted(paths)}); it would write into the repository")
        if argv and argv[0] == "python":
            argv[0] = sys.executable
        return argv


def _mapped(token: str, paths: dict[str, Path]) -> str:
    for key, target in paths.items():
        if token == key or token.startswith(key + "/"):
            return str(Path(target, token[len(key) + 1:]))
    return token


def _missing(doc: Doc, what: str, section: str) -> LookupError:
    """The error for an anchor that is gone, naming the page and line where it was expected."""
    heading = next((i for i, line in enumerate(doc.text.splitlines(), 1) if line.lstrip("#").strip() == section), None)
    place = f"section '{section}' ({doc.name}:{heading})" if heading else f"section '{section}', which is gone too"
    return LookupError(f"{doc.name} has no {what} in {place}: the user's command changed or moved; "
                       f"update {doc.name} or the anchor in tests/test_readme_commands.py")


def code_lines(doc: Doc | str) -> list[Snippet]:
    """Every indented line of the page, a line ending in `\\` joined with the next."""
    doc = _doc(doc)
    lines, out, i = doc.text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith(CODE) and lines[i].strip():
            start, joined = i, lines[i][len(CODE):]
            while joined.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                joined = joined.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            out.append(Snippet(start + 1, joined, doc.name))
        i += 1
    return out


def _start(doc: Doc, after: str, section: str) -> int:
    """The line (1-based) where the words `after` end: where a search for a command begins (1: no words)."""
    if not after:
        return 1
    match = re.search(_words(after), doc.text)
    if not match:
        raise _missing(doc, f"words {after!r}", section)
    return doc.text.count("\n", 0, match.end()) + 1


def command(doc: Doc | str, anchor: str, section: str, after: str = "") -> Snippet:
    """The first indented line (with its continuations) that starts with `anchor` (and follows the
    words `after`: a command the page repeats elsewhere)."""
    doc = _doc(doc)
    start = _start(doc, after, section)
    for snippet in code_lines(doc):
        if snippet.line >= start and snippet.text.startswith(anchor):
            return snippet
    where = f" after {after!r}" if after else ""
    raise _missing(doc, f"indented command starting with {anchor!r}{where}", section)


def code_block(doc: Doc | str, anchor: str, section: str) -> Snippet:
    """The indented block whose first line starts with `anchor`, lines joined by newlines."""
    doc = _doc(doc)
    lines = doc.text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(CODE + anchor):
            block = []
            for following in lines[i:]:
                if not following.startswith(CODE):
                    break
                block.append(following[len(CODE):])
            return Snippet(i + 1, "\n".join(block), doc.name)
    raise _missing(doc, f"indented block starting with {anchor!r}", section)


def _words(phrase: str) -> str:
    """A regex of the phrase's words, any whitespace (line breaks too) between them."""
    return r"\s+".join(map(re.escape, phrase.split()))


def quoted(doc: Doc | str, before: str, section: str, after: str = "") -> Snippet:
    """The first `code span` of the prose that follows the words `before` (and precedes `after`),
    across line breaks."""
    doc = _doc(doc)
    pattern = _words(before) + r"\s+`([^`]+)`" + (r"\s+" + _words(after) if after else "")
    match = re.search(pattern, doc.text)
    if not match:
        raise _missing(doc, f"`...` after {before!r}" + (f" before {after!r}" if after else ""), section)
    return Snippet(doc.text.count("\n", 0, match.start(1)) + 1, " ".join(match.group(1).split()), doc.name)


def paragraph(doc: Doc | str, words: str, section: str) -> Snippet:
    """The prose from the words `words` to the end of their paragraph (a blank line), whitespace
    collapsed: a claim of the page that a test checks."""
    doc = _doc(doc)
    match = re.search(_words(words) + r".*?(?:\n\s*\n|\Z)", doc.text, re.DOTALL)
    if not match:
        raise _missing(doc, f"words {words!r}", section)
    return Snippet(doc.text.count("\n", 0, match.start()) + 1, " ".join(match.group(0).split()), doc.name)


def run(snippet: Snippet, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a page's command from the repository root, as the page says; a failure names its file and
    line (with check=False the caller judges the exit status: a refusal the page promises)."""
    env = {**{k: v for k, v in os.environ.items() if k not in PROCESS_GROUP_ENV},  # a shell of the user's
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, check=False, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{snippet.where} `{snippet.text}` stopped working: run as {shlex.join(argv)} it exited "
                             f"{proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc
