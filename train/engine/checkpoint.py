"""Checkpoints: the engine's files (train/engine/state_files.py), each rank's RNG, and what makes a
tag trustworthy.

Layout of `<output_dir>/checkpoints/`:
    step00000100/                 one tag per save
        model.safetensors         the objective's tensors by name: fp32 weights, frozen tables,
                                  buffers (rank 0, one tensor at a time)
        optim/                    optimizer state by parameter name, one shard per rank
                                  (torch.distributed.checkpoint)
        state.pt                  schedule, counters, objective state, client state (rank 0)
        rng_rank{r}.pt            RNG states of rank r (torch, CUDA, numpy, python), and the
                                  objective's state of rank r where it has one (its own data)
        complete.json             written last, after every rank finished: step, world size,
                                  the size and crc32 of every file of the tag
    latest                        name of the newest complete tag (atomic rename)

A save is written under `step00000100.partial/`; once every rank's files are on disk (each file
and folder fsynced), rank 0 writes complete.json into it, renames the folder to its tag and only
then moves `latest`, syncing the checkpoints folder after each. A crash at any point leaves the
previous tag as the newest complete one. A write that fails on any rank (a full disk) stops the run
on every rank with one CheckpointWriteError (exit 3): the ranks agree on it where they would have
waited in a barrier, the partial folder is removed and `latest` keeps naming the previous tag.

Before a tag is trusted (`tag_problem`) its files are checked against the sizes and crc32s in
complete.json (a truncated, missing or garbled file, e.g. after a disk filled up or a copy was cut
short, makes `--resume auto` fall back to the tag before), and every file a resume reads is
checked without executing anything (`verify_readable`): model.safetensors' header, state.pt and
the RNG files (their pickles scanned, then loaded with weights_only=True), the optimizer state's
metadata (an exact allowlist; DCP is handed the object read that way) and shards.

Client state holds the step, the config and every rank's data position; complete.json also
holds the run's config and global batch (readable without unpickling, checked before a resume
starts any process group). Weights and optimizer state are recorded by parameter name, so a tag
resumes on any world size and any ZeRO stage.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import zlib
from pathlib import Path, PurePath
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from data.cli import one_line
from data.folders import is_file_named
from train.engine import fault_injection
from train.engine.distributed import all_gather_object, barrier
from train.engine.errors import CheckpointWriteError
from train.engine.state_files import (
    OPTIM_DIR,
    LegacyCheckpointError,
    TagContents,
    check_layout,
    read_contents,
    save_synced,
    sync_folder,
)
from train.engine.tag_reader import load_pickle_file, read_dcp_metadata

log = logging.getLogger("checkpoint")
COMPLETE = "complete.json"
LATEST = "latest"
TAG_RE = re.compile(r"^step(\d{8})$")
PARTIAL = ".partial"  # suffix of a tag being written
MAX_COMPLETE_BYTES = 16 << 20  # complete.json holds a config and a file list: a few kB to a few hundred
RNG_KEYS = ("torch", "numpy_keys", "numpy_pos", "numpy_gauss", "python")


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


def rank_file(objective) -> dict:
    """What a rank's own file of a checkpoint holds: its RNG states, and under "objective" the
    objective's state of this rank where it has one (Objective.get_rank_state)."""
    state = rng_state()
    own = getattr(objective, "get_rank_state", dict)()
    if any(own.values()):
        state["objective"] = own
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
                         *state["numpy_gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file, fsynced before it replaces `path`; a failed write
    leaves `path` as it was and no temporary file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def crc32(path: Path) -> int:
    """The crc32 of a file's bytes (zlib's: several GB/s per core), read in 16 MiB pieces."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def save(engine, root: Path, step: int, client_state: dict, rank: int, world: int, meta: dict, keep: int = 0,
         pinned: bool = False) -> Path:
    """Collective: every rank calls it. `meta` (JSON) goes into complete.json; afterwards only the
    newest `keep` complete tags remain (0 = keep all), besides pinned ones (run.keep_every_epochs),
    which are never deleted. Returns the tag directory. A write that fails on any rank raises the
    same CheckpointWriteError on every rank, the previous tag still the latest."""
    tag = tag_for(step)
    partial = root / f"{tag}{PARTIAL}"
    failure = None
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save of this step
        try:
            partial.mkdir(parents=True)
        except OSError as e:
            failure = e
    _agree(failure, step, root, partial, rank)
    try:
        engine.save(partial, client_state)
        save_synced(rank_file(engine.module), partial / f"rng_rank{rank}.pt")
        sync_folder(partial)
        failure = None
    except (OSError, CheckpointException) as e:  # DCP's wraps the failure of any rank, on every rank
        failure = e
    fault_injection.at("checkpoint_write", step)
    _agree(failure, step, root, partial, rank)  # every rank's files are on disk before the tag is declared complete
    failure = None
    if rank == 0:
        try:
            _declare_complete(partial, root, tag, {"step": step, "world_size": world, **meta, "pinned": pinned})
            if keep > 0:
                prune(root, keep, newest=tag)
        except OSError as e:
            failure = e
    _agree(failure, step, root, partial, rank)
    return root / tag


def _declare_complete(partial: Path, root: Path, tag: str, meta: dict) -> None:
    """Rank 0, once every rank's files are on disk: complete.json (every file's size and crc32), the
    folder renamed to its tag, then `latest` moved; each folder synced after its change."""
    files = [f for f in sorted(partial.rglob("*")) if f.is_file()]
    meta = {**meta, "files": {str(f.relative_to(partial)): f.stat().st_size for f in files},
            "crc32": {str(f.relative_to(partial)): crc32(f) for f in files}}
    _write_atomic(partial / COMPLETE, json.dumps(meta, indent=1))
    sync_folder(partial)
    if (root / tag).exists():  # an earlier save of the same step (a rerun from an older tag)
        shutil.rmtree(root / tag)
    os.replace(partial, root / tag)
    sync_folder(root)
    _write_atomic(root / LATEST, tag)
    sync_folder(root)


def _agree(failure: BaseException | None, step: int, root: Path, partial: Path, rank: int) -> None:
    """Where a barrier would stand: every rank learns whether any rank's part of the save failed (one
    all-gather). On a failure rank 0 removes the partial folder, and every rank raises the same
    CheckpointWriteError naming the first failing rank's cause and the free space it saw (one
    reading for every rank: a file system others write to would give each rank another)."""
    report = None if failure is None else (_cause(failure), shutil.disk_usage(root).free)
    reports = all_gather_object(report) if dist.is_initialized() else [report]
    failed = [(r, seen) for r, seen in enumerate(reports) if seen is not None]
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    barrier()  # the folder is gone before any rank exits
    who, (cause, free_bytes) = failed[0]
    where = f"rank {who}: " if len(reports) > 1 else ""
    latest = root / LATEST
    kept = (f"the checkpoint {latest.read_text().strip()} is kept as the latest" if latest.is_file()
            else "this run has no earlier checkpoint")
    free = free_bytes / 2**20
    raise CheckpointWriteError(f"the checkpoint of step {step} could not be written ({where}{cause}; {free:.1f} MiB "
                               f"free under {root}); {kept}; once that file system takes the writes again, continue "
                               f"with the same command and --resume auto")


def _cause(failure: BaseException) -> str:
    """One line on why a write failed: the OS's reason and the file where known (DCP wraps the
    failing rank's exception, and names no file)."""
    where = ""
    if isinstance(failure, CheckpointException):
        failure, where = next(iter(failure.failures.values()))[0], f" in the optimizer state ({OPTIM_DIR}/)"
    if isinstance(failure, OSError) and failure.strerror:
        return f"{failure.strerror}: {failure.filename}" if failure.filename else f"{failure.strerror}{where}"
    return f"{type(failure).__name__}{where}: {one_line(str(failure))}"


