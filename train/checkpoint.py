"""Checkpoints: the engine's files (train/engine/state_files.py), each rank's RNG, and what makes a
tag trustworthy.

Layout of `<output_dir>/checkpoints/`:
    step00000100/                 one tag per save
        model.safetensors         the objective's tensors by name: fp32 weights, frozen tables,
                                  buffers (rank 0, one tensor at a time)
        optim/                    optimizer state by parameter name, one shard per rank
                                  (torch.distributed.checkpoint)
        state.pt                  schedule, counters, objective state, client state (rank 0)
        rng_rank{r}.pt            RNG states of rank r (torch, CUDA, numpy, python)
        complete.json             written last, after every rank finished: step, world size,
                                  the size of every file of the tag
    latest                        name of the newest complete tag (atomic rename)

A save is written under `step00000100.partial/`; once every rank's files are on disk, rank 0
writes complete.json into it, renames the folder to its tag and only then moves `latest`. A
crash at any point leaves the previous tag as the newest complete one. Before a tag is trusted
its files are checked against the sizes in complete.json (a truncated or missing file, e.g.
after a disk filled up or a copy was cut short, makes it fall back to the tag before).

Client state holds the step, the config and every rank's data position; complete.json also
holds the run's config and global batch (readable without unpickling, checked before a resume
starts any process group). Weights and optimizer state are recorded by parameter name, so a tag
resumes on any world size and any ZeRO stage. Every .pt file loads with `weights_only=True`
(tensors and plain containers, nothing executed); the optimizer state's metadata is checked for
anything beyond its own classes before it is read.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from train import fault_injection
from train.distributed import barrier

log = logging.getLogger("checkpoint")
COMPLETE = "complete.json"
LATEST = "latest"
TAG_RE = re.compile(r"^step(\d{8})$")
PARTIAL = ".partial"  # suffix of a tag being written


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_gauss": (int(np_state[3]), float(np_state[4])),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
                         *state["numpy_gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(engine, root: Path, step: int, client_state: dict, rank: int, world: int, meta: dict, keep: int = 0,
         pinned: bool = False) -> Path:
    """Collective: every rank calls it. `meta` (JSON) goes into complete.json; afterwards only the
    newest `keep` complete tags remain (0 = keep all), besides pinned ones (run.keep_every_epochs),
    which are never deleted. Returns the tag directory."""
    tag = tag_for(step)
    partial = root / f"{tag}{PARTIAL}"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save of this step
        partial.mkdir(parents=True)
    barrier()
    engine.save(partial, client_state)
    torch.save(rng_state(), partial / f"rng_rank{rank}.pt")
    fault_injection.at("checkpoint_write", step)
    barrier()  # every rank's files are on disk before the tag is declared complete
    if rank == 0:
        files = {str(f.relative_to(partial)): f.stat().st_size for f in sorted(partial.rglob("*")) if f.is_file()}
        _write_atomic(partial / COMPLETE, json.dumps({"step": step, "world_size": world, **meta, "files": files,
                                                      "pinned": pinned}, indent=1))
        if (root / tag).exists():  # an earlier save of the same step (a rerun from an older tag)
            shutil.rmtree(root / tag)
        os.replace(partial, root / tag)
        _write_atomic(root / LATEST, tag)
        if keep > 0:
            prune(root, keep)
    barrier()
    return root / tag


def is_pinned(tag_dir: Path) -> bool:
    """A complete tag saved to be kept (run.keep_every_epochs): pruning never deletes it."""
    return bool(json.loads((tag_dir / COMPLETE).read_text()).get("pinned", False))


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete unpinned tags (and any older incomplete or partial
    ones); pinned tags stay and do not count toward `keep`."""
    tags = sorted(p for p in root.glob("step*") if TAG_RE.match(p.name.removesuffix(PARTIAL)))
    complete = [p for p in tags if TAG_RE.match(p.name) and is_complete(p)]
    pinned = {p for p in complete if is_pinned(p)}
    unpinned = [p for p in complete if p not in pinned]
    if len(unpinned) <= keep:
        return
    oldest_kept = unpinned[-keep].name
    for p in tags:
        if p.name.removesuffix(PARTIAL) < oldest_kept and p not in pinned:
            shutil.rmtree(p, ignore_errors=True)


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / COMPLETE).is_file()


