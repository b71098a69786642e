"""Per-GPU memory estimate of a configuration, without a GPU: model states from the parameter
counts, precision, ZeRO stage and world size, as the engine lays them out (train/engine/); activations
from the objective's actual token counts (train/estimate/costs.py). An estimate of what PyTorch allocates at
the peak of a step; the CUDA context (~0.5-1 GiB) and allocator fragmentation come on top, so a
configuration "fits" when the estimate stays below 90% of the GPU's memory.

Per GPU, with P parameters (Psi trained), N data-parallel ranks, w bytes per value in the compute
dtype (2 in fp16/bf16, 4 in fp32), r in the reduce dtype, L the parameters of the largest FSDP2
unit (a transformer block, or what sits outside the blocks):
Whole weights on every rank (one rank, any stage; ZeRO-0 on DDP: train/engine/replicated.py):
  weights          w P, the module in the compute dtype, + 4 Psi fp32 master weights in fp16/bf16
                   (in fp32 the module's weights are the masters)
  gradients        4 Psi: the fp32 sum of the micro-batches' gradients (the masters' .grad; in
                   fp32 the parameters' own .grad, which DDP's buckets hold)
  extra_gradients  w Psi in fp16/bf16: autograd's (and DDP's bucket) gradients in the compute dtype
  optimizer        8 Psi: Adam's two moments
ZeRO 1-3 on several ranks (FSDP2: train/engine/sharded.py): the fp32 shards are the masters
  weights          4 P / N + w P for ZeRO 1-2 (every unit stays gathered through the step's
                   forward and backward), + 2 w L for ZeRO-3 (a gathered unit and the next one)
  gradients        4 Psi / N, the sharded fp32 sums; + s Psi for ZeRO-1 with accumulation (the
                   unsynced micro-batches' unsharded sums, s bytes per value: 4 when the reduce
                   dtype or data_types.grad_accum_dtype is fp32, else r)
  extra_gradients  (w + r) L: a unit's gradients before and during its reduce-scatter; (w + 4 + r) L
                   when ZeRO-1 sums in fp32 and reduces in 16 bits (the cast copy it communicates)
  optimizer        8 Psi / N
`buffers` are the module's registered buffers (fixed position tables and the like): floating ones
in the compute dtype, as the engines cast them, integer ones (iRPE's bucket ids) at their own size.
`outside` is what an objective trains with its own optimizers beside the engine (MLO-MAE's
masking network and level-II head: Objective.outside_parameters): 16 bytes per parameter on every
rank, fp32 weights, their gradients and AdamW's two moments.

`check_floor` is the check before start on any machine (the command's start and the dry run,
CPU ranks included): a floor of what a rank must hold for one step, from the model's geometry
alone (nothing is built), against the GPU's memory or this machine's RAM. It refuses only what
cannot fit whatever the kernels: an image size whose tensors cannot be allocated, say.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from model.registry import model_arch
from model.timm_backbone import is_timm_name
from train.config.ds_config import BatchPlan, grad_accum_dtype, precision, reduce_dtype, zero_stage
from train.config.errors import ConfigError
from train.config.options import PretrainConfig, encoder_img_size
from train.estimate.costs import Profile, profile_config
from train.estimate.gpus import GPU

GIB = 2**30
HEADROOM = 0.9  # share of the GPU's memory the estimate may use
OUTSIDE_BYTES = 16  # per parameter trained outside the engine: fp32 weight, gradient, AdamW's two moments


@dataclass
class MemoryEstimate:
    params: int
    trainable: int
    largest_layer: int  # parameters of the largest FSDP2 unit (a block, or what is outside the blocks)
    weights: float  # bytes per GPU
    gradients: float
    optimizer: float
    extra_gradients: float  # autograd's per-parameter gradients (module docstring)
    buffers: float
    outside_params: int  # parameters the objective trains outside the engine (module docstring)
    activations: float
    activations_per_sample: float
    profile: Profile

    @property
    def outside(self) -> float:
        """Bytes of the parameters trained outside the engine, with their gradients and moments."""
        return OUTSIDE_BYTES * self.outside_params

    @property
    def model_states(self) -> float:
        """Weights, the engine's gradient buffers and optimizer states."""
        return self.weights + self.gradients + self.optimizer

    @property
    def fixed(self) -> float:
        """Everything but the activations: what does not grow with the micro-batch."""
        return self.model_states + self.extra_gradients + self.buffers + self.outside

    @property
    def total(self) -> float:
        return self.fixed + self.activations

    def fits(self, gpu: GPU) -> bool:
        return self.total <= HEADROOM * gpu.memory_gib * GIB

    def largest_micro(self, gpu: GPU) -> int:
        """The largest micro-batch whose activations fit next to everything else."""
        return max(0, int((HEADROOM * gpu.memory_gib * GIB - self.fixed) // self.activations_per_sample))

    def table(self) -> dict[str, float]:
        names = ("weights", "gradients", "optimizer", "extra_gradients", "buffers", "outside", "activations",
                 "total")
        return {n.replace("_", " ") + (" the engine" if n == "outside" else ""): round(getattr(self, n) / GIB, 2)
                for n in names if n != "outside" or self.outside}


@dataclass
class ModelStates:
    """Bytes per GPU (module docstring)."""
    weights: float
    gradients: float
    optimizer: float
    extra_gradients: float


def model_states(params: int, trainable: int, largest_layer: int, prec: str, stage: int, world: int,
                 accum: int = 1, reduce: str = "", accumulate: str = "") -> ModelStates:
    """Per-GPU model states of `params` parameters (`trainable` of them trained; `largest_layer`
    in the largest FSDP2 unit) in precision `prec` under ZeRO `stage` on `world` ranks, with
    `accum` micro-batches per step, gradients reduced in `reduce` and ZeRO-1's micro-batches
    summed in `accumulate` (defaults: `prec`)."""
    half = prec in ("fp16", "bf16")
    w = 2 if half else 4
    r = 4 if (reduce or prec) == "fp32" else 2
    if world == 1 or stage == 0:  # whole weights on every rank
        return ModelStates(w * params + (4 * trainable if half else 0), 4 * trainable, 8 * trainable,
                           w * trainable if half else 0.0)
    weights = 4 * params / world + (2 * w * largest_layer if stage == 3 else w * params)
    unsynced = stage == 1 and accum > 1
    s = 4 if "fp32" in (reduce or prec, accumulate or prec) else r  # train/engine/config.py unsynced_dtype
    gradients = 4 * trainable / world + (s * trainable if unsynced else 0)
    reduce_scatter = s + r if unsynced and s != r else r  # FSDP2's input, and the copy ReduceScatterIn sends
    return ModelStates(weights, gradients, 8 * trainable / world, (w + reduce_scatter) * largest_layer)


def largest_layer(module: torch.nn.Module) -> int:
    """Parameters of the largest FSDP2 unit: a transformer block (train/engine/sharded.py shards
    each on its own), or the rest of the objective, sharded as one."""
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
    states = model_states(params, trainable, largest, prec, stage, plan.world, plan.accum, reduce_dtype(ds),
                          grad_accum_dtype(ds))
    acts = prof.activation_bytes(value_bytes)
    # the engines cast floating buffers to the compute dtype (module.to); integer ones (iRPE's bucket
    # ids, int64; the drop-path keep bits, int32) keep their own size
    buffers = sum(b.numel() * (value_bytes if b.is_floating_point() else b.element_size())
                  for b in objective.buffers())
    outside = sum(p.numel() for p in objective.outside_parameters())
    return MemoryEstimate(params, trainable, largest, states.weights, states.gradients, states.optimizer,
                          states.extra_gradients, buffers, outside, acts, acts / plan.micro, prof)


def step_floor(cfg: PretrainConfig, micro: int, prec: str) -> dict[str, float]:
    """Bytes one rank certainly holds in a step of micro-batch `micro`, by part: the batch of
    images, and for our ViTs the patch embeddings of that batch (the encoder embeds every patch
    before any masking), the position table and the blocks' fp32 weights (12 d^2 each)."""
    value_bytes = 4 if prec == "fp32" else 2
    img, chans = encoder_img_size(cfg), cfg.model.in_chans
    crops = cfg.data.num_crops if cfg.data.train_transform == "multicrop" else 1
    parts = {"images": micro * crops * chans * img * img * value_bytes}
    if is_timm_name(cfg.model.name):
        return parts
    arch = model_arch(cfg.model.name, img_size=img)
    tokens, dim = (img // arch["patch_size"]) ** 2, arch["embed_dim"]
    parts["patch embeddings"] = micro * crops * tokens * dim * value_bytes
    parts["position table"] = (tokens + 1) * dim * 4
    parts["block weights"] = arch["depth"] * 12 * dim * dim * 4
    return parts


def machine_memory() -> tuple[float, str]:
    """(bytes, what they are) one rank of this machine can use at most: its GPU's memory, else the RAM."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return float(props.total_memory), f"this GPU ({props.name})"
    return ram()


def ram() -> tuple[float, str]:
    """(bytes, what they are) of this machine's memory (psutil may be absent; sysconf is POSIX)."""
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), "this machine's memory"


def check_floor(cfg: PretrainConfig, ds: dict, plan: BatchPlan, limit: float | None = None, where: str = "") -> None:
    """ConfigError when a step's floor (`step_floor`) exceeds `limit` bytes of `where` (None: this
    machine's, `machine_memory`)."""
    if limit is None:
        limit, where = machine_memory()
    parts = step_floor(cfg, plan.micro, precision(ds))
    total = sum(parts.values())
    if total > limit:
        listed = ", ".join(f"{name} {size / GIB:,.1f}" for name, size in parts.items())
        raise ConfigError(f"a step needs at least {total / GIB:,.1f} GiB per rank ({listed} GiB at micro-batch "
                          f"{plan.micro}, image size {encoder_img_size(cfg)}), more than the {limit / GIB:,.1f} GiB of "
                          f"{where}: lower model.img_size, model.in_chans or the ds_config's "
                          f"train_micro_batch_size_per_gpu")
