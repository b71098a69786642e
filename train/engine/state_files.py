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
"""
from __future__ import annotations

import contextlib
import json
import pickle
import struct
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

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


def write_weights(path: Path, tensors: dict[str, torch.Tensor], write: bool) -> None:
    """safetensors' layout (an 8-byte header length, a JSON header of names, dtypes, shapes and byte
    ranges, then the bytes), written tensor by tensor: the header needs only shapes and dtypes.
    Collective when any tensor is a DTensor; only the rank with `write` writes."""
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data start 8-byte aligned, as safetensors writes them
    with open(path, "wb") if write else contextlib.nullcontext() as f:
        if write:
            f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            whole = _whole(t)
            if write:
                f.write(whole.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            del whole


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


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's own metadata classes and torch's dtypes, sizes and layouts; nothing else."""

    SAFE = {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("builtins", "set"),
            ("builtins", "frozenset"), ("builtins", "slice"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint") or (module, name) in self.SAFE:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format, type(torch.Size))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def check_dcp_metadata(folder: Path) -> None:
    """torch.distributed.checkpoint reads its `.metadata` with pickle: refuse one that names a
    global outside DCP's metadata classes and torch's types (unpickled here with only those allowed)."""
    path = folder / ".metadata"
    if not path.is_file():
        raise ValueError(f"{folder} has no .metadata: the optimizer state is incomplete")
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} would unpickle {e}; refusing to load it (not written by this code, or tampered "
                         f"with)") from None


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
    """Collective: every rank calls it with the same tag folder."""
    tensors, extra = module_tensors(engine)
    write_weights(tag_dir / WEIGHTS_FILE, {k: v.detach() for k, v in tensors.items()}, engine.rank == 0)
    with single_process_quiet():
        dcp.save(optimizer_state(engine), checkpoint_id=tag_dir / OPTIM_DIR, no_dist=not dist.is_initialized())
    if engine.rank == 0:
        torch.save({"engine": engine.counters(), "extra": extra, "optimizer": type(engine.optimizer).__name__,
                    "client": client}, tag_dir / STATE_FILE)


def load(engine, tag_dir: Path) -> dict:
    from safetensors import safe_open

    check_layout(tag_dir)
    state = torch.load(tag_dir / STATE_FILE, map_location="cpu", weights_only=True)
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
    check_dcp_metadata(tag_dir / OPTIM_DIR)
    with single_process_quiet():
        dcp.load(optimizer_state(engine), checkpoint_id=tag_dir / OPTIM_DIR, no_dist=not dist.is_initialized())
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
