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

Before a load, every file it will read is checked without executing anything (`read_contents`):
the safetensors header against the file (model/interop.py, the reader of every weights file),
state.pt's pickle scanned for globals and then loaded with weights_only=True, the optimizer
state's `.metadata` unpickled with an exact allowlist of the classes DCP writes there (and then
handed to DCP, which would otherwise `pickle.load` it), and each shard holding the byte ranges
that metadata names. The bytes of the tensors are not validated here (checkpoint.py compares each
file's crc32 with the one recorded when it was written).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path, PosixPath

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.serialization import get_unsafe_globals_in_checkpoint

from model.weights_reader import safetensors_header

WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "state.pt"
OPTIM_DIR = "optim"
LEGACY_FILE = "model.pt"  # the earlier layout's weights and state
EXTRA_STATE = "_extra_state"
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")  # DCP's file of one rank's optimizer pieces
ZIP_RECORD = b"PK\x03\x04"  # DCP writes each tensor with torch.save: a zip archive starts every piece


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


def _layout_named(name: str) -> torch.layout:
    """What torch.serialization._get_layout returns for the one layout DCP's metadata names (strided
    tensors are all this code saves), from a fixed table rather than a scan of torch's namespace."""
    if name != "torch.strided":
        raise _Refused(f"torch.serialization._get_layout({name!r})")
    return torch.strided


def _memory_format_code(value: int) -> _MEM_FORMAT_ENCODING:
    """DCP's memory-format code of `value`: the enum's lookup by value, without the functional API
    (a second argument creates an enum class) that calling the enum class also offers."""
    if type(value) is not int:
        raise _Refused(f"torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING({value!r})")
    return _MEM_FORMAT_ENCODING(value)


class _Refused(pickle.UnpicklingError):
    """A global, call or persistent id the metadata's allowlist does not hold."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles exactly the globals DCP's `.metadata` of this code's optimizer state names in
    torch 2.14 (every optimizer, fp32 / bf16 runs, ZeRO 0-3 on 1 and 2 ranks), looked up by their
    exact (module, name) pair: no dotted names (protocol 4 would resolve `os.system` under an allowed
    module), no prefixes, no persistent ids. Each global is inert whatever its arguments: dataclass
    constructors that only store their fields, torch.Size, PosixPath (a path object; no file is
    touched), torch.float32, and fixed tables in place of torch's layout lookup and DCP's
    memory-format enum. Copyreg extension codes resolve through `find_class` as well."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", "Metadata"): Metadata,
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"): TensorStorageMetadata,
        ("torch.distributed.checkpoint.metadata", "TensorProperties"): TensorProperties,
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"): ChunkStorageMetadata,
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"): MetadataIndex,
        ("torch.distributed.checkpoint.metadata", "StorageMeta"): StorageMeta,
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _memory_format_code,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("torch.serialization", "_get_layout"): _layout_named,
        ("torch", "Size"): torch.Size,
        ("torch", "float32"): torch.float32,
        ("pathlib", "PosixPath"): PosixPath,
    }

    def find_class(self, module: str, name: str):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid):
        raise _Refused("a persistent id")


def read_dcp_metadata(folder: Path) -> Metadata:
    """The optimizer state's `.metadata`, unpickled with `_MetadataUnpickler` and checked for what
    DCP's loader relies on. torch 2.14 offers no safe reader for it (FileSystemReader.read_metadata
    is a plain pickle.load), so a load hands DCP the object read here (`_CheckedMetadataReader`).
    ValueError names the file and why it is refused."""
    path = folder / ".metadata"
    if not path.is_file():
        raise ValueError(f"{folder} has no .metadata: the optimizer state is incomplete")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except _Refused as e:
        raise ValueError(f"{path} would unpickle {e}; refused: DCP's metadata holds only its own classes (not "
                         f"written by this code, or tampered with)") from None
    except Exception as e:  # whatever a malformed pickle makes the unpickler or the inert constructors raise
        raise ValueError(f"{path} is not DCP metadata ({type(e).__name__}: {_first_line(e)}); refused") from None
    try:
        problem = _metadata_problem(metadata)
    except (AttributeError, TypeError) as e:  # a field missing, or of a type that cannot be compared or hashed
        problem = f"is malformed ({e})"
    if problem:
        raise ValueError(f"{path} {problem}; refused: not written by this code, or tampered with")
    return metadata


def _metadata_problem(md) -> str:
    """What in an unpickled `.metadata` is not what DCP's loader expects of this code's optimizer
    state ('' if nothing): every entry a float32 tensor's, cut into chunks inside its size, each
    chunk stored untransformed in a shard file of this folder."""
    if type(md) is not Metadata:
        return f"holds a {type(md).__name__}, not DCP's Metadata"
    if type(md.state_dict_metadata) is not dict or type(md.storage_data) is not dict:
        return "has no table of entries and their storage"
    for fqn, entry in md.state_dict_metadata.items():
        if type(fqn) is not str:
            return f"has an entry named {fqn!r}, not a parameter's name"
        if type(entry) is not TensorStorageMetadata:  # DCP would torch.load its bytes with weights_only=False
            return f"has an entry {fqn!r} that is not a tensor's"
        problem = _tensor_entry_problem(entry)
        if problem:
            return f"has an entry {fqn!r} that {problem}"
        for chunk in entry.chunks:
            if MetadataIndex(fqn, chunk.offsets) not in md.storage_data:
                return f"stores no bytes for a piece of {fqn!r}"
    for index, info in md.storage_data.items():
        if type(index) is not MetadataIndex or index.fqn not in md.state_dict_metadata:
            return f"stores bytes of {index!r}, which is no entry of it"
        if type(info) is not _StorageInfo or type(info.relative_path) is not str \
                or not SHARD_NAME.fullmatch(info.relative_path):
            return f"stores {index.fqn!r} in {getattr(info, 'relative_path', info)!r}, not a shard file of its folder"
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length <= 0:
            return f"stores {index.fqn!r} at bytes {info.offset!r} + {info.length!r}"
        if info.transform_descriptors is not None:  # a stream transform (decompression) this code never writes
            return f"stores {index.fqn!r} through transforms {info.transform_descriptors!r}"
    return ""


def _tensor_entry_problem(entry: TensorStorageMetadata) -> str:
    """What is wrong with one tensor's entry of the metadata ('' if nothing)."""
    props, size = entry.properties, entry.size
    if type(props) is not TensorProperties or props.dtype is not torch.float32:
        return "is not a float32 tensor's"
    if type(size) is not torch.Size or type(entry.chunks) is not list or not entry.chunks:
        return "has no size and chunks"
    for chunk in entry.chunks:
        if type(chunk) is not ChunkStorageMetadata or type(chunk.offsets) is not torch.Size \
                or type(chunk.sizes) is not torch.Size or len(chunk.offsets) != len(size) \
                or len(chunk.sizes) != len(size):
            return f"has a chunk {chunk!r} that is not one of a tensor of size {list(size)}"
        if any(o < 0 or o + n > dim for o, n, dim in zip(chunk.offsets, chunk.sizes, size)):
            return f"has a chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} outside its size {list(size)}"
    return ""


