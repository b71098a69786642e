"""Reading the files of a checkpoint tag that someone else may have made, executing nothing: the
optimizer state's DCP `.metadata` (unpickled with an exact allowlist of the classes DCP writes
there, then checked for what DCP's loader relies on) and the shard files it names, and
torch.save files such as state.pt (their pickle's globals scanned, then loaded weights-only).
Every refusal is a ValueError naming the file and why. The tag's layout and the loading itself
are train/engine/state_files.py's.
"""
from __future__ import annotations

import io
import pickle
import re
from pathlib import Path, PosixPath

import torch
import torch.distributed.checkpoint as dcp
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

SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")  # DCP's file of one rank's optimizer pieces
ZIP_RECORD = b"PK\x03\x04"  # DCP writes each tensor with torch.save: a zip archive starts every piece


# --- the optimizer state's metadata and shards -------------------------------------------------
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
    is a plain pickle.load), so a load hands DCP the object read here (`CheckedMetadataReader`).
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


class CheckedMetadataReader(dcp.FileSystemReader):
    """DCP's file reader, whose metadata is the one `read_dcp_metadata` unpickled and checked:
    DCP's own read_metadata would pickle.load the file. It takes no rank argument, so DCP does not
    fall back to reading a rank's own `__<rank>.metadata` (with pickle) when this one refuses."""

    refusal: ValueError | None = None  # why read_metadata refused: DCP passes it on only as text inside its own error

    def read_metadata(self) -> Metadata:
        try:
            metadata = read_dcp_metadata(Path(self.path))
        except ValueError as e:
            self.refusal = e
            raise
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
