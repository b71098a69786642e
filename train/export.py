"""Export a pretrained encoder to timm: `<out>.safetensors` (fp32 weights, timm names) and
`<out>.json` (the timm VisionTransformer kwargs that rebuild it).

    python -m train.export --checkpoint runs/x [--out runs/x/encoder.safetensors]

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

The default outputs are the run folder's own export, which every run also writes at its end: they
are replaced (for a tag of a run folder, <run>/checkpoints/<tag>; above a tag kept elsewhere the
same names are anyone's files, replaced only with --overwrite). Files an --out names that exist
already (the weights, their .json, a transformers folder that is not empty) are replaced only with
--overwrite; an --out inside the checkpoint (or, for a folder, holding it) is refused even then.
Everything is checked before the checkpoint is read, and written under temporary names renamed
into place once complete.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
from pathlib import Path

from data.cli import Parser
from model.weights_reader import WeightsFileError
from train.config.errors import ConfigError
from train.weights.export import (  # noqa: F401  (also what scripts import from train.export)
    check_outputs,
    encoder_state,
    export_checkpoint,
    export_transformers,
    find_checkpoint,
    load_timm_encoder,
    pretrained_state,
    timm_loading,
)


def main(argv: list[str] | None = None) -> Path:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="run folder or checkpoint tag folder")
    parser.add_argument("--out", help="output .safetensors (default: <run folder>/encoder.safetensors); with "
                                      "--format transformers a folder (default: <run folder>/transformers)")
    parser.add_argument("--format", choices=("timm", "transformers"), default="timm",
                        help="timm safetensors + encoder.json (default), or a Hugging Face transformers folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing files --out names (the run folder's own export, the default, is "
                             "always replaced)")
    args = parser.parse_args(argv)
    tag_dir = find_checkpoint(args.checkpoint, "--checkpoint")
    transformers = args.format == "transformers"
    default = tag_dir.parent.parent / ("transformers" if transformers else "encoder.safetensors")
    out = Path(args.out) if args.out else default
    check_outputs(out, default, tag_dir, args.overwrite, folder=transformers)
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
