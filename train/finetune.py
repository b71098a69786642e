"""Fine-tuning with the MAE protocol: the pretraining entry point with the finetune objective and
the recipe's defaults for ViT-B (MAE, He et al. 2022, arXiv:2111.06377, appendix A.2); any option overrides them (ViT-L: blr 1e-3,
layer_decay 0.75, 50 epochs, drop path 0.2).

    deepspeed --num_gpus 8 train/finetune.py --ds_config ds_configs/<file>.json \\
        --model.name vit_base_patch16 --model.init_from runs/mae_vitb/encoder.safetensors \\
        --finetune.num_classes 1000 --data.train_index shards/in1k/train.json \\
        --data.eval_index shards/in1k/val.json --output_dir runs/ft_vitb

--model.init_from takes an exported encoder, an official MAE or a timm checkpoint; without it the
same architecture trains from scratch (the control). The fine-tuned model (with its head) is
exported to timm at the end.
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

# AdamW (0.9, 0.999), blr 5e-4, wd 0.05, layer decay 0.65, 100 epochs with 5 warmup, drop path
# 0.1, global average pool + fc_norm, RandAug(9, 0.5) + random erasing 0.25, mixup 0.8,
# cutmix 1.0, label smoothing 0.1, RandomResizedCrop(scale 0.08-1) + flip. The whole encoder trains,
# pos_embed included (layer id 0, no weight decay: model/objectives/finetune.py).
RECIPE = ["--config", str(Path(__file__).resolve().parent / "configs" / "finetune" / "mae_recipe.json")]


def main(argv: list[str] | None = None) -> Path:
    return command.main(RECIPE + (sys.argv[1:] if argv is None else argv), command="finetune", usage=__doc__)


if __name__ == "__main__":
    run_script(main)
