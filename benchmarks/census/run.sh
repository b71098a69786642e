#!/usr/bin/env bash
# The kernel-launch and host-sync census behind docs/PERFORMANCE.md, on CPU (tools/census.py): each
# command names its record in benchmarks/results/ with --json (the committed records; without it a census writes into
# runs/census/). Run from the repository root:
#   bash benchmarks/census/run.sh            # counts (deterministic; ~10 min on 2 cores)
#   bash benchmarks/census/run.sh host_time  # host time per step, ours vs the baselines, 1 and 2 ranks (a quiet machine)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
RESULTS=benchmarks/results
H100=ds_configs/vit_b_8xh100_bf16_zero1.json
A100_Z2=ds_configs/vit_b_8xa100_bf16_zero2.json
V100=ds_configs/vit_b_8xv100_fp16_zero1.json
census() { name=$1; shift; "$PY" -m tools.census "$@" --json "$RESULTS/census_$name.json"; }

if [ "${1:-counts}" = counts ]; then
  # MAE ViT-B/16 at 224 px, micro-batch 2: ours, the plain-PyTorch loop (fused / foreach AdamW), DeepSpeed's engine
  census mae_vit_b16_h100_zero1_micro2 --ds_config $H100 --micro 2 --model.name vit_base_patch16 --deepspeed
  census mae_vit_b16_h100_zero1_micro2_foreach --ds_config $H100 --micro 2 --model.name vit_base_patch16 --baseline foreach
  census mae_vit_b16_a100_zero2_micro2 --ds_config $A100_Z2 --micro 2 --model.name vit_base_patch16 --deepspeed
  # (no --deepspeed: DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels for the CPU)
  census mae_vit_b16_v100_fp16_zero1_micro2 --ds_config $V100 --micro 2 --model.name vit_base_patch16
  # the other methods' ViT-B presets (micro-batch 2; MixedAE 4: its mixing groups), ours and DeepSpeed's engine
  census mixedae_vit_b16_h100_zero1_micro4 --ds_config $H100 --micro 4 --config train/configs/mixedae/vit_b.json --deepspeed --baseline none
  census maeplus_rpe_vit_b16_h100_zero1_micro2 --ds_config $H100 --micro 2 --config train/configs/maeplus/vit_b.json \
    --config train/configs/maeplus/variants/maeplus_rpe.json --deepspeed --baseline none
  census adpe_rpe_coord_vit_b16_h100_zero1_micro2 --ds_config $H100 --micro 2 --config train/configs/maeplus/vit_b.json \
    --config train/configs/maeplus/variants/rpe_coord.json --deepspeed --baseline none
  # two CPU ranks (gloo), every ZeRO stage: DDP (0) and FSDP2 (1-3), where each collective is issued
  for stage in 0 1 2 3; do
    "$PY" -m deepspeed.launcher.runner --num_gpus 2 tools/census.py --ds_config $H100 --micro 2 --zero_stage $stage \
      --model.name vit_base_patch16 --json "$RESULTS/census_mae_vit_b16_h100_zero${stage}_micro2_2ranks.json"
  done
else
  # host time per step where compute is negligible (ViT-B depth and heads, width 48, 32 px: 4 patches):
  # 30 alternating rounds, 1 thread; one rank, then two (ZeRO-0 on DDP, ZeRO-1 on FSDP2)
  census mae_vit_b16_width48_32px_host_time --ds_config $H100 --micro 2 --model.name vit_base_patch16 --width 48 \
    --model.img_size 32 --host_time 30 --deepspeed
  for stage in 0 1; do
    "$PY" -m deepspeed.launcher.runner --num_gpus 2 tools/census.py --ds_config $H100 --micro 2 --zero_stage $stage \
      --model.name vit_base_patch16 --width 48 --model.img_size 32 --host_time 30 \
      --json "$RESULTS/census_mae_vit_b16_width48_32px_host_time_zero${stage}_2ranks.json"
  done
fi
