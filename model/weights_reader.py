"""Read weights files someone else made without running their code, judging each file first.

Files are read with `torch.load(weights_only=True)` (or safetensors): nothing but tensors and
plain containers is ever unpickled. Every weights file goes through `safe_load` (the tensors) or
`weights_shapes` (names and shapes, from the header or a memory map), which judge the file first:
a path that is not a regular file (a FIFO would block the reader, a device never ends), an empty,
truncated or random file, a safetensors header whose length, JSON, dtypes or byte ranges do not
describe the file, a torch zip archive whose directory or records are damaged. Whatever the
format's reader raises is one WeightsFileError naming the file and what is wrong with it.
"""
from __future__ import annotations

import json
import math
import pickle
import re
import stat
import struct
import zipfile
from pathlib import Path

import torch

# safetensors dtype -> bytes per element: those safetensors' torch reader maps to a torch dtype
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "U64": 8, "U32": 4, "U16": 2, "C64": 8, "F8_E4M3": 1, "F8_E4M3FNUZ": 1,
                     "F8_E5M2": 1, "F8_E5M2FNUZ": 1}
SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors refuses larger headers
TORCH_ERRORS = (RuntimeError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile, OSError, ValueError,
                struct.error, KeyError, IndexError, TypeError, AttributeError, UnicodeDecodeError)
SPECIAL_FILES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))



class WeightsFileError(ValueError):
    """A file that is not weights this code reads; the message names the file and what is wrong."""


