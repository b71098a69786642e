"""DeepSpeed's own engine training our objective: the step this codebase ran before train/engine/,
kept as a baseline to measure the engine against (tools/census.py --deepspeed, the GPU kit's bench).

The same objective, parameter groups, fused AdamW and schedule as train/run/build.py's, handed to
`deepspeed.initialize` with the run's batch sizes, ZeRO stage, precision and clipping and the
bucket settings the shipped files had for it (`old_defaults`). Its loop is the plain one: per micro-batch forward, engine.backward,
engine.step; the objective's after-step hook after the last.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from train.config.options import PretrainConfig, section
from train.config.plan import build_encoder
from train.engine.optim import WarmupCosineSchedule, build_optimizer, build_param_groups
from train.run.loop import no_phases


def old_defaults(ds_config: dict) -> dict:
    """`ds_config` with the DeepSpeed settings the shipped files carried for DeepSpeed's engine:
    overlapped, bucketed gradient reduction (50M elements), contiguous gradients, its throughput
    timer off."""
    zero = {"stage": ds_config.get("zero_optimization", {}).get("stage", 0)}
    if zero["stage"] in (1, 2):
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=50_000_000,
                    allgather_bucket_size=50_000_000)
    elif zero["stage"] == 3:
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=50_000_000,
                    stage3_prefetch_bucket_size=50_000_000, stage3_param_persistence_threshold=100_000)
    return {**{k: v for k, v in ds_config.items() if k != "activation_checkpointing"}, "zero_optimization": zero,
            "wall_clock_breakdown": False, "timers": {"throughput": {"enabled": False}}, "steps_per_print": 10**9}


class DeepSpeedStep:
    """One optimizer step of DeepSpeed's engine per call; `phase(name)` marks data, forward,
    backward, step and hook for the census."""

    def __init__(self, cfg: PretrainConfig, ds_config: dict, data, device: torch.device, peak_lr: float,
                 arch: dict | None = None):
        import deepspeed

        from model.objectives import build_objective

        torch.manual_seed(cfg.seed)
        objective = build_objective(cfg.objective, build_encoder(cfg, arch), section(cfg))
        groups, _ = build_param_groups(objective, cfg.optim.weight_decay, cfg.optim.layer_decay)
        optimizer = build_optimizer(groups, cfg.optim)
        schedule = WarmupCosineSchedule(optimizer, peak_lr, cfg.optim.min_lr, 1, 10**6)
        self.engine, _, _, _ = deepspeed.initialize(model=objective, optimizer=optimizer, lr_scheduler=schedule,
                                                    config=old_defaults(ds_config))
        self.dtype = (torch.bfloat16 if self.engine.bfloat16_enabled() else
                      torch.float16 if self.engine.fp16_enabled() else torch.float32)
        self.data, self.device = data, device
        self.accum = self.engine.gradient_accumulation_steps()

    def __call__(self, phase: Callable[[str], contextlib.AbstractContextManager] = no_phases) -> None:
        batches = []
        for _ in range(self.accum):
            with phase("data"):
                batch = {k: v.to(self.device, non_blocking=True) for k, v in next(self.data).items()}
                batch["image"] = batch["image"].to(self.dtype)
                batches.append(batch)
            with phase("forward"):
                loss = self.engine(batch)["loss"]
            with phase("backward"):
                self.engine.backward(loss)
            with phase("step"):
                self.engine.step()
        with phase("hook"):
            self.engine.module.after_optimizer_step(self.engine.get_lr()[0], batches)
