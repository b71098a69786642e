"""Import weights from other formats into our modules (plain PyTorch, safe loading only).

- Official MAE checkpoints (facebookresearch/mae release): `{"model": state_dict}` with timm-style
  encoder names at the top level (cls_token, pos_embed, patch_embed.*, blocks.*, norm.*) and, in
  pretraining checkpoints, the decoder (mask_token, decoder_embed.*, decoder_pos_embed,
  decoder_blocks.*, decoder_norm.*, decoder_pred.*). Fine-tuned ones carry fc_norm/head instead
  of norm; the encoder part is what we import from them.
- timm VisionTransformer state_dicts: our encoder uses timm's names, so they load as they are.

Files are read with `torch.load(weights_only=True)` (or safetensors): nothing but tensors and
plain containers is ever unpickled. Every weights file goes through `safe_load` (the tensors) or
`weights_shapes` (names and shapes, from the header or a memory map), which judge the file first:
a path that is not a regular file (a FIFO would block the reader, a device never ends), an empty,
truncated or random file, a safetensors header whose length, JSON, dtypes or byte ranges do not
describe the file, a torch zip archive whose directory or records are damaged. Whatever the
format's reader raises is one WeightsFileError naming the file and what is wrong with it.
"""
from __future__ import annotations

import itertools
import json
import math
import pickle
import re
import stat
import struct
import zipfile
from pathlib import Path

import torch

from model.irpe import ContextualRPE
from model.mae_decoder import MAEDecoder
from model.objectives.mae import MAEConfig, MAEObjective
from model.pos_embed import sincos_2d
from model.timm_backbone import TimmBackbone
from model.vit import VisionTransformer

DECODER_PREFIXES = ("mask_token", "decoder_")
HEADS_BY_WIDTH = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}  # ViT-Ti/S/B/L/H; heads are not in the weights
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
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
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


