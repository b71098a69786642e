"""Write the DeepSpeed config matrix: `python ds_configs/generate.py` (a test checks the files match);
`--check` writes nothing and lists the files that differ from the generator's output.

Pretraining, global batch 4096 (MAE, MixedAE, MAE+/AdPE):
    vit_{b,l,h}_8x{v100_fp16, a100_bf16, h100_bf16}_zero{1,2}.json
    vit_h_8x..._zero3_actckpt.json   ZeRO-3 + activation checkpointing
Global batch 256 (MLO-MAE, energy), fine-tuning 1024 (ViT-B and ViT-L):
    {mlomae,energy}_vit_b_8x..._zero1.json, finetune_vit_{b,l}_8x..._zero1.json

Each file gives train_batch_size and train_micro_batch_size_per_gpu only: the accumulation is
derived from the world size, so the same file serves 8 GPUs, 2 nodes (16) or a resume on another
world size, always at the method's global batch. The micro-batch is the largest power of two at
most MARGIN x the largest micro-batch the memory estimate (train/estimate/memory.py) lets the hungriest
method of the file's group fit on the GPU (HUNGRIEST; AdPE with RPE offsets: every token of
four crops, and iRPE in every block), and at most the global batch over 16 GPUs, so that every
file serves one node or two. MLO-MAE's is the global batch over 8 GPUs (RANKS): its levels II
and III step on one micro-batch per rank, so on one node they see the paper's 256 images (Table
11), as with no accumulation; tests/train/estimate/test_dry_run.py recomputes it. `python -m train.pretrain --dry-run
--ds_config <file> [--config <preset>]` prints the estimate for a method and the largest
micro-batch that fits. V100 has no bf16: fp16 with dynamic loss scaling. Every file states
gradient_clipping 0.0 (the MAE recipes clip nothing).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GPUS = {"v100": "fp16", "a100": "bf16", "h100": "bf16"}
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
        "min_loss_scale": 1}
MARGIN = 0.75  # of the largest micro-batch the estimate fits: room for what it leaves out
# (group, model) -> micro-batch per GPU: the rule of the module docstring, as tests/train/estimate/test_dry_run.py computes it
MICRO = {
    ("pretrain", "b"): {"v100": 128, "a100": 256, "h100": 256},
    ("pretrain", "l"): {"v100": 64, "a100": 256, "h100": 256},
    ("pretrain", "h"): {"v100": 32, "a100": 128, "h100": 128},
    ("pretrain_actckpt", "h"): {"v100": 256, "a100": 256, "h100": 256},
    ("mlomae", "b"): {"v100": 32, "a100": 32, "h100": 32},
    ("energy", "b"): {"v100": 16, "a100": 16, "h100": 16},
    ("finetune", "b"): {"v100": 64, "a100": 64, "h100": 64},
    ("finetune", "l"): {"v100": 64, "a100": 64, "h100": 64},
}
GLOBAL = {"pretrain": 4096, "pretrain_actckpt": 4096, "mlomae": 256, "energy": 256, "finetune": 1024}
# the most ranks a group's file serves at its global batch (its micro-batch is at most GLOBAL / RANKS)
RANKS = {"mlomae": 8}
SERVED = 16  # every other group: one node of 8 GPUs or two
# the method of each group whose memory decides the micro-batch: run options (train/configs presets)
HUNGRIEST = {
    "pretrain": ["--config", "train/configs/maeplus/vit_b.json", "--config", "train/configs/maeplus/variants/rpe_coord.json"],
    "pretrain_actckpt": ["--config", "train/configs/maeplus/vit_b.json", "--config",
                         "train/configs/maeplus/variants/rpe_coord.json"],
    "mlomae": ["--config", "train/configs/mlomae/vit_b.json"],
    "energy": ["--config", "train/configs/energy/vit_b.json"],
    "finetune": ["--objective", "finetune", "--finetune.num_classes", "1000", "--model.global_pool", "avg"],
}


def config(group: str, model: str, gpu: str, stage: int, micro: int | None = None) -> dict:
    prec = GPUS[gpu]
    out = {"train_batch_size": GLOBAL[group], "train_micro_batch_size_per_gpu": micro or MICRO[group, model][gpu],
           "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
           "bf16": {"enabled": prec == "bf16"}, "fp16": FP16 if prec == "fp16" else {"enabled": False}}
    if group == "pretrain_actckpt":
        out["activation_checkpointing"] = {}
    return out


def matrix() -> dict[str, dict]:
    files = {}
    for gpu, prec in GPUS.items():
        for model in ("b", "l", "h"):
            for stage in (1, 2):
                files[f"vit_{model}_8x{gpu}_{prec}_zero{stage}.json"] = config("pretrain", model, gpu, stage)
        files[f"vit_h_8x{gpu}_{prec}_zero3_actckpt.json"] = config("pretrain_actckpt", "h", gpu, 3)
        for group in ("mlomae", "energy"):
            files[f"{group}_vit_b_8x{gpu}_{prec}_zero1.json"] = config(group, "b", gpu, 1)
        for model in ("b", "l"):
            files[f"finetune_vit_{model}_8x{gpu}_{prec}_zero1.json"] = config("finetune", model, gpu, 1)
    return files


def render(cfg: dict) -> str:
    return json.dumps(cfg, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; list the files that differ and exit 1")
    a = p.parse_args(argv)
    files = matrix()
    differ = [name for name, cfg in files.items()
              if not (HERE / name).is_file() or (HERE / name).read_text() != render(cfg)]
    if a.check:
        print(f"{len(differ)} of {len(files)} files differ from the generator's output" +
              (f": {', '.join(differ)}" if differ else ""))
        return 1 if differ else 0
    for name in differ:
        (HERE / name).write_text(render(files[name]))
    print(f"wrote {len(differ)} of {len(files)} files to {HERE}" + (f": {', '.join(differ)}" if differ else
                                                                      " (the others were already its output)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
