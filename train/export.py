"""Export a pretrained encoder to timm: `<out>.safetensors` (fp32 weights, timm names) and
`<out>.json` (the timm VisionTransformer kwargs that rebuild it).

    python -m train.export --checkpoint runs/x [--out runs/x/encoder.safetensors]
    python -m train.export --checkpoint runs/x/checkpoints/step00000468   # -> runs/x/encoder_step00000468.*

--checkpoint takes a run folder (its latest complete checkpoint) or one checkpoint tag folder.
The command prints, and `encoder.json` holds under "timm_snippet", the lines that rebuild the
encoder in timm and load it strictly, e.g. for a pretrained ViT-B/16 at 224 px (no classifier:
timm's default num_classes=1000 would add a `head` the file does not have):
    model = timm.create_model("vit_base_patch16_224", num_classes=0, global_pool="token", in_chans=3)
    model.load_state_dict(safetensors.torch.load_file("runs/x/encoder.safetensors"))  # strict
Other sizes build timm's VisionTransformer from the recorded kwargs ("timm_kwargs"); timm
backbones (model.name timm/<name>) create their timm model with num_classes=0. Export checks the
snippet's model against the file's names and shapes; an encoder timm cannot hold (iRPE) gets none.

    python -m train.export --checkpoint runs/x --format transformers [--out runs/x/transformers]

writes a Hugging Face transformers folder instead (train/weights/transformers.py): an MAE run as
ViTMAEForPreTraining, a fine-tuned one as ViTForImageClassification, other encoders as ViTModel.

Without --out, a run folder's export is the run's own, <run>/encoder.safetensors + .json (what every
run writes at its end) or <run>/transformers; a tag folder's is named after the tag, beside the
run's: <run>/encoder_<tag>.safetensors + .json or <run>/transformers_<tag>, so an earlier
checkpoint's export never takes the place of the run's final encoder. A default output of a run
folder is replaced unasked only by the export of the same step (what its .json, or the transformers
folder's README.md, records); one of another step, or of none recorded, only with --overwrite.
Above a tag kept elsewhere the default names may be anyone's files: replaced only with --overwrite.
Files an --out names that exist already (the weights, their .json, a transformers folder that is
not empty) are replaced only with --overwrite; an --out inside the checkpoint (or, for a folder,
holding it) is refused even then. Everything is checked before the checkpoint's weights are read,
and written under temporary names renamed into place once complete.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import contextlib
import importlib.util
import json
import logging
import re
from pathlib import Path

from data.cli import Parser
from model.weights_reader import WeightsFileError
from train.config.errors import ConfigError
from train.engine.checkpoint import read_meta
from train.weights.export import (  # noqa: F401  (also what scripts import from train.export)
    check_outputs,
    encoder_state,
    export_checkpoint,
    export_transformers,
    find_checkpoint,
    in_run_folder,
    load_timm_encoder,
    pretrained_state,
    timm_loading,
)


def default_output(checkpoint: str, tag_dir: Path, transformers: bool) -> Path:
    """Where an export goes without --out: a run folder's to the run's own name (encoder.safetensors,
    which the run writes at its end; transformers), a tag folder's to a name of its own beside it
    (encoder_step00000468.safetensors; transformers_step00000468), so exporting an earlier
    checkpoint never replaces the run's final encoder."""
    tag = f"_{tag_dir.name}" if Path(checkpoint).resolve() == tag_dir.resolve() else ""
    return tag_dir.parent.parent / (f"transformers{tag}" if transformers else f"encoder{tag}.safetensors")


MAX_DESCRIPTION_BYTES = 1 << 20  # an export's encoder.json / README.md is a few KiB: a larger file is not one


def exported_step(out: Path, folder: bool) -> int | None:
    """The optimizer step an earlier export at `out` was taken from: its .json's "step", or the
    "(optimizer step N)" of a transformers folder's README.md; None when neither records one."""
    description = out / "README.md" if folder else out.with_suffix(".json")
    if not description.is_file() or description.stat().st_size > MAX_DESCRIPTION_BYTES:  # a FIFO is never opened
        return None
    try:
        text = description.read_text()
        if folder:
            found = re.search(r"\(optimizer step (\d+)\)", text)
            return int(found.group(1)) if found else None
        step = json.loads(text).get("step")
    except (OSError, ValueError, AttributeError, RecursionError):  # unreadable, not JSON, not an object
        return None
    return step if type(step) is int else None


