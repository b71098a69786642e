"""Convert a checkpoint tag of the earlier layout (model.pt holding the weights, optim_rank*.pt
holding optimizer state by flat range) into the engine's layout (train/engine/state_files.py),
in place, so that it resumes and exports as any other tag.

    python -m train.convert_checkpoint TAG [TAG ...]      (a tag folder, or a run folder: all its tags)

One process, on the CPU; the converted tag holds the same weights, optimizer moments, step
counts, schedule, counters and client state bit for bit. The new files are written under
temporary names and renamed once all are complete (the weights last), complete.json is rewritten
to list them with their sizes and crc32s, and only then are the old ones removed: a conversion
stopped at any point leaves a tag that resumes, or one the same command converts again.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from data.cli import Parser
from data.outputs import written_whole
from train.config.errors import ConfigError
from train.engine.checkpoint import COMPLETE, TAG_RE, check_files, crc32
from train.engine.state_files import (
    LEGACY_FILE,
    OPTIM_DIR,
    STATE_FILE,
    WEIGHTS_FILE,
    single_process_quiet,
    write_weights,
)
from train.run.cli import cli


def _read_legacy(path: Path) -> dict:
    """A file of the earlier layout, its records checked against their CRCs first (a file of the
    right size with damaged bytes passed check_files and converted into garbage, then was
    deleted); ConfigError in one line when damaged, and nothing is converted."""
    import pickle
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        if damaged is not None:
            raise ConfigError(f"{path} is damaged: its record {damaged} fails its CRC check; nothing was converted "
                              f"(convert another tag, or restore this one from a copy)")
        return torch.load(path, map_location="cpu", weights_only=True)
    except (zipfile.BadZipFile, pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise ConfigError(f"{path} cannot be read ({type(e).__name__}: {str(e).split('. ')[0]}); nothing was "
                          f"converted (convert another tag, or restore this one from a copy)") from None


def _malformed(path: Path, problem: str) -> ConfigError:
    return ConfigError(f"{path} is not a file of the earlier layout ({problem}); nothing was converted (convert "
                       f"another tag, or restore this one from a copy)")


def _entries(path: Path, saved, kinds: dict[str, type]) -> dict:
    """`saved` itself, once it is a dict whose entries `kinds` are there and of their types."""
    if not isinstance(saved, dict):
        raise _malformed(path, f"it holds a {type(saved).__name__}, not a dict")
    for key, kind in kinds.items():
        if key not in saved:
            raise _malformed(path, f"no {key!r} entry")
        if not isinstance(saved[key], kind):
            raise _malformed(path, f"its {key!r} entry is {_type_of(saved[key], kind)}")
    return saved


def _type_of(value, kind: type) -> str:
    return (f"a {type(value).__name__}, not a {kind.__name__}" if kind in (dict, list) else
            f"of type {type(value).__name__}, not {kind.__name__}")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _checked_model(path: Path, old) -> dict:
    """model.pt's content, checked against the earlier layout before anything is made of it."""
    _entries(path, old, {"module": dict, "engine": dict, "schedule": dict, "client": dict})
    if not all(isinstance(k, str) for k in old["module"]):
        raise _malformed(path, "its 'module' entry has a key that is not a parameter name")
    if not _is_count(old["engine"].get("steps")) or "health" not in old["engine"]:
        raise _malformed(path, "its 'engine' entry has no integer 'steps' or no 'health'")
    return old