def split_official_mae(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """-> (encoder state, decoder state) with our names (decoder keys as MAEDecoder's)."""
    state = state.get("model", state)
    encoder = {k: v for k, v in state.items() if not k.startswith(DECODER_PREFIXES)}
    decoder = {k: v for k, v in state.items() if k.startswith(DECODER_PREFIXES)}
    return encoder, decoder


def _block_name(name: str, prefix: str) -> re.Match | None:
    """`{prefix}.N.rest` (groups: N, rest) with N written as Python writes it (no leading zero, at
    most 9 digits), else None: `blocks.01.x` is not block 1."""
    return re.fullmatch(rf"{prefix}\.(0|[1-9]\d{{0,8}})\.(.+)", name)


def _depth(names, prefix: str, whose: str = "a ViT's", fix: str = "give a whole ViT encoder's weights") -> int:
    """How many blocks `{prefix}.N.*` the names hold; ValueError unless they are numbered 0..n-1 in
    turn: the depth built is the count of blocks the file holds, never a number one name claims."""
    ids = sorted({int(m.group(1)) for k in names if (m := _block_name(k, prefix))})
    if ids and ids[-1] != len(ids) - 1:
        shown = ", ".join(map(str, ids[:3])) + (f", ..., {ids[-1]}" if len(ids) > 3 else "")
        raise ValueError(f"holds {len(ids)} {prefix} numbered {shown}, not 0 to {len(ids) - 1} in turn as {whose} "
                         f"are: {fix}")
    return len(ids)


def accepted_shapes(model: torch.nn.Module) -> dict[str, set[tuple[int, ...]]]:
    """Name -> the shapes `model.load_state_dict` takes for it: its own, and for an iRPE table the
    other head layout too (shared or per head, adopted when loaded: model/irpe.py ContextualRPE)."""
    shapes = {name: {tuple(value.shape)} for name, value in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, ContextualRPE):
            rows, _, width = module.table.shape
            shapes[f"{name}.table"] |= {(rows, 1, width), (rows, module.num_heads, width)}
    return shapes


def shapes_misfit(theirs: dict[str, tuple[int, ...]], ours: dict[str, set[tuple[int, ...]]],
                  depth: int | None = None, blocks: str = "blocks") -> str:
    """How tensors `theirs` (name -> shape) differ from a model's `ours` (accepted_shapes), '' when
    the names and shapes are the same. With `depth`, `ours` is a one-block build whose `{blocks}.0.*`
    stands for each of `depth` blocks: a claimed depth is judged without building it."""
    if depth is not None and (held := _depth(theirs, blocks)) != depth:
        return f"{held} {blocks}, where the model has {depth}"
    for name, shape in theirs.items():
        accepted = ours.get(_as_block_zero(name, blocks) if depth is not None else name)
        if accepted is None:
            return f"a tensor {name}, which the model has not"
        if tuple(shape) not in accepted:
            return f"{name} of shape {list(shape)} (the model's: {' or '.join(str(list(s)) for s in sorted(accepted))})"
    if depth is None:
        expected = iter(ours)
    else:  # every block holds what the template's block 0 holds
        rests = [m.group(2) for name in ours if (m := _block_name(name, blocks))]
        outside = (name for name in ours if not _block_name(name, blocks))
        expected = itertools.chain(outside, (f"{blocks}.{i}.{rest}" for i in range(depth) for rest in rests))
    absent = next((name for name in expected if name not in theirs), None)
    return f"no {absent}, which the model has" if absent else ""


def _as_block_zero(name: str, blocks: str = "blocks") -> str:
    """`{blocks}.N.rest` -> `{blocks}.0.rest`; any other name as it is."""
    m = _block_name(name, blocks)
    return f"{blocks}.0.{m.group(2)}" if m else name


def vit_misfit(arch: dict, theirs: dict[str, tuple[int, ...]]) -> str:
    """How an encoder's tensors (name -> shape; a classifier `head.*` aside) differ from those of
    VisionTransformer(**arch) ('' when they fit exactly). Compared with a one-block build on the
    meta device, so no depth or width the description claims is ever allocated or built."""
    with torch.device("meta"):
        template = VisionTransformer(**{**arch, "depth": 1, "num_classes": 0})
    theirs = {k: v for k, v in theirs.items() if not k.startswith("head.")}
    return shapes_misfit(theirs, accepted_shapes(template), arch["depth"])


def _shape(encoder: dict[str, torch.Tensor], name: str, layout: str, whole: str = "ViT encoder") -> tuple[int, ...]:
    """The shape of encoder[name], which must exist with as many dimensions as `layout` names."""
    if name not in encoder:
        raise ValueError(f"holds no {name} among its {whole} tensors: give a whole {whole}'s weights")
    shape = tuple(encoder[name].shape)
    if len(shape) != layout.count(",") + 1:
        raise ValueError(f"holds a {name} of shape {shape}, not a ViT's {layout}: give the weights as a ViT's "
                         f"state_dict holds them")
    return shape


def infer_encoder_arch(encoder: dict[str, torch.Tensor], num_heads: int | None = None) -> dict:
    """Architecture kwargs of VisionTransformer read off an encoder state_dict."""
    if "patch_embed.proj.weight" not in encoder:
        raise ValueError(f"holds no ViT encoder tensors: no patch_embed.proj.weight among its {len(encoder)} tensors "
                         f"(e.g. {sorted(encoder)[:3]})")
    dim, chans, patch, _ = _shape(encoder, "patch_embed.proj.weight", "(width, channels, patch, patch)")
    grid = round((_shape(encoder, "pos_embed", "(1, 1 + grid, width)")[1] - 1) ** 0.5)
    heads = num_heads or HEADS_BY_WIDTH.get(dim)
    if heads is None:
        raise ValueError(f"cannot infer the number of heads of a {dim}-wide ViT (weights do not hold it; known widths: "
                         f"{', '.join(map(str, HEADS_BY_WIDTH))}): pass num_heads (train.evaluate: --num_heads)")
    if dim % heads:
        raise ValueError(f"{heads} heads do not divide the width {dim}: pass a num_heads that does")
    mlp_ratio = _shape(encoder, "blocks.0.mlp.fc1.weight", "(hidden, width)")[0] / dim
    return dict(img_size=grid * patch, patch_size=patch, in_chans=chans, embed_dim=dim,
                depth=_depth(encoder, "blocks"), num_heads=heads, mlp_ratio=mlp_ratio)


def encoder_from_state(encoder: dict[str, torch.Tensor], num_heads: int | None = None,
                       **overrides) -> VisionTransformer:
    """Our ViT with the weights of a timm / MAE encoder state_dict; a classifier head is dropped.

    A fine-tuned MAE / timm model with average pooling (fc_norm, no final norm) becomes a
    global_pool='avg' encoder, so its features are exactly those it was fine-tuned with.
    `overrides` replace what the state implies (e.g. img_size: the position table is then resized
    to the new grid, resize_pos_embed).
    """
    pool = "avg" if "fc_norm.weight" in encoder and "norm.weight" not in encoder else "token"
    arch = {**infer_encoder_arch(encoder, num_heads), "global_pool": pool}
    problem = vit_misfit(arch, {k: tuple(v.shape) for k, v in encoder.items()})
    if problem:  # judged before building: a tensor's shape sets a size (fc1: the MLP's width) of every block
        raise ValueError(f"does not hold the tensors of one ViT: it holds {problem} (the ViT its patch_embed, "
                         f"pos_embed and blocks.0.mlp.fc1 imply); give a whole ViT encoder's weights")
    model = VisionTransformer(**{**arch, **overrides})
    state = {k: v for k, v in encoder.items() if not k.startswith("head.")}
    if "pos_embed" in state and state["pos_embed"].shape != model.pos_embed.shape:
        state["pos_embed"] = resize_pos_embed(state["pos_embed"], model.patch_embed.grid_size)
    model.load_state_dict(state, strict=True)
    return model


def mae_from_official(path: str | Path, num_heads: int | None = None, decoder_heads: int = 16,
                      **mae_overrides) -> MAEObjective:
    """Our MAE objective (encoder + decoder) from an official MAE pretraining checkpoint."""
    encoder_state, decoder_state = split_official_mae(safe_load(path))
    if not decoder_state:
        raise ValueError(f"{path} has no decoder weights (an encoder-only or fine-tuned checkpoint); "
                         f"use encoder_from_state for those")
    try:
        encoder = encoder_from_state(encoder_state, num_heads)
        width, depth = _decoder_size(decoder_state, decoder_heads)
        cfg = MAEConfig(decoder_dim=width, decoder_depth=depth, decoder_heads=decoder_heads, **mae_overrides)
        if problem := _decoder_misfit(encoder, cfg, decoder_state):
            raise ValueError(f"does not hold the tensors of one MAE decoder: it holds {problem} (the decoder its "
                             f"decoder_embed and the encoder imply); {WHOLE_MAE}")
    except ValueError as e:
        raise ValueError(f"{path} {e}") from None
    objective = MAEObjective(encoder, cfg)
    objective.decoder.load_state_dict(decoder_state, strict=True)
    return objective


WHOLE_MAE = "give a whole MAE pretraining checkpoint"


def _decoder_size(decoder_state: dict[str, torch.Tensor], heads: int) -> tuple[int, int]:
    """(width, depth) of the MAE decoder an official checkpoint holds, read off its decoder_embed
    and the blocks it numbers, with `heads` attention heads; ValueError when they make no decoder."""
    width = _shape(decoder_state, "decoder_embed.weight", "(decoder width, encoder width)", "MAE decoder")[0]
    depth = _depth(decoder_state, "decoder_blocks", "an MAE decoder's", WHOLE_MAE)
    if not depth:
        raise ValueError(f"holds no decoder_blocks beside its decoder_embed: {WHOLE_MAE}")
    if width < 4 or width % 4:
        raise ValueError(f"holds a decoder_embed.weight {width} wide, not a positive multiple of 4 as an MAE decoder's "
                         f"2-D sin-cos position table needs: {WHOLE_MAE}")
    if width % heads:
        raise ValueError(f"holds a decoder {width} wide (decoder_embed.weight), which decoder_heads {heads} does not "
                         f"divide: pass the decoder_heads it was trained with (MAE's: 16)")
    return width, depth


def _decoder_misfit(encoder: VisionTransformer, cfg: MAEConfig, decoder_state: dict[str, torch.Tensor]) -> str:
    """vit_misfit for the MAE decoder `cfg` describes beside `encoder`: compared with a one-block
    build on the meta device, so no width or depth the file claims is allocated before it fits."""
    cfg.validate()
    pe = encoder.patch_embed
    with torch.device("meta"):
        template = MAEDecoder(pe.grid_size, pe.patch_size, pe.proj.in_channels, encoder.embed_dim, cfg.decoder_dim,
                              depth=1, num_heads=cfg.decoder_heads)
    theirs = {k: tuple(v.shape) for k, v in decoder_state.items()}
    return shapes_misfit(theirs, accepted_shapes(template), cfg.decoder_depth, blocks="decoder_blocks")


def resize_pos_embed(table: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(1, 1+n*n, D) position table of a square grid -> (1, 1+gh*gw, D) for `grid`. The fixed sin-cos
    table of pretraining becomes the target grid's own sin-cos table (exact); a learned one (after
    fine-tuning, which trains it) is interpolated bicubically with the cls entry kept, as MAE's
    util/pos_embed.py interpolate_pos_embed does."""
    if table.dim() != 3 or table.shape[0] != 1:
        raise ValueError(f"pos_embed of shape {tuple(table.shape)} is not a (1, 1 + grid, width) position table")
    n, dim = round((table.shape[1] - 1) ** 0.5), table.shape[2]
    if n * n != table.shape[1] - 1:
        raise ValueError(f"pos_embed of {table.shape[1]} entries is not 1 + a square grid")
    if torch.allclose(table.float(), sincos_2d(dim, (n, n), cls_token=True)[None], atol=5e-3):  # bf16 copies too
        return sincos_2d(dim, grid, cls_token=True)[None].to(table.dtype)
    patches = table[:, 1:].reshape(1, n, n, dim).permute(0, 3, 1, 2).float()  # (1, D, n, n)
    patches = torch.nn.functional.interpolate(patches, size=grid, mode="bicubic", align_corners=False)
    return torch.cat([table[:, :1], patches.permute(0, 2, 3, 1).flatten(1, 2).to(table.dtype)], dim=1)


def load_into_objective(objective: torch.nn.Module, path: str | Path,
                        state: dict[str, torch.Tensor] | None = None,
                        head: dict[str, torch.Tensor] | None = None) -> str:
    """Initialise an objective from an official MAE checkpoint, a timm/exported encoder state_dict
    or .safetensors (or an already loaded `state` with those names, read from `path`): the encoder
    always, the MAE decoder too when there is one and the objective owns an MAE decoder. A new
    classifier head (and fc_norm for average pooling) is allowed to stay fresh; `head` (`head.*`)
    is a classifier the caller found to fit the encoder's (same classes, same pooling), loaded
    into it. Returns a one-line summary for the log."""
    encoder_state, decoder_state = split_official_mae(safe_load(path) if state is None else state)
    encoder = objective.encoder
    if isinstance(encoder, TimmBackbone):
        return _load_timm_backbone(encoder, path, encoder_state)
    encoder_state = {k: v for k, v in encoder_state.items() if not k.startswith("head.")}
    fresh = {"head.weight", "head.bias"}  # a classifier is always trained anew
    if encoder.global_pool == "avg":  # MAE fine-tuning: fc_norm is new, the pretraining norm unused
        encoder_state = {k: v for k, v in encoder_state.items() if not k.startswith("norm.")}
        fresh |= {"fc_norm.weight", "fc_norm.bias"}
    pos = encoder_state.get("pos_embed")
    if pos is not None and pos.shape != encoder.pos_embed.shape:
        # Another resolution (MAE+ pretrains on 112 px crops, fine-tunes at 224): a sin-cos table
        # becomes the target grid's own, a fine-tuned (learned) one is interpolated.
        try:
            encoder_state = {**encoder_state, "pos_embed": resize_pos_embed(pos, encoder.patch_embed.grid_size)}
        except ValueError as e:
            raise ValueError(f"{path}: {e}: give the weights as a ViT's state_dict holds them") from None
    try:
        missing, unexpected = encoder.load_state_dict(encoder_state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"{path} does not fit the configured encoder: {e}") from None
    if unexpected or set(missing) - fresh:
        hint = ("; it pools by the mean (fc_norm, no final norm, as fine-tuning leaves it): give --model.global_pool "
                "avg" if "fc_norm.weight" in unexpected and encoder.global_pool == "token" else "")
        raise ValueError(f"{path} does not fit the configured encoder: missing {sorted(set(missing) - fresh)}, "
                         f"unexpected {sorted(unexpected)}{hint}")
    if head:
        encoder.head.load_state_dict({k.removeprefix("head."): v for k, v in head.items()})
        missing = [k for k in missing if not k.startswith("head.")]
    loaded = "encoder" + (" + classifier" if head else "") + (f" (new: {', '.join(sorted(missing))})" if missing else "")
    decoder = getattr(objective, "decoder", None)
    if decoder_state and decoder is not None:
        table = decoder_state.get("decoder_pos_embed")
        if table is not None and table.shape != decoder.decoder_pos_embed.shape:  # another image size: sin-cos anew
            grid = encoder.patch_embed.grid_size
            decoder_state = {**decoder_state, "decoder_pos_embed": resize_pos_embed(table, grid)}
        try:
            decoder.load_state_dict(decoder_state, strict=True)
        except RuntimeError as e:
            raise ValueError(f"{path} has a decoder that does not fit the configured one: {e}") from None
        loaded += " + decoder"
    return f"initialised {loaded} from {path}"


def _load_timm_backbone(encoder: TimmBackbone, path: str | Path, state: dict[str, torch.Tensor]) -> str:
    """A timm backbone (ConvNeXt, Swin, ...) takes its own export or run under timm's names, every
    tensor but a classifier (a timm checkpoint's `head.fc.*`; ConvNeXt's `head.norm` is the
    backbone's own): it has no pooling choice and no sin-cos table to adapt."""
    classifier = encoder.inner.pretrained_cfg.get("classifier") or "head"
    state = {k: v for k, v in state.items() if not k.startswith(classifier + ".")}
    try:
        encoder.load_state_dict(state, strict=True)
    except RuntimeError as e:  # missing / unexpected names, or shapes
        said = " ".join(line.strip() for line in str(e).strip().splitlines()[:3])
        raise ValueError(f"{path} does not fit timm model {encoder.name!r}: {said} (init_from takes weights of the "
                         f"same timm model, at the same img_size and in_chans)") from None
    return f"initialised timm {encoder.name} from {path}"
