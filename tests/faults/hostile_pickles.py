"""A corpus of hostile pickles, written opcode by opcode (pickle.dumps cannot write most of them),
and the checkpoint files that carry them.

Every payload of `code_payloads(marker)` creates the file `marker` when a plain unpickler reads it
(tests/faults/test_hostile_checkpoints.py checks that, so the corpus is live): each global opcode
(GLOBAL in protocols 0-3, STACK_GLOBAL in 4-5, INST, OBJ), NEWOBJ / NEWOBJ_EX, dotted names under
the modules DCP's metadata names, calls of os.system / subprocess / exec / eval / open, BUILD giving
an allowed class a `__setstate__`, copyreg extension codes (EXT1 / EXT2 / EXT4, registered by
`registered_extensions`), nested loaders (pickle.loads, torch.load, marshal + exec, codecs +
exec), torch's rebuild functions with hostile arguments, and a persistent id built by a call.
`malformed_payloads()` holds pickles that run nothing but are not what any checkpoint file holds.
"""
from __future__ import annotations

import codecs
import contextlib
import copyreg
import io
import json
import marshal
import pickle
import struct
import zipfile
import zlib
from pathlib import Path

import torch

MARK, STOP, TUPLE, EMPTY_TUPLE, REDUCE, BUILD = b"(", b".", b"t", b")", b"R", b"b"
EMPTY_DICT, SETITEM, EMPTY_LIST, APPENDS = b"}", b"s", b"]", b"e"
NEWOBJ, NEWOBJ_EX, STACK_GLOBAL, OBJ, BINPERSID = b"\x81", b"\x92", b"\x93", b"o", b"Q"
NEWFALSE = b"\x89"
# extension codes registered to dangerous callables while a test runs (copyreg's global registry)
EXTENSIONS = {0xF1: ("os", "system"), 0x4242: ("torch.distributed.checkpoint.metadata", "os.system"),
              0x1F00D: ("builtins", "exec")}


@contextlib.contextmanager
def registered_extensions():
    """copyreg extension codes pointing at os.system (also by a dotted name under a module DCP's
    metadata names) and exec, as a process that imported something registering them would hold."""
    for code, (module, name) in EXTENSIONS.items():
        copyreg.add_extension(module, name, code)
    try:
        yield
    finally:
        for code, (module, name) in EXTENSIONS.items():
            copyreg.remove_extension(module, name, code)


def text(value: str, proto: int) -> bytes:
    """A str pushed: UNICODE (a line) in protocol 0, BINUNICODE after."""
    if proto == 0:
        return b"V" + value.encode("raw-unicode-escape") + b"\n"
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def raw_bytes(value: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(value)) + value


def glob(module: str, name: str, proto: int) -> bytes:
    """A global pushed: GLOBAL (`c module\\nname\\n`) up to protocol 3, STACK_GLOBAL from 4."""
    if proto < 4:
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    return text(module, proto) + text(name, proto) + STACK_GLOBAL


def call(fn: bytes, *args: bytes) -> bytes:
    """fn(*args): the function and its arguments already as opcodes."""
    return fn + MARK + b"".join(args) + TUPLE + REDUCE


def framed(body: bytes, proto: int) -> bytes:
    return (b"\x80" + bytes([proto]) if proto >= 2 else b"") + body + STOP


def ext(code: int) -> bytes:
    if code < 0x100:
        return b"\x82" + bytes([code])
    if code < 0x10000:
        return b"\x83" + struct.pack("<H", code)
    return b"\x84" + struct.pack("<i", code)


def write_nested(nested: Path, marker: Path) -> None:
    """The file the nested torch.load payload loads: a torch.save of an object that opens `marker`."""
    torch.save(_OpensMarker(str(marker)), nested)


