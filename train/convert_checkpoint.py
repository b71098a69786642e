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


def _legacy_optimizer(tag_dir: Path, shapes: dict[str, torch.Size]) -> tuple[str, dict[str, torch.Tensor]]:
    """(the optimizer's class name, {"<name>/<key>": state tensor in the parameter's shape}) from
    every optim_rank*.pt: each piece covers a flat range of its file's layout {name: (offset, numel)}."""
    flat: dict[tuple[str, str], torch.Tensor] = {}
    scalars: dict[tuple[str, str], torch.Tensor] = {}
    kinds = set()
    for f in sorted(tag_dir.glob("optim_rank*.pt")):
        saved = _read_legacy(f)
        kinds.add(saved["optimizer"])
        layout = {name: (offset, numel) for name, offset, numel in saved["layout"]}
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
                    whole = flat.setdefault((name, key), torch.zeros(numel, dtype=values.dtype))
                    whole[lo - offset:hi - offset] = values[lo - start:hi - start]
    if len(kinds) != 1:
        raise ConfigError(f"{tag_dir}: the optim_rank*.pt files hold {sorted(kinds) or 'no'} optimizer state")
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
    old = _read_legacy(tag_dir / LEGACY_FILE)
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
