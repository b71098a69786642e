"""The training engine: data parallel with ZeRO stages 0-3, fp32 / bf16 / fp16, gradient
accumulation and clipping, as a ds_config describes them, on PyTorch's own distributed engines
with one lean step on top.

    core.py        the step every engine shares: fused AdamW with grad_scale / found_inf, clipping
                   folded into the unscaling, fp16's loss scale and the skip counters on the device,
                   no host read
    replicated.py  whole weights on every rank: one rank without a wrapper (any stage), or ZeRO-0
                   on several ranks through DDP (bucketed all-reduce inside the backward)
    sharded.py     ZeRO-1/2/3 on several ranks through FSDP2 (one unit per transformer block + the
                   root; reduce-scatter inside the backward, all-gathers prefetched)
    state_files.py checkpoints by name, the same from every engine, world size and stage
    config.py      what the engine reads from the ds_config
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from train.engine.config import DTYPES, EngineConfig
from train.engine.core import EngineCore, adamw_state

__all__ = ["DTYPES", "EngineConfig", "EngineCore", "adamw_state", "build"]


def build(module: nn.Module, groups: list[dict], make_optimizer, make_schedule, cfg: EngineConfig,
          device: torch.device) -> EngineCore:
    """The engine for this world size and ZeRO stage: one rank or ZeRO-0 -> replicated (no
    wrapper / DDP); ZeRO-1-3 on several ranks -> FSDP2."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1 and cfg.stage >= 1:
        from train.engine.sharded import ShardedEngine

        return ShardedEngine(module, groups, make_optimizer, make_schedule, cfg, device)
    from train.engine.replicated import ReplicatedEngine

    return ReplicatedEngine(module, groups, make_optimizer, make_schedule, cfg, device)
