"""Per-GPU memory estimate of a configuration, without a GPU: model states from the parameter
counts, precision and ZeRO stage, as the engine lays them out (train/engine.py, ZeRO-3:
train/engine_fsdp.py); activations from the objective's actual token counts (train/costs.py).
An estimate of what PyTorch allocates at the peak of a step; the CUDA context (~0.5-1 GiB) and
allocator fragmentation come on top, so a configuration "fits" when the estimate stays below 90%
of the GPU's memory.

Per GPU, with P parameters (Psi trained), N data-parallel ranks, w bytes per value in the compute
dtype (2 in fp16/bf16, 4 in fp32) and S = Psi / N where the stage partitions (ZeRO 1-2 on more
than one rank), else Psi:
  weights          w P, the module in the compute dtype (the trained parameters in one flat
                   buffer), + 4 S fp32 master weights in fp16/bf16 (in fp32 the module's
                   weights are the masters)
  gradients        ZeRO 0-1: 4 Psi, the fp32 sum of the micro-batches' gradients, + 4 S for the
                   reduced shard when partitioned; ZeRO-2: w Psi (one micro-batch at a time, in
                   the compute dtype) + (w + 4) S (its reduced shard and the fp32 sum)
  extra_gradients  w Psi: autograd's per-parameter gradients at the end of each backward, until
                   the engine adds them to its buffer
  optimizer        8 S: Adam's two moments
ZeRO-3 (FSDP2, L = the parameters of the largest sharding unit: a transformer block, or what
sits outside the blocks): weights 4 P / N (the fp32 shards are the masters) + 2 w L (a gathered
unit and the next one, prefetched); gradients 4 Psi / N + w L (a unit's gradients before their
reduce-scatter); optimizer 8 Psi / N.
`buffers` are the module's registered buffers (fixed position tables and the like).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from train.build import profile_config
from train.costs import Profile
from train.ds_config import BatchPlan, precision, zero_stage
from train.gpus import GPU

GIB = 2**30
HEADROOM = 0.9  # share of the GPU's memory the estimate may use


@dataclass
class MemoryEstimate:
    params: int
    trainable: int
    largest_layer: int  # parameters of the largest ZeRO-3 sharding unit (a block, or what is outside the blocks)
    weights: float  # bytes per GPU
    gradients: float
    optimizer: float
    extra_gradients: float  # autograd's per-parameter gradients (module docstring)
    buffers: float
    activations: float
    activations_per_sample: float
    profile: Profile

    @property
    def model_states(self) -> float:
        """Weights, the engine's gradient buffers and optimizer states."""
        return self.weights + self.gradients + self.optimizer

    @property
    def fixed(self) -> float:
        """Everything but the activations: what does not grow with the micro-batch."""
        return self.model_states + self.extra_gradients + self.buffers

    @property
    def total(self) -> float:
        return self.fixed + self.activations

    def fits(self, gpu: GPU) -> bool:
        return self.total <= HEADROOM * gpu.memory_gib * GIB

    def largest_micro(self, gpu: GPU) -> int:
        """The largest micro-batch whose activations fit next to everything else."""
        return max(0, int((HEADROOM * gpu.memory_gib * GIB - self.fixed) // self.activations_per_sample))

    def table(self) -> dict[str, float]:
        names = ("weights", "gradients", "optimizer", "extra_gradients", "buffers", "activations", "total")
        return {n.replace("_", " "): round(getattr(self, n) / GIB, 2) for n in names}


@dataclass
class ModelStates:
    """Bytes per GPU (module docstring)."""
    weights: float
    gradients: float
    optimizer: float
    extra_gradients: float


def model_states(params: int, trainable: int, largest_layer: int, prec: str, stage: int, world: int) -> ModelStates:
    """Per-GPU model states of `params` parameters (`trainable` of them trained; `largest_layer`
    in the largest ZeRO-3 unit) in precision `prec` under ZeRO `stage` on `world` ranks."""
    half = prec in ("fp16", "bf16")
    w = 2 if half else 4
    if stage == 3:
        return ModelStates(4 * params / world + 2 * w * largest_layer, 4 * trainable / world + w * largest_layer,
                           8 * trainable / world, 0.0)
    shard = trainable / world if stage >= 1 and world > 1 else trainable
    weights = w * params + (4 * shard if half else 0)
    if stage == 2 and world > 1:
        gradients = w * trainable + (w + 4) * shard
    else:
        gradients = 4 * trainable + (4 * shard if shard < trainable else 0)
    return ModelStates(weights, gradients, 8 * shard, w * trainable)


def largest_layer(module: torch.nn.Module) -> int:
    """Parameters of the largest ZeRO-3 sharding unit: a transformer block (train/engine_fsdp.py
    shards each on its own), or the rest of the objective, sharded as one."""
    from model.vit import Block

    blocks = [sum(p.numel() for p in m.parameters()) for m in module.modules() if isinstance(m, Block)]
    return max([*blocks, sum(p.numel() for p in module.parameters()) - sum(blocks)])


def estimate(cfg, ds: dict, plan: BatchPlan, gpu: GPU) -> MemoryEstimate:
    """The estimate for a configuration (its objective runs on the meta device)."""
    prec = precision(ds)
    stage = zero_stage(ds)
    value_bytes = 4 if prec == "fp32" else 2
    objective, prof = profile_config(cfg, ds, plan.micro, gpu.sm80, value_bytes)
    params = sum(p.numel() for p in objective.parameters())
    trainable = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    largest = largest_layer(objective)
    states = model_states(params, trainable, largest, prec, stage, plan.world)
    acts = prof.activation_bytes(value_bytes)
    buffers = sum(b.numel() for b in objective.buffers()) * value_bytes
    return MemoryEstimate(params, trainable, largest, states.weights, states.gradients, states.optimizer,
                          states.extra_gradients, buffers, acts, acts / plan.micro, prof)