def check_same_step(out: Path, tag_dir: Path, folder: bool) -> None:
    """A default output of a run folder that exists already is replaced unasked only by the export
    of the same step: ConfigError naming both steps and the fix when it holds another (or none)."""
    existing = [out] if folder else [out, out.with_suffix(".json")]
    if not any(p.exists() or p.is_symlink() for p in existing) or (folder and out.is_dir() and not any(out.iterdir())):
        return
    try:
        step = read_meta(tag_dir)["step"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--checkpoint {tag_dir}: its complete.json says no step ({e}); export another of the "
                          f"run's checkpoints (its checkpoints/step* folders)") from None
    earlier = exported_step(out, folder)
    if earlier != step:
        held = f"the export of step {earlier}" if earlier is not None else "an export of no recorded step"
        raise ConfigError(f"{out} holds {held}, not of the checkpoint {tag_dir} (step {step}): pass --overwrite to "
                          f"replace it, or give --out another path")


# transformers' model code imports torchao (when installed), whose import registers two Enums
# (KernelPreference, ScaleCalculationMode) as pytree constants: torch >= 2.10 logs each as deprecated,
# on torch.utils._pytree's logger (not through `warnings`), before anything of the export is said
ENUM_CONSTANT_DEPRECATION = "Calling register_constant() on Enum subclasses is deprecated"


class _WithoutEnumConstantDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return ENUM_CONSTANT_DEPRECATION not in record.getMessage()


def import_transformers_quietly() -> None:
    """Import transformers' model code (and with it torchao) without those two deprecation lines;
    every other record of that logger, and every warning, still shows. Nothing when transformers is
    missing or broken: the export then says so as it would."""
    if importlib.util.find_spec("transformers") is None:
        return
    pytree_log, quiet = logging.getLogger("torch.utils._pytree"), _WithoutEnumConstantDeprecation()
    pytree_log.addFilter(quiet)
    try:
        with contextlib.suppress(ImportError):
            import transformers.modeling_utils  # noqa: F401
    finally:
        pytree_log.removeFilter(quiet)


def main(argv: list[str] | None = None) -> Path:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="run folder or checkpoint tag folder")
    parser.add_argument("--out", help="output .safetensors (default: <run folder>/encoder.safetensors for a run "
                                      "folder, <run folder>/encoder_<tag>.safetensors for a tag folder); with "
                                      "--format transformers a folder (default: <run folder>/transformers, or "
                                      "<run folder>/transformers_<tag>)")
    parser.add_argument("--format", choices=("timm", "transformers"), default="timm",
                        help="timm safetensors + encoder.json (default), or a Hugging Face transformers folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing files --out names (a run folder's default output is replaced "
                             "unasked by the export of the same step only)")
    args = parser.parse_args(argv)
    tag_dir = find_checkpoint(args.checkpoint, "--checkpoint")
    transformers = args.format == "transformers"
    default = default_output(args.checkpoint, tag_dir, transformers)
    out = Path(args.out) if args.out else default
    if not args.overwrite and in_run_folder(tag_dir) and out.resolve() == default.resolve():
        check_same_step(out, tag_dir, transformers)
    check_outputs(out, default, tag_dir, args.overwrite, folder=transformers)
    if transformers:
        import_transformers_quietly()
    try:
        if transformers:
            from train.weights.transformers import loading_lines

            out, name = export_transformers(tag_dir, out)
        else:
            path = export_checkpoint(tag_dir, out)
    except WeightsFileError as e:
        raise ConfigError(f"--checkpoint {args.checkpoint}: {e}; export another of the run's checkpoints (its "
                          f"checkpoints/step* folders)") from None
    except ValueError as e:  # no encoder in the checkpoint; an encoder transformers' ViT cannot hold
        raise ConfigError(f"--checkpoint {args.checkpoint}: {e}") from None
    if transformers:
        print(f"wrote {out} ({name}) from {tag_dir}")
        print(f"load it in transformers:\n{loading_lines(name, out)}")
        return out
    print(f"wrote {path} and {path.with_suffix('.json')} from {tag_dir}")
    snippet = json.loads(path.with_suffix(".json").read_text())["timm_snippet"]
    print(f"load it in timm (strict):\n{snippet}" if snippet else
          "this encoder has iRPE tables, which timm's models lack: load it with train.evaluate.load_encoder")
    return path


if __name__ == "__main__":
    from train.run.cli import cli

    cli(main)