def is_pinned(tag_dir: Path) -> bool:
    """A complete tag saved to be kept (run.keep_every_epochs): pruning never deletes it, nor a tag
    whose complete.json cannot be read (it cannot say)."""
    try:
        return bool(read_meta(tag_dir).get("pinned", False))
    except (OSError, ValueError, AttributeError):
        return True


def prune(root: Path, keep: int, newest: str | None = None) -> None:
    """Delete all but the newest `keep` complete unpinned tags up to `newest` (the tag just saved;
    None: the newest there is), and any older incomplete or partial ones; pinned tags stay and do
    not count toward `keep`. Tags after `newest` are the rest of a history this run left when it
    resumed from an older tag: neither counted nor deleted (the run's own saves replace them as it
    reaches their steps), so the tag just saved, which `latest` names, is never among those deleted."""
    tags = sorted(p for p in root.glob("step*") if TAG_RE.match(p.name.removesuffix(PARTIAL)))
    complete = [p for p in tags if TAG_RE.match(p.name) and is_complete(p) and (newest is None or p.name <= newest)]
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


def _meta_problem(meta) -> str:
    """What in a complete.json is not what this code writes ('' if nothing): a JSON object with the
    step, and where present the world size, the config, and the files as relative names with their
    sizes and crc32s."""
    if not isinstance(meta, dict):
        return "is not a JSON object"
    if type(meta.get("step")) is not int or meta["step"] < 0:
        return f"has step {meta.get('step')!r}, not a non-negative integer"
    if "world_size" in meta and (type(meta["world_size"]) is not int or meta["world_size"] < 1):
        return f"has world_size {meta['world_size']!r}, not a positive integer"
    if "config" in meta and not isinstance(meta["config"], dict):
        return "has a config that is not a JSON object"
    files, sums = meta.get("files", {}), meta.get("crc32", {})
    if not isinstance(files, dict) or not isinstance(sums, dict):
        return "lists its files in something other than a JSON object"
    for name, size in files.items():
        if PurePath(name).is_absolute() or ".." in PurePath(name).parts or type(size) is not int or size < 0:
            return f"lists {name!r} of {size!r} bytes, not a file of its folder with a size"
    if any(name not in files or type(crc) is not int for name, crc in sums.items()):
        return "has a crc32 that is no integer of a listed file"
    return ""


