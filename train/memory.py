"""Per-GPU memory estimate of a configuration, without a GPU: model states from the parameter
counts, precision and ZeRO stage; activations from the objective's actual token counts
(train/costs.py); DeepSpeed's communication buckets. An estimate of what PyTorch allocates at
the peak of a step; the CUDA context (~0.5-1 GiB) and allocator fragmentation come on top, so a
configuration "fits" when the estimate stays below 90% of the GPU's memory.

Model states follow DeepSpeed's own estimators, without offload (deepspeed.runtime.zero:
`stage_1_and_2.estimate_zero2_model_states_mem_needs` for ZeRO-1 and ZeRO-2, as DeepSpeed has
no ZeRO-1 estimator, and `stage3.estimate_zero3_model_states_mem_needs`; tested against both).
Per GPU, with P parameters (Psi trainable), N data-parallel ranks, w bytes per weight (2 in
fp16/bf16, 4 in fp32) and L parameters in the largest module (its own, as DeepSpeed counts):
  ZeRO-1/2: weights w P; gradients (w + 4) Psi / N, the gradient partition in the compute
            dtype and its fp32 copy for the step; optimizer 12 Psi / N, fp32 master weights and
            Adam's two moments. 16-bit: 2 P + 18 P / N, DeepSpeed's zero2 formula.
  ZeRO-3:   weights w (P / N + L), the partition plus the largest layer gathered; gradients
            w L + 4 Psi / N; optimizer 12 Psi / N. 16-bit: 4 L + 18 P / N, DeepSpeed's zero3.
  ZeRO-0:   weights w P; gradients w Psi (+ 4 Psi fp32 copies in fp16/bf16); optimizer 8 Psi
            (+ 4 Psi fp32 master weights in fp16/bf16: DeepSpeed 0.19 wraps a 16-bit engine
            without ZeRO, bf16 too, in its unpartitioned FP16 optimizer). No estimator of
            DeepSpeed's covers it.
What those estimators leave out but DeepSpeed 0.19 allocates is counted apart, as
`extra_gradients`, so that the model states stay comparable with DeepSpeed's numbers and the
total does not fall short of what the engine holds:
  ZeRO-1:   w Psi, every parameter's whole gradient (param.grad): ZeRO-1 partitions the
            optimizer states only and reduces at the accumulation boundary, so the gradients
            of the earlier micro-batches are held whole until then. (With accumulation 1 and
            overlap_comm they go into the reduce buckets as backward produces them: an upper
            bound there.) ZeRO-1's model states are thus the zero2 estimator's plus w Psi:
            1.47x DeepSpeed's number in bf16 on 8 GPUs.
  ZeRO-3:   w Psi / N, the flat gradient partition (stage3.py's grad_partitions_flat_buffer)
            next to the fp32 copy made for the step.
Communication buckets: DeepSpeed's guidance of 4.5 x (reduce + allgather bucket) values with
overlap_comm, each bucket at most the model.
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
    largest_layer: int  # parameters of the largest module (its own), as DeepSpeed's zero3 estimator counts
    weights: float  # bytes per GPU
    gradients: float
    optimizer: float
    extra_gradients: float  # what DeepSpeed's estimators leave out (module docstring)
    buffers: float
    activations: float
    activations_per_sample: float
    profile: Profile

    @property
    def model_states(self) -> float:
        """Weights, gradients and optimizer states as DeepSpeed's estimators count them."""
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
    in the largest module) in precision `prec` under ZeRO `stage` on `world` data-parallel ranks."""
    half = prec in ("fp16", "bf16")
    w = 2 if half else 4
    if stage == 0:  # every rank holds everything; 16-bit keeps fp32 gradients and master weights too
        return ModelStates(w * params, (w + (4 if half else 0)) * trainable, (12 if half else 8) * trainable, 0.0)
    optimizer = 12 * trainable / world  # fp32 master partition + Adam's two moments
    if stage == 3:
        return ModelStates(w * (params / world + largest_layer), w * largest_layer + 4 * trainable / world,
                           optimizer, w * trainable / world)
    return ModelStates(w * params, (w + 4) * trainable / world, optimizer, w * trainable if stage == 1 else 0.0)


def largest_layer(module: torch.nn.Module) -> int:
    """Parameters of the largest module, counting each module's own (DeepSpeed's model_to_params)."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)


def comm_buffers(ds: dict, trainable: int, prec: str) -> float:
    z = ds.get("zero_optimization", {})
    stage = zero_stage(ds)
    if stage == 0:
        return 0.0
    w = 2 if prec in ("fp16", "bf16") else 4
    reduce = min(float(z.get("reduce_bucket_size", 5e8)), trainable)
    gather_key = "stage3_prefetch_bucket_size" if stage == 3 else "allgather_bucket_size"
    gather = min(float(z.get(gather_key, 5e8)), trainable)
    return w * (reduce + gather) * (4.5 if z.get("overlap_comm", stage == 3) else 1.0)


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
    return MemoryEstimate(params, trainable, largest, states.weights, states.gradients, states.optimizer,
                          states.extra_gradients, comm_buffers(ds, trainable, prec), acts, acts / plan.micro, prof)
