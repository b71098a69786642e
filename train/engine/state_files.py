"""The engine's files in a checkpoint tag, the same from every engine, world size and ZeRO stage:

    model.safetensors   the objective's tensors by name: fp32 master weights of the trained
                        parameters, frozen tables and buffers as the module holds them. Rank 0
                        writes it one tensor at a time (a sharded weight is gathered alone, written,
                        freed), so no rank ever holds the whole model; safetensors and timm read it.
    optim/              the optimizer state by parameter name (`<name>/exp_avg`, ...), written by
                        torch.distributed.checkpoint: every rank writes its own shard, and a load
                        reads only the pieces the loading rank holds, whatever the saving layout.
    state.pt            rank 0: schedule, step count, skip counters, fp16 scale, the objectives'
                        non-tensor state (`_extra_state`), the client state (step, data positions)

Loading: every rank reads the rows of each weight it holds (a safetensors slice: a sharded rank
reads its shard only), then its optimizer pieces. A tag of the earlier single-file layout
(model.pt with the weights + optim_rank*.pt by flat range) is refused with the command that
converts it (train/convert_checkpoint.py).

Before a load, every file it will read is checked without executing anything (`read_contents`,
through train/engine/tag_reader.py): the safetensors header against the file
(model/weights_reader.py, the reader of every weights file), state.pt's pickle scanned for
globals and then loaded with weights_only=True, the optimizer
state's `.metadata` unpickled with an exact allowlist of the classes DCP writes there (and then
handed to DCP, which would otherwise `pickle.load` it), and each shard holding the byte ranges
that metadata names. The bytes of the tensors are not validated here (checkpoint.py compares each
file's crc32 with the one recorded when it was written).
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from data.cli import one_line
from model.weights_reader import safetensors_header
from train.engine.tag_reader import CheckedMetadataReader, check_optimizer_shards, read_dcp_metadata, read_state

WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "state.pt"
OPTIM_DIR = "optim"
LEGACY_FILE = "model.pt"  # the earlier layout's weights and state
EXTRA_STATE = "_extra_state"
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


class LegacyCheckpointError(ValueError):
    """A tag of the earlier layout: convert it first."""


def convert_command(tag_dir: Path) -> str:
    return f"python -m train.convert_checkpoint {tag_dir}"


def check_layout(tag_dir: Path) -> None:
    """Refuse a tag of the earlier layout, naming the command that converts it."""
    if (tag_dir / LEGACY_FILE).is_file() and not (tag_dir / WEIGHTS_FILE).is_file():
        raise LegacyCheckpointError(f"{tag_dir} holds a checkpoint of the earlier layout (model.pt + optim_rank*.pt); "
                                    f"convert it once with `{convert_command(tag_dir)}`, then resume")


# --- weights: one tensor at a time ------------------------------------------------------------
def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (a collective every rank joins), else the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _naming(error: OSError, path: Path) -> OSError:
    """`error` with the file it happened on (the OSError of a write does not say)."""
    if error.filename is None:
        error.filename = str(path)
    return error


class _SyncedWriter:
    """A file written piece by piece between collectives. The first OSError (a full disk, a quota)
    is kept and the later pieces are skipped, so the caller goes on joining its collectives;
    `close` flushes and fsyncs what was written, then raises that error."""

    def __init__(self, path: Path):
        self.path, self.file, self.error = path, None, None
        try:
            self.file = open(path, "wb")
        except OSError as e:
            self.error = e

    def write(self, data: bytes) -> None:
        if self.error is None:
            try:
                self.file.write(data)
            except OSError as e:
                self.error = _naming(e, self.path)

    def close(self) -> None:
        if self.file is not None:
            try:
                if self.error is None:
                    self.file.flush()
                    os.fsync(self.file.fileno())
                self.file.close()  # after a failed write this flushes the rest again, and fails again
            except OSError as e:
                self.error = self.error or _naming(e, self.path)
        if self.error is not None:
            raise self.error


def write_weights(path: Path, tensors: dict[str, torch.Tensor], write: bool) -> None:
    """safetensors' layout (an 8-byte header length, a JSON header of names, dtypes, shapes and byte
    ranges, then the bytes), written tensor by tensor: the header needs only shapes and dtypes.
    Collective when any tensor is a DTensor; only the rank with `write` writes, and fsyncs the file.
    A failed write (a full disk) stops the writing, not the gathering: its OSError is raised once
    this rank has joined every gather, so no other rank is left waiting in one."""
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data start 8-byte aligned, as safetensors writes them
    writer = _SyncedWriter(path) if write else None
    if writer is not None:
        writer.write(struct.pack("<Q", len(text)) + text)
    for t in tensors.values():
        whole = _whole(t)
        if writer is not None:
            writer.write(whole.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        del whole
    if writer is not None:
        writer.close()


def _rows(shape: torch.Size, rank: int, world: int) -> tuple[int, int]:
    """The dim-0 rows `rank` holds of a parameter sharded by FSDP2 (torch.chunk's split)."""
    n = shape[0]
    per = -(-n // world)
    return min(n, rank * per), min(n, (rank + 1) * per)


def read_into(f, name: str, dst: torch.Tensor) -> None:
    """`dst` (a tensor, or a DTensor sharded on dim 0: its local rows) from the open safetensors file."""
    if hasattr(dst, "to_local"):
        local = dst.to_local()
        a, b = _rows(dst.shape, dst.device_mesh.get_local_rank(), dst.device_mesh.size())
        if a < b:
            local.copy_(f.get_slice(name)[a:b])
        return
    dst.copy_(f.get_tensor(name))


# --- optimizer state --------------------------------------------------------------------------
def optimizer_state(engine) -> dict[str, torch.Tensor]:
    """{"<parameter name>/<key>": tensor}: every tensor of the optimizer's state, by parameter."""
    out = {}
    for name, t in engine.master_weights().items():
        for key, value in engine.optimizer.state[t].items():
            out[f"{name}/{key}"] = value
    return out


# --- writing files ----------------------------------------------------------------------------
def save_synced(obj, path: Path) -> None:
    """torch.save through a Python file (a full disk then raises OSError naming the cause, where
    torch's own file writer raises a RuntimeError), flushed and fsynced."""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _naming(e, path)


def sync_folder(path: Path) -> None:
    """fsync a folder: the names created, renamed or deleted in it reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class TagContents:
    """What a tag's engine files hold, from model.safetensors' header and state.pt."""
    weights: dict[str, list[int]]  # tensor name -> shape
    extra: list[str]  # the objectives' non-tensor states
    optimizer: str  # the optimizer's class name
    client: dict  # what the caller saved with the engine's files


def read_contents(tag_dir: Path) -> TagContents:
    """Every engine file a load reads, checked without executing anything and without reading the
    tensors' bytes: model.safetensors' header (model/weights_reader.py), state.pt (`read_state`), the
    optimizer state's `.metadata` (`read_dcp_metadata`) and shards (`check_optimizer_shards`), and
    that the optimizer state belongs to the weights. ValueError names the file and what is wrong."""
    check_layout(tag_dir)
    for name in (WEIGHTS_FILE, STATE_FILE):
        if not (tag_dir / name).is_file():
            raise ValueError(f"{tag_dir / name} is missing, or not a regular file")
    weights = {name: entry["shape"] for name, entry in safetensors_header(tag_dir / WEIGHTS_FILE).items()}
    state = read_state(tag_dir / STATE_FILE)
    metadata = read_dcp_metadata(tag_dir / OPTIM_DIR)
    check_optimizer_shards(tag_dir / OPTIM_DIR, metadata)
    strays = sorted({fqn.rpartition("/")[0] for fqn in metadata.state_dict_metadata} - set(weights))
    if strays:
        raise ValueError(f"{tag_dir / OPTIM_DIR} holds optimizer state of {strays[:3]}, which {WEIGHTS_FILE} does not "
                         f"hold; refused")
    return TagContents(weights, sorted(state["extra"]), state["optimizer"], state["client"])


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that it assumes one process when no process group exists: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# --- the tag ----------------------------------------------------------------------------------
def module_tensors(engine) -> tuple[dict[str, torch.Tensor], dict]:
    """(every tensor of the objective's state by name, the trained ones as fp32 master weights;
    the non-tensor extra states)."""
    masters = engine.master_weights()
    tensors, extra = {}, {}
    for name, value in engine.module.state_dict(keep_vars=True).items():
        if name in masters:
            tensors[name] = masters[name]
        elif isinstance(value, torch.Tensor):
            tensors[name] = value
        else:
            extra[name] = value
    return tensors, extra


def save(engine, tag_dir: Path, client: dict) -> None:
    """Collective: every rank calls it with the same tag folder. Every file is fsynced: ours here,
    DCP's shards and `.metadata` by its FileSystemWriter (sync_files). A write that fails on one
    rank (a full disk) is raised there only after every collective of the save has run (DCP raises
    a write that failed on any rank on every rank), so no rank is left waiting in one."""
    tensors, extra = module_tensors(engine)
    failure: BaseException | None = None
    try:
        write_weights(tag_dir / WEIGHTS_FILE, {k: v.detach() for k, v in tensors.items()}, engine.rank == 0)
    except OSError as e:
        failure = e
    try:
        with single_process_quiet():
            dcp.save(optimizer_state(engine), storage_writer=dcp.FileSystemWriter(tag_dir / OPTIM_DIR, sync_files=True),
                     no_dist=not dist.is_initialized())
    except CheckpointException as e:
        failure = failure or e
    if failure is not None:
        raise failure
    sync_folder(tag_dir / OPTIM_DIR)  # DCP renames its .metadata into place and leaves the folder unsynced
    if engine.rank == 0:
        save_synced({"engine": engine.counters(), "extra": extra, "optimizer": type(engine.optimizer).__name__,
                     "client": client}, tag_dir / STATE_FILE)


def load(engine, tag_dir: Path) -> dict:
    """Weights, objective state, optimizer state and counters of a tag that `read_contents` passed;
    the files are read the same safe way again (a file could have changed since)."""
    from safetensors import safe_open

    check_layout(tag_dir)
    state = read_state(tag_dir / STATE_FILE)
    kind = type(engine.optimizer).__name__
    if state["optimizer"] != kind:
        raise ValueError(f"{tag_dir} holds {state['optimizer']} state; this run's optimizer is {kind}")
    tensors, extra = module_tensors(engine)
    with safe_open(tag_dir / WEIGHTS_FILE, framework="pt") as f:
        saved = set(f.keys())
        missing, unexpected = sorted(set(tensors) - saved), sorted(saved - set(tensors))
        if missing or unexpected or set(extra) != set(state["extra"]):
            raise ValueError(f"{tag_dir / WEIGHTS_FILE} does not fit this objective: missing {missing[:8]}, unexpected "
                             f"{unexpected[:8]}, objective state {sorted(state['extra'])} for {sorted(extra)}")
        with torch.no_grad():
            for name, dst in tensors.items():
                read_into(f, name, dst.data if not hasattr(dst, "to_local") else dst)
    if extra:
        engine.module.load_state_dict(state["extra"], strict=False)
    reader = CheckedMetadataReader(tag_dir / OPTIM_DIR)
    try:
        with single_process_quiet():
            dcp.load(optimizer_state(engine), storage_reader=reader, no_dist=not dist.is_initialized())
    except CheckpointException as e:  # a BaseException, raised on every rank for a read that failed on any
        if reader.refusal is not None:
            raise reader.refusal from None
        rank, (failure, _) = next(iter(e.failures.items()))
        raise ValueError(f"{tag_dir / OPTIM_DIR} could not be read (rank {rank}: {type(failure).__name__}: "
                         f"{one_line(str(failure))})") from None
    engine.weights_loaded()
    engine.load_counters(state["engine"])
    return state["client"]


def read_module_state(tag_dir: Path) -> dict:
    """The objective's whole state dict of a tag (its tensors and the objectives' non-tensor
    `_extra_state`, e.g. MLO-MAE's masking network), as `load_state_dict` takes it, on the CPU."""
    extra = torch.load(tag_dir / STATE_FILE, map_location="cpu", weights_only=True)["extra"]
    return {**read_tensors(tag_dir), **extra}


def read_tensors(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The objective's tensors of a tag by name (fp32 weights, frozen tables, buffers), on the CPU:
    what export and continued pretraining read."""
    from safetensors.torch import load_file

    check_layout(tag_dir)
    return load_file(tag_dir / WEIGHTS_FILE)