def check_files(tag_dir: Path) -> str | None:
    """None if the tag is complete, its complete.json is one this code writes, and every file it
    lists has its recorded size; else what is wrong. (Tags written before sizes were recorded are
    checked for completeness only.)"""
    path = tag_dir / COMPLETE
    if not path.is_file():
        return f"{tag_dir.name} has no {COMPLETE} (its save did not finish)"
    if path.stat().st_size > MAX_COMPLETE_BYTES:
        return f"{path} has {path.stat().st_size} bytes: not a {COMPLETE} this code wrote"
    try:
        meta = read_meta(tag_dir)
    except (ValueError, UnicodeDecodeError):  # read_meta's ValueError covers JSON nested too deep
        return f"{path} is not readable JSON"
    problem = _meta_problem(meta)
    if problem:
        return f"{path} {problem}"
    for name, size in meta.get("files", {}).items():
        f = tag_dir / name
        if not is_file_named(f):
            return f"{printable(f)} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} bytes, {size} were written"
    return None


def printable(path: Path) -> str:
    """`path` as a message shows it: a name from a file someone else wrote may hold what no UTF-8
    text can (a lone surrogate, "\ud800"), shown escaped so that the message can be written anywhere."""
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


def tag_problem(tag_dir: Path) -> str | None:
    """None if a resume can read the tag; else what is wrong, naming the file: `check_files`, then
    every file's crc32 against the one recorded at save (reads every byte: a few seconds for a
    ViT-H tag), then `verify_readable`. A tag of the earlier layout passes here (the resume refuses
    it naming the conversion); one written before sizes were recorded is checked for safety only."""
    problem = check_files(tag_dir)
    if problem is not None:
        return problem
    meta = read_meta(tag_dir)
    for name, recorded in meta.get("crc32", {}).items():
        if crc32(tag_dir / name) != recorded:
            return f"{tag_dir / name} does not hold the bytes written (its crc32 differs from the one recorded)"
    try:
        check_layout(tag_dir)
        if "files" in meta:
            verify_readable(tag_dir)
        else:
            verify_safe(tag_dir)
    except LegacyCheckpointError:
        return None
    except ValueError as e:
        return str(e)
    return None


