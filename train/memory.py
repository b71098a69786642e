"""Per-GPU memory estimate of a configuration, without a GPU: model states from the parameter
counts, precision and ZeRO stage; activations from the objective's actual token counts
(train/costs.py); DeepSpeed's communication buckets. An estimate of what PyTorch allocates at
the peak of a step; the CUDA context (~0.5-1 GiB) and allocator fragmentation come on top, so a
configuration "fits" when the estimate stays below 90% of the GPU's memory.

Model states per GPU, with P parameters (Psi trainable) and N data-parallel ranks (ZeRO paper
accounting): 16-bit runs keep 16-bit weights (2P, /N under ZeRO-3), 16-bit gradients (2 Psi,
/N from ZeRO-2) and fp32 master weights + Adam moments (12 Psi, /N from ZeRO-1; DeepSpeed's bf16
optimizer partitions them at stage 0 as well); fp32 runs keep 4P weights, 4 Psi gradients and
8 Psi moments (+4 Psi master partition from ZeRO-1). Communication buckets: DeepSpeed's
guidance of 4.5 x (reduce + allgather bucket) 16-bit values with overlap_comm, each bucket at
most the model.
"""
from __future__ import annotations

from dataclasses import dataclass

from train.costs import Profile
from train.ds_config import BatchPlan, precision
from train.gpus import GPU

GIB = 2**30
HEADROOM = 0.9  # share of the GPU's memory the estimate may use


@dataclass
class MemoryEstimate:
    params: int
    trainable: int
    weights: float  # bytes per GPU
    gradients: float
    optimizer: float
    buffers: float
    activations: float
    activations_per_sample: float
    profile: Profile

    @property
    def states(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.buffers

    @property
    def total(self) -> float:
        return self.states + self.activations

    def fits(self, gpu: GPU) -> bool:
        return self.total <= HEADROOM * gpu.memory_gib * GIB

    def largest_micro(self, gpu: GPU) -> int:
        """The largest micro-batch whose activations fit next to the model states."""
        return max(0, int((HEADROOM * gpu.memory_gib * GIB - self.states) // self.activations_per_sample))

    def table(self) -> dict[str, float]:
        names = ("weights", "gradients", "optimizer", "buffers", "activations", "total")
        return {n: round(getattr(self, n) / GIB, 2) for n in names}


def model_states(params: int, trainable: int, prec: str, stage: int, world: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU."""
    half = prec in ("fp16", "bf16")
    w = 2 if half else 4
    weights = w * params / (world if stage == 3 else 1)
    grads = w * trainable / (world if stage >= 2 else 1)
    if half:
        partitioned = stage >= 1 or prec == "bf16"
        optimizer = 12 * trainable / (world if partitioned else 1)
    else:
        optimizer = 8 * trainable / (world if stage >= 1 else 1) + (4 * trainable / world if stage >= 1 else 0)
    return weights, grads, optimizer


def comm_buffers(ds: dict, trainable: int, prec: str) -> float:
    z = ds.get("zero_optimization", {})
    stage = z.get("stage", 0)
    if stage == 0:
        return 0.0
    w = 2 if prec in ("fp16", "bf16") else 4
    reduce = min(float(z.get("reduce_bucket_size", 5e8)), trainable)
    gather_key = "stage3_prefetch_bucket_size" if stage == 3 else "allgather_bucket_size"
    gather = min(float(z.get(gather_key, 5e8)), trainable)
    return w * (reduce + gather) * (4.5 if z.get("overlap_comm", stage == 3) else 1.0)


def estimate(cfg, ds: dict, plan: BatchPlan, gpu: GPU) -> MemoryEstimate:
    """The estimate for a configuration (its objective runs on the meta device)."""
    from train.pretrain import profile_config

    prec = precision(ds)
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    value_bytes = 4 if prec == "fp32" else 2
    objective, prof = profile_config(cfg, ds, plan.micro, gpu.sm80, value_bytes)
    params = sum(p.numel() for p in objective.parameters())
    trainable = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    weights, grads, optimizer = model_states(params, trainable, prec, stage, plan.world)
    acts = prof.activation_bytes(value_bytes)
    return MemoryEstimate(params, trainable, weights, grads, optimizer, comm_buffers(ds, trainable, prec), acts,
                          acts / plan.micro, prof)
