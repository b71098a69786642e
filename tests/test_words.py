"""The repository talks about the code, its users and its papers, never about how it was written:
no issue numbers, no work sessions, no instructions for one particular machine, no absolute paths
of a machine, no pointers to files outside the repository. Every text file the repository holds
(tracked, or new and not ignored) but this one, which holds the list, is scanned line by line; a
hit fails with file:line and the text.

Each pattern names what it stands for (`(?i)`: in any case). A legitimate use of a flagged word (a process session, a
pytest session) is removed from the line by a precise pattern before the check, never by exempting
another file."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()
SKIP_DIRS = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", "build", ".whl", ".gpu", ".gl"}
BINARY = {".png", ".jpg", ".jpeg", ".gif", ".webp", ".gz", ".tar", ".pt", ".pth", ".safetensors", ".whl", ".pdf"}

# name -> (pattern, legitimate uses removed from a line before the pattern is searched)
PATTERNS: dict[str, tuple[str, list[str]]] = {
    "an issue number": (r"(?i)\bissues?[ -]#?\d+", []),
    "a work session": (r"(?i)\bsessions?\b", [
        r"\bits own session\b", r"\bprocesses of a session\b", r"\bpgrp, session\b",  # a process session (setsid)
        r"\brequest\.session\b", r"\bleave the session as it was\b",  # pytest's session
        r"\ban interactive session\b",  # Python's REPL
    ]),
    "a numbered stop": (r"(?i)\bstops? \d+(?:-\d+)?\b(?! ?(?:steps?|minutes?|seconds?|s|ms|%))", []),
    "the lead": (r"(?i)\bthe lead\b", []),
    "who did what": (r"(?i)\bwho did what\b", []),
    "a borrowed machine": (r"(?i)\blent\b|\bborrowed (?:GPU|machine)\b|\bdevice tool\b", []),
    "the borrowed machine's output folder": (r"\$OUT\b|\$\{OUT\}", []),
    "the borrowed machine's install folder": (r"/tmp/site\b", []),
    "the borrowed machine's command limit": (r"\btimeout_s\b", []),
    "the borrowed machine's carried files": (r"`carry`|\bcarry: ?\[|\bcarry runs/", []),
    "an absolute path of a machine": (r"(?<![\w.~])/(?:work|root)/", []),
    "a transcript path in /tmp": (r"/tmp/(?:demo\d+|[\w-]+\.(?:py|log|txt|json))\b", []),
    "who owns what": (r"(?i)\bnot owned here\b", []),
    "no time": (r"(?i)\bno time\b", []),
    "the method notes outside the repository": (r"\bMETHODS\.md\b|\.\./shared\b", []),
    "a paper's text file": (r"\b(?:mlo_mae|adpe_maeplus|mixedae_appendix|energy_pretraining)\.txt\b|\bpapers/\w+\.txt\b", []),
}


def text_files() -> list[Path]:
    """Every file git tracks or would track (not ignored); without git, a walk of the tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                             check=True, text=True).stdout
        paths = [REPO / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = []
        for root, dirs, files in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            paths += [Path(root, f) for f in files]
    return sorted(p for p in paths if p.is_file() and p.resolve() != THIS and p.suffix.lower() not in BINARY)


def lines_of(path: Path) -> list[str] | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return None


@pytest.fixture(scope="module")
def tree() -> dict[str, list[str]]:
    files = {}
    for path in text_files():
        lines = lines_of(path)
        if lines is not None:
            files[path.relative_to(REPO).as_posix()] = lines
    assert "README.md" in files and "docs/TRAINING.md" in files, sorted(files)[:20]
    return files


def hits(files: dict[str, list[str]], pattern: str, allowed: list[str]) -> list[str]:
    found, regex, legit = [], re.compile(pattern), [re.compile(a, re.IGNORECASE) for a in allowed]
    for name, lines in files.items():
        for number, line in enumerate(lines, 1):
            checked = line
            for a in legit:
                checked = a.sub(" ", checked)
            if regex.search(checked):
                found.append(f"{name}:{number}: {line.strip()[:160]}")
    return found


@pytest.mark.parametrize("what", sorted(PATTERNS))
def test_no_words_about_how_the_code_was_written(tree, what):
    pattern, allowed = PATTERNS[what]
    found = hits(tree, pattern, allowed)
    assert not found, f"{len(found)} line(s) with {what} (/{pattern}/):\n" + "\n".join(found)


@pytest.mark.parametrize("line, what", [
    ("as issue 7 reported", "an issue number"), ("(with the issue-8 changes)", "an issue number"),
    ("between sessions 2 and 3", "a work session"), ("Seed 1 (stops 4-5)", "a numbered stop"),
    ("stop 6 lost 9%", "a numbered stop"), ("as the lead wants", "the lead"),
    ("into $OUT when set", "the borrowed machine's output folder"),
    ("--target /tmp/site .whl/*.whl", "the borrowed machine's install folder"),
    ("`carry: [\".whl\"]`", "the borrowed machine's carried files"),
    ("/work/main/benchmarks/results", "an absolute path of a machine"), ("/root/out", "an absolute path of a machine"),
    ("measured with /tmp/measure.py", "a transcript path in /tmp"),
    ("METHODS.md section 0", "the method notes outside the repository"),
    ("(mlo_mae.txt Appendix A)", "a paper's text file"), ("a lent GPU machine", "a borrowed machine"),
])
def test_each_pattern_catches_what_it_names(line, what):
    assert hits({"x.md": [line]}, *PATTERNS[what]) == [f"x.md:1: {line}"]


@pytest.mark.parametrize("line", [
    "start_new_session=True, **kw)", '"""In its own session, as a terminal\'s foreground job."""',
    "# fields: state, ppid, pgrp, session", "request.session.items", "(an interactive session)",
    "the run stops 20 steps later", "tokens keep their positions", "data/fashion_mnist.py downloads into runs/",
    "python tests/launchers/slurm_cluster.py runs/slurm", "names.txt", "~/work/x", "TIMEOUT_S = 60",
])
def test_legitimate_uses_pass(line):
    assert not any(hits({"x.md": [line]}, *rule) for rule in PATTERNS.values()), line