def latest_complete(root: Path, check: Callable[[Path], str | None] = tag_problem) -> Path | None:
    """The newest tag that passes `check`: the one `latest` names (the last save), else the older
    ones newest first, then those after it (left from a history the run turned away from when it
    resumed from an older tag, or saved by a run stopped before it moved `latest`), each one passed
    over with a warning saying why. None if no tag is complete; FileNotFoundError naming every
    complete tag and why it fails when none passes."""
    tags = sorted((p for p in root.glob("step*") if TAG_RE.match(p.name) and is_complete(p)), reverse=True)
    pointer = root / LATEST
    if pointer.is_file():
        try:
            named = root / pointer.read_text().strip()
        except UnicodeDecodeError:  # not a name this code wrote: the tags' own order decides
            named = None
        if named in tags:
            tags = [named, *(t for t in tags if t.name < named.name), *(t for t in tags if t.name > named.name)]
        elif named is not None:
            log.warning("%s names %s, which is not a complete checkpoint there: taking the newest that is", pointer,
                        named.name)
    problems = {}
    for tag_dir in tags:
        problem = check(tag_dir)
        if problem is None:
            for passed, why in problems.items():  # said only when a tag is taken: a refusal is one line
                log.warning("not resuming from %s: %s", passed, why)
            return tag_dir
        problems[tag_dir] = problem
    if problems:
        raise FileNotFoundError(f"no checkpoint in {root} can be used (" + "; ".join(
            f"{tag.name}: {why.replace(f'{tag}/', '')}" for tag, why in problems.items()) + ")")
    return None


RESUME_TAKES = ("--resume takes auto (the latest complete checkpoint in --output_dir; a fresh start when it has "
                "none), a run folder or its checkpoints/ folder (their latest complete checkpoint), or one checkpoint "
                "tag folder (<run>/checkpoints/step00001000)")


class NoCheckpointThere(FileNotFoundError):
    """A path given as a checkpoint names none: it does not exist, or holds no complete tag."""


def check_resume_exists(resume: str) -> None:
    """NoCheckpointThere when `resume` is a path (not '' or 'auto') that does not exist; a switch's
    word (--resume true) is told that --resume takes a path."""
    if resume in ("", "auto") or Path(resume).exists():
        return
    switch = " (--resume is not a switch)" if resume.lower() in ("true", "false", "yes", "no", "on", "off", "1",
                                                                  "0") else ""
    raise NoCheckpointThere(f"--resume {resume!r}: the path does not exist{switch}")


def find_resume(resume: str, output_dir: Path, check: Callable[[Path], str | None] = tag_problem) -> Path | None:
    """'' -> None; 'auto' -> latest complete tag under output_dir (None on a fresh run);
    a path -> that tag (or the latest complete tag of that run folder / checkpoints folder). Tags are
    judged by `check`; FileNotFoundError says what is wrong with those that fail it
    (NoCheckpointThere: the path does not exist, or holds no complete tag)."""
    if not resume:
        return None
    if resume == "auto":
        try:
            return latest_complete(output_dir / "checkpoints", check)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"--resume auto: {e}; resume an intact copy of one by path (--resume PATH), "
                                    f"start afresh without --resume and with --run.overwrite true (deletes them), "
                                    f"or give another --output_dir") from None
    check_resume_exists(resume)
    path = Path(resume)
    for candidate in (path, path / "checkpoints"):
        if is_complete(candidate):
            if (problem := check(candidate)) is not None:
                raise FileNotFoundError(f"--resume {resume!r}: {problem}; resume from an earlier tag")
            return candidate
        if candidate.is_dir():
            try:
                found = latest_complete(candidate, check)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"--resume {resume!r}: {e}; give an intact tag or another run "
                                        f"folder") from None
            if found is not None:
                return found
    raise NoCheckpointThere(f"--resume {resume!r}: no complete checkpoint there (a tag folder with {COMPLETE})")


