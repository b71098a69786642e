"""How the objective's blocks execute: recomputed in the backward (activation checkpointing) and
compiled (run.compile), replayed as CUDA graphs where the weights stay put."""
from __future__ import annotations

import torch

from train.config.ds_config import zero_stage
from train.config.options import PretrainConfig


def apply_execution_options(objective: torch.nn.Module, recompute: bool, compile_blocks: bool,
                            cuda_graphs: bool = False) -> None:
    """Activation checkpointing (the ds_config's section: every transformer block recomputed in
    backward) and run.compile (torch.compile of every ViT block: one static graph per block shape,
    model/vit.py `Block.compile_static`). Compiling starts from an empty dynamo cache: every block of
    every model shares one code object, whose graphs count against dynamo's recompile limit (8), so
    a process that builds several runs (benchmarks, tests) must not carry the earlier runs' graphs;
    inductor's compiled kernels stay in its on-disk cache. `cuda_graphs`: the compiled blocks also
    replay as CUDA graphs (`uses_cuda_graphs`)."""
    from model.vit import Block

    if compile_blocks:
        torch._dynamo.reset()
    for module in objective.modules():
        if recompute and hasattr(module, "set_grad_checkpointing"):
            module.set_grad_checkpointing(True)
        if compile_blocks and isinstance(module, Block):
            module.compile_static(cuda_graphs)


def uses_cuda_graphs(cfg: PretrainConfig, ds_config: dict, device: torch.device, world: int) -> bool:
    """run.compile on a CUDA device with replicated weights (one rank, or ZeRO-0 on DDP): the compiled
    blocks replay as CUDA graphs. Measured on one H200 (docs/PERFORMANCE.md): compiled blocks without
    graphs cut the device time of a MAE ViT-B step by a fifth but made the host, calling 40 compiled
    graphs a step, slower than the device. FSDP2 (ZeRO 1-3 on several ranks) regathers each block's
    weights into storage it frees between uses, which a graph cannot keep as a fixed address, so
    sharded runs compile without graphs."""
    return cfg.run.compile and device.type == "cuda" and (world == 1 or zero_stage(ds_config) == 0)
