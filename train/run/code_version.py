"""Which code a run used: the folder its packages were imported from, its git commit if it is a
checkout, and a content hash of its Python sources that is the same for a checkout and for the
snapshot launchers/submit.py made of it (so the run folder shows whether a job ran the snapshot)."""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the folder `launchers`, `train`, `data`, ... were imported from
PACKAGES = ("data", "kernels", "launchers", "model", "train")


def source_hash(root: Path = ROOT) -> str:
    """sha256 over the packages' .py files (relative path and bytes, in path order)."""
    h = hashlib.sha256()
    for path in sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def describe(root: Path = ROOT) -> dict:
    """{"path", "source_sha256", "git_commit" (None unless `root` is itself a git checkout's top, e.g. a snapshot)}."""
    try:
        proc = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root, capture_output=True, text=True)
    except OSError:  # no git on this machine (a minimal container): the source hash identifies the code alone
        proc = None
    top, commit = (proc.stdout.split() + [None, None])[:2] if proc is not None and proc.returncode == 0 else (None, None)
    inside = top is not None and Path(top) == root
    return {"path": str(root), "source_sha256": source_hash(root), "git_commit": commit if inside else None}