def _checked_optim(path: Path, saved, shapes: dict[str, torch.Size]) -> dict:
    """An optim_rank*.pt's content, checked against the earlier layout and model.pt's tensors
    (`shapes`): every layout entry names one of them with its number of values, and every piece's
    state holds as many values as its range (a scalar: a step count), so nothing read is larger
    than the weights themselves."""
    _entries(path, saved, {"optimizer": str, "layout": list, "pieces": list})
    names = set()
    for entry in saved["layout"]:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], str)
                and _is_count(entry[1]) and _is_count(entry[2])):
            raise _malformed(path, f"layout entry {str(entry)[:80]} is not [name, offset, number of values]")
        name, _, numel = entry
        if name not in shapes:
            raise _malformed(path, f"its layout names {name[:80]!r}, which is no tensor of {LEGACY_FILE}")
        if numel != shapes[name].numel():
            raise _malformed(path, f"its layout gives {name!r} {numel} values, {LEGACY_FILE}'s tensor holds "
                                   f"{shapes[name].numel()}")
        if name in names:
            raise _malformed(path, f"its layout names {name!r} twice")
        names.add(name)
    for piece in saved["pieces"]:
        if not (isinstance(piece, dict) and _is_count(piece.get("start")) and _is_count(piece.get("end"))
                and piece["start"] <= piece["end"] and isinstance(piece.get("state"), dict)):
            raise _malformed(path, "a piece is not {start, end, state} with 0 <= start <= end")
        start, end = piece["start"], piece["end"]
        for key, values in piece["state"].items():
            if not (isinstance(key, str) and isinstance(values, torch.Tensor)
                    and (values.ndim == 0 or values.shape == (end - start,))):
                raise _malformed(path, f"state {str(key)[:80]!r} of its piece [{start}, {end}) is not a tensor of "
                                       f"{end - start} values")
    return saved


def _check_covered(tag_dir: Path, spans: dict[tuple[str, str], list[tuple[int, int]]], names: set[str],
                   shapes: dict[str, torch.Size]) -> None:
    """Every state (a key of the pieces) of every parameter of the layouts (`names`) is given by
    the pieces once, value for value (the flat buffers held every state of their whole range): a
    gap (a rank's file missing) would convert into zeros without a word."""
    keys = sorted({key for _, key in spans})
    for name, key in ((name, key) for name in sorted(names) for key in keys):
        ranges = sorted(spans.get((name, key), []))
        covered = sum(hi - lo for lo, hi in ranges)
        disjoint = all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
        if covered != shapes[name].numel() or not disjoint:
            raise ConfigError(f"{tag_dir}: the optim_rank*.pt files hold {covered} of the {shapes[name].numel()} "
                              f"values of {name}'s {key}{'' if disjoint else ', some more than once'}; nothing was "
                              f"converted (restore the tag's files from a copy)")


def _legacy_optimizer(tag_dir: Path, shapes: dict[str, torch.Size]) -> tuple[str, dict[str, torch.Tensor]]:
    """(the optimizer's class name, {"<name>/<key>": state tensor in the parameter's shape}) from
    every optim_rank*.pt: each piece covers a flat range of its file's layout {name: (offset, numel)}.
    The files are checked, and their pieces against the parameters, before any state is put together."""
    copies: list[tuple[str, str, int, int, torch.Tensor]] = []  # (name, key, lo, hi, values) in the parameter
    scalars: dict[tuple[str, str], torch.Tensor] = {}
    spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
    kinds, names = set(), set()
    for f in sorted(tag_dir.glob("optim_rank*.pt")):
        saved = _checked_optim(f, _read_legacy(f), shapes)
        kinds.add(saved["optimizer"])
        layout = {name: (offset, numel) for name, offset, numel in saved["layout"]}
        names.update(layout)
        for piece in saved["pieces"]:
            start, end = piece["start"], piece["end"]
            for name, (offset, numel) in layout.items():
                lo, hi = max(start, offset), min(end, offset + numel)
                if lo >= hi:
                    continue
                for key, values in piece["state"].items():
                    if values.ndim == 0:  # AdamW's step: the same in every piece
                        scalars[name, key] = values.clone()
                        continue
                    spans.setdefault((name, key), []).append((lo - offset, hi - offset))
                    copies.append((name, key, lo - offset, hi - offset, values[lo - start:hi - start]))
    if len(kinds) != 1:
        raise ConfigError(f"{tag_dir}: the optim_rank*.pt files hold {sorted(kinds) or 'no'} optimizer state")
    _check_covered(tag_dir, spans, names, shapes)
    flat: dict[tuple[str, str], torch.Tensor] = {}
    for name, key, lo, hi, values in copies:
        # fp32, as the engine's moments are (its optimizer runs on fp32 masters, and a tag's metadata
        # admits fp32 tensors only): 16-bit moments widen exactly
        whole = flat.setdefault((name, key), torch.zeros(shapes[name].numel(), dtype=torch.float32))
        whole[lo:hi] = values
    state = {f"{name}/{key}": v.view(shapes[name]) for (name, key), v in flat.items()}
    state.update({f"{name}/{key}": v for (name, key), v in scalars.items()})
    return kinds.pop(), state