def read_meta(tag_dir: Path) -> dict:
    """complete.json: step, world size, ZeRO stage, the run's config, the encoder's timm kwargs.
    ValueError when it is larger or nested deeper than one this code writes."""
    path = tag_dir / COMPLETE
    if path.stat().st_size > MAX_COMPLETE_BYTES:
        raise ValueError(f"{path} has {path.stat().st_size} bytes: not a {COMPLETE} this code wrote")
    try:
        return json.loads(path.read_text())
    except RecursionError:  # json's error for arrays/objects nested past the interpreter's recursion limit
        raise ValueError(f"{path} is nested too deep to be read as JSON: not a {COMPLETE} this code wrote") from None


def verify_safe(tag_dir: Path) -> None:
    """Refuse a checkpoint whose files would run anything when loaded, reading what is there
    without executing it: every .pt file's pickle scanned for globals beyond tensors and plain
    containers, then loaded with weights_only=True; the optimizer state's metadata unpickled with
    its exact allowlist. ValueError names the file."""
    check_layout(tag_dir)
    for f in sorted(tag_dir.glob("*.pt")):
        if f.is_file():  # a FIFO would block the read; a resume reads only regular files (verify_readable)
            load_pickle_file(f)
    if (tag_dir / OPTIM_DIR / ".metadata").is_file():
        read_dcp_metadata(tag_dir / OPTIM_DIR)


def verify_readable(tag_dir: Path) -> TagContents:
    """Every file a resume reads, checked before anything starts and without executing anything:
    the engine's files (`read_contents`), each rank's RNG file, and a client state of the tag's step
    with one data position per rank. Returns what the engine files hold; ValueError names the file
    and what is wrong."""
    meta = read_meta(tag_dir)
    problem = _meta_problem(meta) or ("" if "world_size" in meta else "has no world_size")
    if problem:
        raise ValueError(f"{tag_dir / COMPLETE} {problem}")
    contents = read_contents(tag_dir)
    for rank in range(meta["world_size"]):
        read_rng(tag_dir / f"rng_rank{rank}.pt")
    client = contents.client
    if client.get("step") != meta["step"] or not isinstance(client.get("data"), list) \
            or len(client["data"]) != meta["world_size"]:
        raise ValueError(f"{tag_dir} holds a client state of step {client.get('step')!r} with "
                         f"{len(client.get('data') or [])} data positions; {COMPLETE} says step {meta['step']} on "
                         f"{meta['world_size']} ranks")
    return contents


def read_rng(path: Path) -> dict:
    """A rank's RNG file, loaded as `load_pickle_file` does and checked for the states `set_rng_state` sets."""
    if not path.is_file():
        raise ValueError(f"{path} is missing, or not a regular file")
    state = load_pickle_file(path)
    if not isinstance(state, dict) or any(k not in state for k in RNG_KEYS) \
            or not isinstance(state["torch"], torch.Tensor) or not isinstance(state["numpy_keys"], torch.Tensor) \
            or state["numpy_keys"].numel() != 624 or not isinstance(state["python"], tuple):
        raise ValueError(f"{path} is not a rank's RNG state (torch, numpy, python); refused")
    own = state.get("objective", {})
    if not isinstance(own, dict) or not all(isinstance(k, str) and isinstance(v, list)
                                            and all(isinstance(t, torch.Tensor) for t in v) for k, v in own.items()):
        raise ValueError(f"{path} holds an objective state that is not lists of tensors by name; refused")
    return state


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
    client = engine.load(tag_dir)  # every file read as verify_readable read it before the start
    if meta["world_size"] == world:
        state = read_rng(tag_dir / f"rng_rank{rank}.pt")
        set_rng_state(state)
        if "objective" in state:  # this rank's own micro-batches: they exist on the same ranks only
            engine.module.set_rank_state(state["objective"])
    else:
        reseed(seed, rank, client["step"])
    return client