def code_payloads(marker: Path, nested: Path) -> dict[str, bytes]:
    """name -> a pickle that creates `marker` when unpickled by a plain unpickler (`nested`: the file
    of `write_nested`, which the nested torch.load payload loads)."""
    m = str(marker)
    touch = f"touch '{m}'"
    source = f"open({m!r}, 'w').close()"

    def open_args(proto: int) -> bytes:  # (marker, "w")
        return text(m, proto) + text("w", proto)

    inner = framed(call(glob("builtins", "open", 4), open_args(4)), 4)
    return {
        # every protocol, through its own global opcode
        "protocol 0 GLOBAL os.system": framed(call(glob("os", "system", 0), text(touch, 0)), 0),
        "protocol 1 GLOBAL builtins.open": framed(call(glob("builtins", "open", 1), open_args(1)), 1),
        "protocol 2 GLOBAL subprocess.call": framed(call(glob("subprocess", "call", 2), EMPTY_LIST + MARK + text(
            "touch", 2) + text(m, 2) + APPENDS), 2),
        "protocol 3 GLOBAL builtins.exec": framed(call(glob("builtins", "exec", 3), text(source, 3)), 3),
        "protocol 4 STACK_GLOBAL builtins.eval": framed(call(glob("builtins", "eval", 4), text(source, 4)), 4),
        "protocol 5 STACK_GLOBAL builtins.open": framed(call(glob("builtins", "open", 5), open_args(5)), 5),
        "INST builtins.open": framed(MARK + open_args(0) + b"ibuiltins\nopen\n", 0),
        "OBJ builtins.open": framed(MARK + glob("builtins", "open", 1) + open_args(1) + OBJ, 1),
        "NEWOBJ functools.partial": framed(glob("functools", "partial", 2) + MARK + glob("builtins", "open", 2)
                                           + open_args(2) + TUPLE + NEWOBJ + EMPTY_TUPLE + REDUCE, 2),
        "NEWOBJ_EX functools.partial": framed(glob("functools", "partial", 4) + MARK + glob("builtins", "open", 4)
                                              + text(m, 4) + TUPLE + EMPTY_DICT + text("mode", 4) + text("w", 4)
                                              + SETITEM + NEWOBJ_EX + EMPTY_TUPLE + REDUCE, 4),
        "getattr of __import__": framed(call(call(glob("builtins", "getattr", 4), call(
            glob("builtins", "__import__", 4), text("os", 4)) + text("system", 4)), text(touch, 4)), 4),
        # dotted names: protocol 4 resolves `os.system` as an attribute path under the module
        "dotted os.system under DCP's metadata module": framed(call(
            glob("torch.distributed.checkpoint.metadata", "os.system", 4), text(touch, 4)), 4),
        "dotted pickle.loads under DCP's filesystem module": framed(call(
            glob("torch.distributed.checkpoint.filesystem", "pickle.loads", 4), raw_bytes(inner)), 4),
        "dotted os.system under torch.serialization": framed(call(
            glob("torch.serialization", "os.system", 4), text(touch, 4)), 4),
        # BUILD: an allowed class given a __setstate__, then a state to call it with
        "BUILD __setstate__ on DCP's Metadata": framed(
            glob("torch.distributed.checkpoint.metadata", "Metadata", 4) + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT
            + text("__setstate__", 4) + glob("torch.distributed.checkpoint.metadata", "os.system", 4) + SETITEM
            + BUILD + text(touch, 4) + BUILD, 4),
        # copyreg's extension registry
        "EXT1 os.system": framed(call(ext(0xF1), text(touch, 2)), 2),
        "EXT2 dotted os.system under DCP's metadata module": framed(call(ext(0x4242), text(touch, 4)), 4),
        "EXT4 builtins.exec": framed(call(ext(0x1F00D), text(source, 2)), 2),
        # loaders inside the pickle
        "nested pickle.loads": framed(call(glob("pickle", "loads", 4), raw_bytes(inner)), 4),
        "nested torch.load weights_only=False": framed(
            glob("functools", "partial", 4) + MARK + glob("torch", "load", 4) + text(str(nested), 4) + TUPLE
            + EMPTY_DICT + text("weights_only", 4) + NEWFALSE + SETITEM + NEWOBJ_EX + EMPTY_TUPLE + REDUCE, 4),
        "nested marshal.loads + exec": framed(call(glob("builtins", "exec", 4), call(
            glob("marshal", "loads", 4), raw_bytes(marshal.dumps(compile(source, "payload", "exec"))))), 4),
        "nested codecs.decode + exec": framed(call(glob("builtins", "exec", 4), call(
            glob("codecs", "decode", 4), text(codecs.encode(source, "rot13"), 4), text("rot13", 4))), 4),
        # torch's own rebuild functions with hostile arguments
        "torch._tensor._rebuild_from_type_v2 calling open": framed(call(
            glob("torch._tensor", "_rebuild_from_type_v2", 2), glob("builtins", "open", 2),
            glob("torch", "Tensor", 2), MARK + open_args(2) + TUPLE, EMPTY_DICT), 2),
        "torch._utils._rebuild_parameter of a call": framed(call(
            glob("torch._utils", "_rebuild_parameter", 2), call(glob("os", "system", 2), text(touch, 2)),
            NEWFALSE, call(glob("collections", "OrderedDict", 2))), 2),
        "torch._utils._rebuild_tensor_v2 of a call": framed(call(
            glob("torch._utils", "_rebuild_tensor_v2", 2), call(glob("os", "system", 2), text(touch, 2)),
            b"K\x00", MARK + b"K\x01" + TUPLE, MARK + b"K\x01" + TUPLE, NEWFALSE,
            call(glob("collections", "OrderedDict", 2))), 2),
        # a persistent id, built by a call before any persistent_load sees it
        "BINPERSID of a call": framed(call(glob("os", "system", 2), text(touch, 2)) + BINPERSID, 2),
    }