def convert(tag_dir: Path) -> Path:
    """Convert one tag in place; returns it."""
    import torch.distributed.checkpoint as dcp

    problem = check_files(tag_dir)
    if problem is not None:
        raise ConfigError(f"{tag_dir} is not a complete checkpoint ({problem}); convert a complete tag")
    if not (tag_dir / LEGACY_FILE).is_file():
        raise ConfigError(f"{tag_dir} has no {LEGACY_FILE}: it is not a tag of the earlier layout "
                          f"(already converted, or not a checkpoint)")
    if (tag_dir / WEIGHTS_FILE).exists():
        raise ConfigError(f"{tag_dir} holds {WEIGHTS_FILE} beside {LEGACY_FILE}: it is of the engine's layout already "
                          f"(a conversion stopped before it removed the earlier files) and resumes as it is")
    old = _checked_model(tag_dir / LEGACY_FILE, _read_legacy(tag_dir / LEGACY_FILE))
    tensors = {k: v for k, v in old["module"].items() if isinstance(v, torch.Tensor)}
    extra = {k: v for k, v in old["module"].items() if not isinstance(v, torch.Tensor)}
    kind, optim = _legacy_optimizer(tag_dir, {k: v.shape for k, v in tensors.items()})
    # Each file is written under a temporary name and renamed once all are complete, the weights
    # last: their name makes the tag one of the engine's layout, so it never is with a file missing.
    with (written_whole(tag_dir / WEIGHTS_FILE) as weights, written_whole(tag_dir / STATE_FILE) as state,
          written_whole(tag_dir / OPTIM_DIR) as optim_dir):
        write_weights(weights, tensors, write=True)
        with single_process_quiet():  # one process, no process group
            dcp.save(optim, checkpoint_id=optim_dir, no_dist=True)
        torch.save({"engine": {**old["engine"], "schedule": old["schedule"]}, "extra": extra, "optimizer": kind,
                    "client": old["client"]}, state)
    meta = json.loads((tag_dir / COMPLETE).read_text())
    old_files = [LEGACY_FILE, *(f.name for f in tag_dir.glob("optim_rank*.pt"))]
    written = [f for f in sorted(tag_dir.rglob("*")) if f.is_file() and f.name != COMPLETE and f.name not in old_files]
    meta["files"] = {str(f.relative_to(tag_dir)): f.stat().st_size for f in written}
    # as a save records them: a resume then finds damaged bytes of the converted files, not only a wrong size
    meta["crc32"] = {str(f.relative_to(tag_dir)): crc32(f) for f in written}
    tmp = tag_dir / f".{COMPLETE}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, tag_dir / COMPLETE)
    for name in old_files:
        (tag_dir / name).unlink()
    return tag_dir


def tags_in(path: Path) -> list[Path]:
    """A tag folder itself, or every complete tag of the earlier layout under a run / checkpoints folder."""
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a tag folder or a run folder")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file, not a folder; give a tag folder or a run folder")
    if (path / COMPLETE).is_file():
        return [path]
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = sorted(p for p in root.glob("step*") if TAG_RE.match(p.name) and (p / LEGACY_FILE).is_file())
    if not found:
        raise ConfigError(f"{path} holds no checkpoint tag of the earlier layout (a step* folder with {LEGACY_FILE} "
                          f"and {COMPLETE}); give a tag folder or a run folder")
    return found


def main(argv: list[str] | None = None) -> list[Path]:
    parser = Parser(prog="python -m train.convert_checkpoint", usage="%(prog)s [-h] TAG [TAG ...]",
                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # "*", the count checked below: with "+", argparse names the missing TAG before an unknown option
    parser.add_argument("paths", nargs="*", metavar="TAG", help="a tag folder, or a run folder: all its tags")
    args, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not args.paths:
        parser.error("the following arguments are required: TAG")
    tags = [tag for arg in args.paths for tag in tags_in(Path(arg))]  # every path checked before any tag changes
    done = []
    for tag in tags:
        done.append(convert(tag))
        print(f"converted {tag}")
    return done


if __name__ == "__main__":
    cli(main)
