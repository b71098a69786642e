"""Write the DeepSpeed config matrix: `python ds_configs/generate.py` (a test checks the files match).

Pretraining, global batch 4096 (MAE, MixedAE, MAE+/AdPE):
    vit_{b,l,h}_8x{v100_fp16, a100_bf16, h100_bf16}_zero{1,2}.json
    vit_h_8x..._zero3_actckpt.json   ZeRO-3 + activation checkpointing
Global batch 256 (MLO-MAE, energy), fine-tuning 1024 (ViT-B and ViT-L):
    {mlomae,energy}_vit_b_8x..._zero1.json, finetune_vit_{b,l}_8x..._zero1.json

Each file gives train_batch_size and train_micro_batch_size_per_gpu only: the accumulation is
derived from the world size, so the same file serves 8 GPUs, 2 nodes (16) or a resume on another
world size, always at the method's global batch. Micro-batches are sized by the memory estimate
(train/memory.py) of the hungriest method of the file's group (MAE+: every token of four crops
enters the encoder) at about half the GPU, since the estimate leaves out temporaries; none has
been measured on these GPUs yet. `python -m train.pretrain --dry-run --ds_config <file>
[--config <preset>]` prints the estimate for a method and the largest micro-batch that fits.
V100 has no bf16: fp16 with dynamic loss scaling. Every file states gradient_clipping 0.0 (the
MAE recipes clip nothing; DeepSpeed >= 0.19.3 clips at 1.0 when the key is missing) and turns
DeepSpeed's throughput timer off (`timers.throughput.enabled`, on by default: it synchronizes the
device at the start and end of every micro-batch, deepspeed/utils/timer.py; the loop measures
throughput itself at log steps).
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GPUS = {"v100": "fp16", "a100": "bf16", "h100": "bf16"}
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
        "min_loss_scale": 1}
# (group, model) -> micro-batch per GPU
MICRO = {
    ("pretrain", "b"): {"v100": 128, "a100": 256, "h100": 256},
    ("pretrain", "l"): {"v100": 64, "a100": 128, "h100": 128},
    ("pretrain", "h"): {"v100": 32, "a100": 64, "h100": 64},
    ("pretrain_actckpt", "h"): {"v100": 64, "a100": 128, "h100": 128},
    ("mlomae", "b"): {"v100": 32, "a100": 32, "h100": 32},
    ("energy", "b"): {"v100": 16, "a100": 32, "h100": 32},
    ("finetune", "b"): {"v100": 64, "a100": 128, "h100": 128},
    ("finetune", "l"): {"v100": 32, "a100": 64, "h100": 64},
}
GLOBAL = {"pretrain": 4096, "pretrain_actckpt": 4096, "mlomae": 256, "energy": 256, "finetune": 1024}
NO_THROUGHPUT_TIMER = {"throughput": {"enabled": False}}  # two device syncs per micro-batch otherwise
BUCKET = {"b": 50_000_000, "l": 100_000_000, "h": 100_000_000}  # elements per reduce / allgather bucket


def config(group: str, model: str, gpu: str, stage: int) -> dict:
    prec = GPUS[gpu]
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": BUCKET[model]}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=BUCKET[model], stage3_param_persistence_threshold=100_000,
                    stage3_gather_16bit_weights_on_model_save=False)
    else:
        zero["allgather_bucket_size"] = BUCKET[model]
    out = {"train_batch_size": GLOBAL[group], "train_micro_batch_size_per_gpu": MICRO[group, model][gpu],
           "gradient_clipping": 0.0, "zero_optimization": zero,
           "bf16": {"enabled": prec == "bf16"}, "fp16": FP16 if prec == "fp16" else {"enabled": False},
           "wall_clock_breakdown": False, "timers": NO_THROUGHPUT_TIMER}
    if group == "pretrain_actckpt":
        out["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False}
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


def main() -> None:
    for name, cfg in matrix().items():
        (HERE / name).write_text(render(cfg))
    print(f"wrote {len(matrix())} files to {HERE}")


if __name__ == "__main__":
    main()