def check_files(tag_dir: Path) -> str | None:
    """None if the tag is complete and every file listed in complete.json has its recorded size;
    else what is wrong. (Tags written before sizes were recorded are checked for completeness only.)"""
    try:
        meta = json.loads((tag_dir / COMPLETE).read_text())
    except FileNotFoundError:
        return f"{tag_dir.name} has no {COMPLETE} (its save did not finish)"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"{tag_dir / COMPLETE} is not readable JSON"
    for name, size in meta.get("files", {}).items():
        f = tag_dir / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} bytes, {size} were written"
    return None


def latest_complete(root: Path) -> Path | None:
    """The newest tag that passes `check_files`: the one `latest` names, else (newest first) the
    others, each one passed over with a warning saying why. None if there is none."""
    tags = sorted((p for p in root.glob("step*") if TAG_RE.match(p.name) and is_complete(p)), reverse=True)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in tags:
            tags.remove(named)
            tags.insert(0, named)
    for tag_dir in tags:
        problem = check_files(tag_dir)
        if problem is None:
            return tag_dir
        log.warning("not resuming from %s: %s", tag_dir, problem)
    return None


def find_resume(resume: str, output_dir: Path) -> Path | None:
    """'' -> None; 'auto' -> latest complete tag under output_dir (None on a fresh run);
    a path -> that tag (or the latest complete tag of that run folder / checkpoints folder)."""
    if not resume:
        return None
    if resume == "auto":
        return latest_complete(output_dir / "checkpoints")
    path = Path(resume)
    for candidate in (path, path / "checkpoints"):
        if is_complete(candidate):
            if (problem := check_files(candidate)) is not None:
                raise FileNotFoundError(f"--resume {resume!r}: {problem}; resume from an earlier tag")
            return candidate
        if candidate.is_dir() and (found := latest_complete(candidate)) is not None:
            return found
    raise FileNotFoundError(f"--resume {resume!r}: no complete checkpoint there (a tag folder with {COMPLETE})")


def read_meta(tag_dir: Path) -> dict:
    """complete.json: step, world size, ZeRO stage, the run's config, the encoder's timm kwargs."""
    return json.loads((tag_dir / COMPLETE).read_text())


def verify_safe(tag_dir: Path) -> None:
    """Refuse a checkpoint whose pickles name any global beyond tensors and plain containers (a
    scan of the pickle opcodes, nothing executed), before any process group starts; the loads
    use weights_only=True as well."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    from train.engine.state_files import OPTIM_DIR, check_dcp_metadata, check_layout

    check_layout(tag_dir)
    for f in sorted(tag_dir.glob("*.pt")):
        unexpected = set(get_unsafe_globals_in_checkpoint(f))
        if unexpected:
            raise ValueError(f"{f} would unpickle {sorted(unexpected)}; refusing to load it (not a checkpoint "
                             f"written by this code, or tampered with)")
    check_dcp_metadata(tag_dir / OPTIM_DIR)


def reseed(seed: int, rank: int, step: int) -> None:
    """Fresh per-rank RNG streams for a run continued on another world size (the old ranks'
    streams do not map onto the new ranks): a function of (seed, rank, step)."""
    s = int(np.random.SeedSequence((seed, rank, step)).generate_state(1, dtype=np.uint64)[0] & (2**63 - 1))
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


def load(engine, tag_dir: Path, rank: int, world: int, seed: int) -> dict:
    """Restore engine state and RNG; returns the client state. On the world size of the checkpoint
    everything continues exactly (this rank's RNG too). On another world size (the caller checked
    that the global batch is the same) weights, optimizer moments, schedule and step carry over and
    the RNG streams start afresh from (seed, rank, step)."""
    meta = read_meta(tag_dir)
    client = engine.load(tag_dir)  # every file read with weights_only=True (the start scanned them: verify_safe)
    if meta["world_size"] == world:
        set_rng_state(torch.load(tag_dir / f"rng_rank{rank}.pt", weights_only=True))
    else:
        reseed(seed, rank, client["step"])
    return client