class _CheckedMetadataReader(dcp.FileSystemReader):
    """DCP's file reader, whose metadata is the one `read_dcp_metadata` unpickled and checked:
    DCP's own read_metadata would pickle.load the file. It takes no rank argument, so DCP does not
    fall back to reading a rank's own `__<rank>.metadata` (with pickle) when this one refuses."""

    def read_metadata(self) -> Metadata:
        metadata = read_dcp_metadata(Path(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as the base class's read_metadata sets it
        return metadata


def check_optimizer_shards(folder: Path, metadata: Metadata) -> None:
    """Every shard file the metadata names is in `folder`, holds each piece's byte range, and a
    piece starts where the metadata says (DCP writes each tensor with torch.save: a zip archive).
    Only those few bytes are read. ValueError names the file and what is missing."""
    pieces: dict[str, list[_StorageInfo]] = {}
    for info in metadata.storage_data.values():
        pieces.setdefault(info.relative_path, []).append(info)
    for name, infos in sorted(pieces.items()):
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{path} is missing; the optimizer state's metadata stores {len(infos)} tensors there")
        size = path.stat().st_size
        with open(path, "rb") as f:
            for info in sorted(infos, key=lambda i: i.offset):
                if info.offset + info.length > size:
                    raise ValueError(f"{path} has {size} bytes; the optimizer state's metadata reads bytes "
                                     f"{info.offset} to {info.offset + info.length}")
                f.seek(info.offset)
                if f.read(len(ZIP_RECORD)) != ZIP_RECORD:
                    raise ValueError(f"{path} holds no tensor at byte {info.offset}, where the optimizer state's "
                                     f"metadata says one starts")


# --- state.pt and other torch.save files ------------------------------------------------------
def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _weights_only_reason(e: BaseException) -> str:
    """The line of torch's weights-only refusal that says what it refused (its first lines are advice)."""
    _, found, after = str(e).partition("WeightsUnpickler error:")
    return _first_line(Exception(after)) if found else _first_line(e)


def load_pickle_file(path: Path):
    """A torch.save file of tensors and plain containers: the globals its pickle names are scanned
    first (opcodes read, nothing executed), then it is loaded with weights_only=True. ValueError
    names the file when either refuses it."""
    try:
        unexpected = get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # not torch.save's zip archive, or opcodes the scan does not know
        raise ValueError(f"{path} is not a torch.save archive of tensors and plain containers ({_first_line(e)}); "
                         f"refused") from None
    if unexpected:
        raise ValueError(f"{path} would unpickle {sorted(unexpected)}; refused: not a file written by this code, or "
                         f"tampered with")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # whatever the weights-only unpickler refuses, or a damaged archive
        raise ValueError(f"{path} does not load as tensors and plain containers ({_weights_only_reason(e)}); "
                         f"refused") from None


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


STATE_KEYS = {"engine": dict, "extra": dict, "optimizer": str, "client": dict}
COUNTERS = ("steps", "health", "schedule")  # what every engine's counters hold (EngineCore.counters)


def read_state(path: Path) -> dict:
    """state.pt, loaded as `load_pickle_file` does and checked for what a load reads from it."""
    state = load_pickle_file(path)
    if not isinstance(state, dict) or any(not isinstance(state.get(k), kind) for k, kind in STATE_KEYS.items()):
        raise ValueError(f"{path} is not the engine's state (a dict of {', '.join(STATE_KEYS)}); refused")
    if any(k not in state["engine"] for k in COUNTERS):
        raise ValueError(f"{path} lacks the engine's counters ({', '.join(COUNTERS)}); refused")
    return state


@dataclass
class TagContents:
    """What a tag's engine files hold, from model.safetensors' header and state.pt."""
    weights: dict[str, list[int]]  # tensor name -> shape
    extra: list[str]  # the objectives' non-tensor states
    optimizer: str  # the optimizer's class name
    client: dict  # what the caller saved with the engine's files


def read_contents(tag_dir: Path) -> TagContents:
    """Every engine file a load reads, checked without executing anything and without reading the
    tensors' bytes: model.safetensors' header (model/interop.py), state.pt (`read_state`), the
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
    with single_process_quiet():
        dcp.load(optimizer_state(engine), storage_reader=_CheckedMetadataReader(tag_dir / OPTIM_DIR),
                 no_dist=not dist.is_initialized())
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
