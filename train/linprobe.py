"""Linear probe with the MAE protocol: the pretraining entry point with the linprobe objective and
the recipe's defaults (MAE, He et al. 2022, arXiv:2111.06377, appendix A.3). Any option can still be overridden.

    python -m train.linprobe --ds_config ds_configs/<stage-0 file>.json \\
        --model.name vit_base_patch16 --model.init_from runs/mae_vitb/encoder.safetensors \\
        --data.train_index shards/in1k/train.json --data.eval_index shards/in1k/val.json \\
        --linprobe.num_classes 1000 --output_dir runs/linprobe_vitb

Without --model.init_from the same architecture is probed at random init (the control).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

if __name__ == "__main__":  # before the heavy imports below: Ctrl-C / kill in start-up end it at once, quietly
    from train.run import early_signals

    early_signals.at_script_start()

import sys
from pathlib import Path

from train.run import command
from train.run.cli import run_script

# cls feature + BN(no affine) + Linear, LARS (momentum 0.9, trust 0.001), no weight decay,
# blr 0.1 (lr = blr x batch / 256; the recipe's batch is 16384), 90 epochs with 10 warmup,
# RandomResizedCrop(scale 0.08-1) + flip; the encoder is unchanged, so nothing is exported.
RECIPE = ["--config", str(Path(__file__).resolve().parent / "configs" / "linprobe" / "mae_recipe.json")]


def main(argv: list[str] | None = None) -> Path:
    return command.main(RECIPE + (sys.argv[1:] if argv is None else argv), command="linprobe", usage=__doc__)


if __name__ == "__main__":
    run_script(main)
