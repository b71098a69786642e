"""How the objective's blocks execute: recomputed in the backward (activation checkpointing),
their linear layers in float8 (run.float8), compiled (run.compile), replayed as CUDA graphs where
the weights stay put."""
from __future__ import annotations

import torch

from train.config.ds_config import zero_stage
from train.config.options import PretrainConfig


def apply_execution_options(objective: torch.nn.Module, recompute: bool, compile_blocks: bool,
                            cuda_graphs: bool = False, float8: bool = False) -> int:
    """Activation checkpointing (the ds_config's section: every transformer block recomputed in
    backward) and run.compile (torch.compile of every ViT block: one static graph per block shape,
    model/vit.py `Block.compile_static`). Compiling starts from an empty dynamo cache: every block of
    every model shares one code object, whose graphs count against dynamo's recompile limit (8), so
    a process that builds several runs (benchmarks, tests) must not carry the earlier runs' graphs;
    inductor's compiled kernels stay in its on-disk cache. `cuda_graphs`: the compiled blocks also
    replay as CUDA graphs (`uses_cuda_graphs`). `float8`: `float8_blocks` first, so the compiled
    graphs hold the float8 casts too. Returns the number of linear layers converted to float8."""
    from model.vit import Block

    converted = float8_blocks(objective) if float8 else 0
    if compile_blocks:
        torch._dynamo.reset()
    for module in objective.modules():
        if recompute and hasattr(module, "set_grad_checkpointing"):
            module.set_grad_checkpointing(True)
        if compile_blocks and isinstance(module, Block):
            module.compile_static(cuda_graphs)
    return converted


def replicated_weights(ds_config: dict, world: int) -> bool:
    """Whether every rank holds the whole weights at fixed addresses: one rank, or ZeRO-0 on DDP.
    FSDP2 (ZeRO 1-3 on several ranks) regathers each block's weights into storage it frees between
    uses, which a CUDA graph cannot keep as a fixed address."""
    return world == 1 or zero_stage(ds_config) == 0


def uses_cuda_graphs(cfg: PretrainConfig, ds_config: dict, device: torch.device, world: int) -> bool:
    """run.compile on a CUDA device with replicated weights: the compiled blocks replay as CUDA
    graphs. Measured on one H200 (docs/PERFORMANCE.md): compiled blocks without graphs cut the device
    time of a MAE ViT-B step by a fifth but made the host, calling 40 compiled graphs a step, slower
    than the device, so sharded runs, which compile without graphs, pay the host's pace."""
    return cfg.run.compile and device.type == "cuda" and replicated_weights(ds_config, world)


def describe_blocks(cfg: PretrainConfig, ds_config: dict, world: int, on_gpu: bool) -> str:
    """How the run's blocks will execute, for the dry run and the start of a run."""
    if not cfg.run.compile:
        return ("blocks: eager (run.compile false; with one rank or ZeRO-0 on GPUs, run.compile true replays "
                "compiled blocks as CUDA graphs: docs/TRAINING.md)")
    if not on_gpu:
        return "blocks: compiled by torch.compile, one static graph per block shape (no CUDA graphs off the GPU)"
    if replicated_weights(ds_config, world):
        return ("blocks: compiled by torch.compile, one static graph per block shape, replayed as CUDA graphs "
                "(replicated weights)")
    return (f"blocks: compiled without CUDA graphs: ZeRO-{zero_stage(ds_config)} on FSDP2 regathers the weights into "
            f"fresh storage every step. Compiled blocks without graphs ran slower than eager for MAE ViT-B on one "
            f"H200, the host setting the pace (docs/PERFORMANCE.md); ZeRO-0 (DDP) keeps the graphs where the "
            f"replicated weights, gradients and optimizer fit")


def float8_blocks(objective: torch.nn.Module) -> int:
    """Every linear layer inside a ViT block (attention's qkv and projection, the MLP's two) trains
    in float8: torchao's Float8Linear casts its input, weight and output gradient to float8 with
    one dynamic scale per tensor and multiplies on float8 tensor cores; the weights themselves,
    their gradients and the optimizer stay as they were (the checkpoint's names and dtypes too).
    The patch embedding, the heads and the decoder's prediction stay in the compute dtype, as in
    torchtitan's recipe. Layers whose sizes are not multiples of 16 (float8 matmuls' tile) stay
    too. Returns the number converted."""
    import logging

    from model.vit import Block

    pytree_log = logging.getLogger("torch.utils._pytree")  # torchao's import warns about an API it calls
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import convert_to_float8_training
    finally:
        pytree_log.setLevel(level)

    def fits(module: torch.nn.Module, _name: str) -> bool:
        return (type(module) is torch.nn.Linear and module.in_features % 16 == 0
                and module.out_features % 16 == 0)

    converted = 0
    for block in [m for m in objective.modules() if isinstance(m, Block)]:
        before = sum(1 for m in block.modules() if type(m) is torch.nn.Linear)
        convert_to_float8_training(block, module_filter_fn=fits)
        converted += before - sum(1 for m in block.modules() if type(m) is torch.nn.Linear)
    return converted
