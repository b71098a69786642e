"""The engine: one optimizer step on one rank, DDP (ZeRO-0) or FSDP2 (ZeRO 1-3), as a ds_config
describes it, the process group it runs in, and its state on disk. Imports train/config/ only.

    core.py            the step every engine shares: fused AdamW with grad_scale / found_inf,
                       clipping folded into the unscaling, fp16's loss scale and the skip counters
                       on the device, no host read
    replicated.py      whole weights on every rank: one rank without a wrapper (any stage), or
                       ZeRO-0 on several ranks through DDP (bucketed all-reduce inside the backward)
    sharded.py         ZeRO-1/2/3 on several ranks through FSDP2 (one unit per transformer block +
                       the root; reduce-scatter inside the backward, all-gathers prefetched)
    config.py          what the engine reads from the ds_config
    optim.py           parameter groups (decay, layer decay), AdamW / LARS, the warmup-cosine schedule
    loss_scale.py      fp16's dynamic loss scale, on the device
    nonfinite.py       skipped non-finite steps: their counters and the rule that stops a run
    execution.py       how the blocks execute: recomputed (activation checkpointing), compiled
                       (run.compile), replayed as CUDA graphs
    distributed.py     the process group (NCCL / gloo) and its rank environment; slurm_env.py
                       derives it from a Slurm task
    state_files.py     the engine's files in a checkpoint tag, by name, the same from every engine,
                       world size and stage; checkpoint.py the tag around them: rank RNGs,
                       complete.json, atomic save, the checks a tag passes before it is trusted;
                       tag_reader.py reads a tag's optimizer metadata and torch.save files
                       without executing anything
    errors.py          the two failures that stop a run on every rank (exit 3): diverged weights,
                       a checkpoint that could not be written; light, for the commands' front
    fault_injection.py faults armed through PRETRAIN_FAULTS at named points of a real run (tests)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from train.engine.config import DTYPES, EngineConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from train.engine.core import EngineCore, adamw_state

__all__ = ["DTYPES", "EngineConfig", "EngineCore", "adamw_state", "build"]


def __getattr__(name: str):
    """EngineCore and adamw_state load train/engine/core.py (and with it torch.distributed.checkpoint)
    when first asked for: a command's --help, its bad value and its error classes (errors.py) need
    the package without them."""
    if name in ("EngineCore", "adamw_state"):
        from train.engine import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build(module: nn.Module, groups: list[dict], make_optimizer, make_schedule, cfg: EngineConfig,
          device: torch.device) -> EngineCore:
    """The engine for this world size and ZeRO stage: one rank or ZeRO-0 -> replicated (no
    wrapper / DDP); ZeRO-1-3 on several ranks -> FSDP2."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1 and cfg.stage >= 1:
        from train.engine.sharded import ShardedEngine

        return ShardedEngine(module, groups, make_optimizer, make_schedule, cfg, device)
    from train.engine.replicated import ReplicatedEngine

    return ReplicatedEngine(module, groups, make_optimizer, make_schedule, cfg, device)