class _OpensMarker:
    """Unpickling this opens its path for writing (the nested torch.load payload's content)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def malformed_payloads() -> dict[str, bytes]:
    """name -> bytes that run nothing but are no checkpoint file: a layout lookup of a non-layout
    name, a string of 2**62 bytes, a truncated pickle, no pickle at all, an empty file."""
    return {
        "torch.serialization._get_layout of a non-layout name": framed(call(
            glob("torch.serialization", "_get_layout", 2), text("os.system", 2)), 2),
        "a string of 2**62 bytes": b"\x80\x04\x8d" + struct.pack("<Q", 2**62) + b"x" * 16,
        "a truncated pickle": pickle.dumps({"a": list(range(100))}, protocol=4)[:40],
        "no pickle": b"\x00garbage" * 64,
        "an empty file": b"",
    }


def as_torch_file(payload: bytes, like) -> bytes:
    """The torch.save zip archive `like` (a path or a file) with its data.pkl replaced by `payload`
    (torch reads it by its record names; the zip need not be torch's own writer's)."""
    out = io.BytesIO()
    with zipfile.ZipFile(like) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for name in source.namelist():
            target.writestr(name, payload if name.endswith("/data.pkl") else source.read(name))
    return out.getvalue()


def replace_in_tag(tag: Path, name: str, data: bytes) -> None:
    """A tag whose file `name` holds `data`, its complete.json rewritten to match (the size and
    crc32 of what is there now): hostile, yet as well-formed as whoever wrote the folder can make it."""
    (tag / name).write_bytes(data)
    meta = json.loads((tag / "complete.json").read_text())
    meta["files"][name] = len(data)
    meta["crc32"][name] = zlib.crc32(data)
    (tag / "complete.json").write_text(json.dumps(meta))


def write_tag(tag: Path, files: dict[str, bytes]) -> None:
    """A complete tag of `files` (name -> bytes), its complete.json listing their sizes and crc32s."""
    for name, data in files.items():
        (tag / name).parent.mkdir(parents=True, exist_ok=True)
        (tag / name).write_bytes(data)
    (tag / "complete.json").write_text(json.dumps({
        "step": 1, "world_size": 1, "config": {"objective": "mae"}, "files": {k: len(v) for k, v in files.items()},
        "crc32": {k: zlib.crc32(v) for k, v in files.items()}}))


def write_hostile_runs(root: Path) -> None:
    """Run folders of the MAE objective whose one checkpoint would create `root/ran` if loaded the
    unsafe way: `hostile_state` through its state.pt (a torch.save archive whose pickle opens the
    file), `hostile_metadata` through its optimizer state's .metadata (os.system named under DCP's
    own metadata module), its state.pt being a plain engine state."""
    from safetensors.torch import save

    marker = str(root / "ran")
    archive = io.BytesIO()
    torch.save({}, archive)
    opens = framed(call(glob("builtins", "open", 2), text(marker, 2) + text("w", 2)), 2)
    state = io.BytesIO()
    torch.save({"engine": {"steps": 1, "health": {}, "schedule": {}}, "extra": {}, "optimizer": "AdamW",
                "client": {"step": 1, "data": [{}]}}, state)
    touches = framed(call(glob("torch.distributed.checkpoint.metadata", "os.system", 4),
                          text(f"touch '{marker}'", 4)), 4)
    weights = save({"encoder.cls_token": torch.zeros(1, 1, 32)})
    for name, files in (("hostile_state", {"model.safetensors": weights, "state.pt": as_torch_file(opens, archive)}),
                        ("hostile_metadata", {"model.safetensors": weights, "state.pt": state.getvalue(),
                                              "optim/.metadata": touches})):
        write_tag(root / name / "checkpoints" / "step00000001", files)
        (root / name / "config.json").write_text(json.dumps({"objective": "mae"}))