def weights_file_size(path: Path) -> int:
    """The size of `path` when it is a regular file, judged from `stat` without opening it (a FIFO
    would block, a device never ends); else WeightsFileError saying what it is."""
    try:
        mode, size = (st := path.stat()).st_mode, st.st_size
    except FileNotFoundError:
        raise WeightsFileError(f"{path} does not exist") from None
    except OSError as e:
        raise WeightsFileError(f"{path} cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(mode):
        raise WeightsFileError(f"{path} is a folder, not a weights file")
    for is_kind, kind in SPECIAL_FILES:
        if is_kind(mode):
            raise WeightsFileError(f"{path} is {kind}, not a regular file")
    if size == 0:
        raise WeightsFileError(f"{path} is empty (0 bytes)")
    return size


def _read_head(path: Path, size: int) -> bytes:
    """The first `size` bytes of a file (an unreadable one: WeightsFileError)."""
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError as e:
        raise WeightsFileError(f"{path} cannot be read ({e.strerror})") from None


def _tensor_entry_problem(entry: object) -> str:
    """What is wrong with one tensor's header entry ('' when it is sound)."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        return "is not a {dtype, shape, data_offsets} entry"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in SAFETENSORS_BYTES:
        return f"has dtype {dtype!r}, which is none of safetensors' torch dtypes ({', '.join(SAFETENSORS_BYTES)})"
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        return f"has shape {shape!r}, not a list of sizes >= 0"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(n, int) for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        return f"has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end"
    if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_BYTES[dtype]:
        return (f"spans {offsets[1] - offsets[0]} bytes by its data_offsets, but its shape {shape} of {dtype} "
                f"takes {math.prod(shape) * SAFETENSORS_BYTES[dtype]}")
    return ""


def safetensors_header(path: str | Path) -> dict[str, dict]:
    """The tensors a .safetensors file holds ({name: {"dtype", "shape", "data_offsets"}}), after
    checking what safetensors' reader checks, from the header alone: an 8-byte header length within
    the file, a JSON header of known dtypes whose byte ranges follow one another from the start of
    the data to the end of the file. Anything else: WeightsFileError saying what is wrong."""
    path = Path(path)
    size = weights_file_size(path)
    if size < 8:
        raise WeightsFileError(f"{path} is truncated or not a safetensors file: {size} bytes, fewer than the 8 of "
                               f"the header length a safetensors file starts with")
    (length,) = struct.unpack("<Q", _read_head(path, 8))
    if length > min(size - 8, SAFETENSORS_MAX_HEADER):
        raise WeightsFileError(f"{path} is not a safetensors file, or is truncated in its header: its first 8 bytes "
                               f"give a header of {length} bytes, the file has {size - 8} after them")
    try:
        header = json.loads(_read_head(path, 8 + length)[8:].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise WeightsFileError(f"{path} is not a safetensors file: its {length}-byte header is not JSON "
                               f"({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise WeightsFileError(f"{path} is not a safetensors file: its header is JSON but not a table of tensors")
    header.pop("__metadata__", None)
    end = 0
    for name, entry in sorted(header.items(), key=lambda kv: _offsets_key(kv[1])):
        problem = _tensor_entry_problem(entry)
        if problem:
            raise WeightsFileError(f"{path} is not a safetensors file written whole: in its header, tensor {name!r} "
                                   f"{problem}")
        begin, stop = entry["data_offsets"]
        if begin != end:
            raise WeightsFileError(f"{path} is not a safetensors file written whole: in its header, tensor {name!r} "
                                   f"starts at byte {begin} of the data, where the tensor before it ends at {end} "
                                   f"(tensors overlap or leave a gap)")
        end = stop
    data = size - 8 - length
    if end > data:
        raise WeightsFileError(f"{path} is truncated in its data: its tensors end at byte {end} of the data, the file "
                               f"holds {data}")
    if end < data:
        raise WeightsFileError(f"{path} is not a safetensors file written whole: {data - end} bytes follow its last "
                               f"tensor")
    return header


def _offsets_key(entry: object) -> tuple:
    """Sort key of a header entry by its data offsets (malformed entries first, to be named)."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if isinstance(offsets, list) and all(isinstance(n, int) for n in offsets):
        return (1, *offsets)
    return (0,)


def check_torch_archive(path: Path, size: int) -> bool:
    """A torch.save file is a zip archive (data.pkl and one record per storage) or, from before
    PyTorch 1.6, a sequence of pickles: refuse anything else, and an archive whose directory or
    records do not fit in the file, from the zip directory alone. Returns whether it is a zip."""
    head = _read_head(path, 4)
    if head != b"PK\x03\x04":
        if head[:1] != b"\x80":  # a pickle of protocol 2 or later: torch.save's earlier format
            raise WeightsFileError(f"{path} is not a torch file: neither torch.save's zip archive nor its earlier "
                                   f"pickle format")
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise WeightsFileError(f"{path} is truncated or damaged: its zip directory cannot be read ({e})") from None
    if not any(r.filename.endswith("/data.pkl") or r.filename == "data.pkl" for r in records):
        raise WeightsFileError(f"{path} is not a torch file: a zip archive without the data.pkl torch.save writes")
    for r in records:
        if r.header_offset + 30 + len(r.filename.encode()) + r.compress_size > size:
            raise WeightsFileError(f"{path} is truncated or damaged: its record {r.filename} ends beyond the file's "
                                   f"{size} bytes")
    return True


def _torch_load(path: Path, mmap: bool) -> object:
    """torch.load(weights_only=True) of a checked file; every failure one WeightsFileError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except TORCH_ERRORS as e:
        if re.search(r"allowed global|unsupported global", str(e), re.IGNORECASE):  # weights_only refused a
            # class or function the pickle names (torch 2.14: "Unsupported global: GLOBAL posix.system ...")
            raise WeightsFileError(
                f"{path} holds objects other than tensors and plain containers, which are not unpickled for "
                f"safety ({type(e).__name__}); re-save it as a state_dict or .safetensors") from None
        reason = str(e).split(". ")[0].strip() or "the file ends early"
        raise WeightsFileError(f"{path} cannot be read as a torch file, it is damaged or truncated "
                               f"({type(e).__name__}: {reason})") from None


def _torch_state(path: Path, mmap: bool) -> dict:
    """The dict of a checked torch file (an official MAE `{"model": ...}` or a state_dict)."""
    is_zip = check_torch_archive(path, weights_file_size(path))
    state = _torch_load(path, mmap and is_zip)  # the earlier format cannot be memory-mapped
    if not isinstance(state, dict) or not isinstance(state.get("model", state), dict):
        held = state.get("model") if isinstance(state, dict) else state
        raise WeightsFileError(f"{path} holds a {type(held).__name__}, not a state_dict (tensors by name)")
    # e.g. {0: tensor}: a list of tensors saved as a dict
    if odd := [k for k in state.get("model", state) if not isinstance(k, str)]:
        raise WeightsFileError(f"{path} names a tensor by the {type(odd[0]).__name__} {odd[0]!r}, not by a parameter "
                               f"name: give a state_dict (tensors by name)")
    check_stored_whole(path, state)
    return state


def _tensors(container: object):
    """(dotted name, tensor) of every tensor in nested dicts / lists / tuples, walked without
    recursion, each container once: a pickle may hold a list inside itself, or one list many times."""
    stack, seen = [("", container)], set()
    while stack:
        prefix, value = stack.pop()
        if isinstance(value, torch.Tensor):
            yield prefix, value
        elif isinstance(value, dict | list | tuple) and id(value) not in seen:
            seen.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((f"{prefix}.{k}" if prefix else str(k), v) for k, v in reversed(list(items)))


def check_stored_whole(path: Path, state: object) -> None:
    """WeightsFileError naming the first tensor whose storage holds fewer bytes than its values
    take: torch.save keeps a broadcast view (`expand`, stride 0) as its small storage and its
    strides, so a file of kilobytes can stand for a tensor of gigabytes that any computation on it
    (the finiteness check, a copy into the model) would materialise."""
    for name, value in _tensors(state):
        claimed, stored = value.numel() * value.element_size(), value.untyped_storage().nbytes()
        if claimed > stored:
            raise WeightsFileError(f"{path}: tensor {name} claims {value.numel():,} values (shape {list(value.shape)}) "
                                   f"of {claimed:,} bytes but stores {stored:,} (a broadcast view saved as such): "
                                   f"give weights saved as whole tensors (tensor.contiguous() before torch.save)")


def safe_load(path: str | Path) -> dict[str, torch.Tensor]:
    """A .safetensors file or a torch file holding tensors in plain containers; never arbitrary
    objects. WeightsFileError when the file is not such a file (see the module's docstring), or
    when a weight is NaN or infinite."""
    path = Path(path)
    if path.suffix != ".safetensors":
        return check_finite(path, _torch_state(path, mmap=False))
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    safetensors_header(path)
    try:
        return check_finite(path, load_file(str(path)))
    except (SafetensorError, OSError) as e:  # read after the header was judged: the file changed, or a bad read
        raise WeightsFileError(f"{path} cannot be read as a safetensors file ({e})") from None


def check_finite(path: Path, state: dict) -> dict:
    """`state` when every floating-point weight in it (an official checkpoint's: its "model") is
    finite; else WeightsFileError naming the first that is not: a diverged run's weights would
    train to NaN losses, every step skipped, or score as a traceback."""
    weights = state.get("model", state)
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        if value.element_size() == 1:  # float8: torch has no isfinite for some of them; fp32 holds each exactly
            value = value.float()
        if not torch.isfinite(value).all():
            count = int((~torch.isfinite(value)).sum())
            raise WeightsFileError(f"{path}: weight {name} holds {count} NaN or infinite value(s) of {value.numel()} "
                                   f"(a diverged run's?): give weights saved before the divergence")
    return state


def weights_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a weights file, with the checks of `safe_load`, reading no tensor
    data: a .safetensors file's header; a torch file memory-mapped (its "model" entry when it has
    one, as official MAE checkpoints do)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return {name: tuple(entry["shape"]) for name, entry in safetensors_header(path).items()}
    state = _torch_state(path, mmap=True)
    state = state.get("model", state)
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
