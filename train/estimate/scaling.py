"""A configuration's communication at a world size, on paper (train/estimate/comm_model.py): its FSDP units
from the objective built on the meta device (every transformer block, with its trained parameters
and the FLOPs of its calls in one micro-batch, train/estimate/costs.py; the root holds the rest), and the
batch it would run at that world size.

The global batch is the recipe's (the ds_config's train_batch_size). Where the file's batch numbers
do not resolve at that world size, the accumulation is derived from the global batch when the
micro-batch times the ranks divides it; when the micro-batch times the ranks exceeds it, the
micro-batch shrinks to global / ranks with no accumulation (what a run on that many GPUs has to
set), so the compute per rank falls as the ranks grow. A file without train_batch_size keeps its
micro-batch and accumulation: its global batch grows with the ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from train.config.ds_config import BatchPlan, precision, reduce_dtype, resolve_batch, zero_stage
from train.config.errors import ConfigError
from train.config.options import PretrainConfig
from train.estimate.comm_model import ENGINES, Compute, Estimate, Model, Network, StepConfig, Unit, estimate


def model_of(objective, prof) -> Model:
    """FSDP units of `objective` (blocks in the order the forward first calls them) with their FLOPs
    from `prof`, the profile of one micro-batch (train/estimate/costs.py)."""
    from model.vit import Block

    blocks = {name: m for name, m in objective.named_modules() if isinstance(m, Block)}
    called = list(dict.fromkeys(c.module for c in prof.blocks))
    order = called + [name for name in blocks if name not in called]
    units = []
    for name in order:
        calls = [c for c in prof.blocks if c.module == name]
        units.append(Unit(name, sum(p.numel() for p in blocks[name].parameters() if p.requires_grad),
                          sum(c.forward_flops for c in calls), any(c.checkpointed for c in calls)))
    trained = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    root = Unit("root", trained - sum(u.params for u in units), prof.forward_flops - sum(u.forward_flops for u in units))
    return Model(root, tuple(units))


def batch_at(ds: dict, world: int) -> tuple[BatchPlan, str]:
    """The batch plan at `world` ranks, keeping the global batch (module docstring), and a note when
    it differs from what the file gives."""
    try:
        return resolve_batch(ds, world), ""
    except ConfigError:
        total, micro = ds.get("train_batch_size"), ds.get("train_micro_batch_size_per_gpu")
        if total and micro and total % (micro * world) == 0:
            accum = total // (micro * world)
            return BatchPlan(micro, accum, world), f"accumulation {accum} keeps the global batch {total}"
        if total and micro and total % world == 0 and total // world < micro:
            note = f"micro-batch {total // world}: the file's {micro} x {world} ranks exceed its global batch {total}"
            return BatchPlan(total // world, 1, world), note
        raise


def step_config(ds: dict, plan: BatchPlan) -> StepConfig:
    bucket = ds.get("zero_optimization", {}).get("reduce_bucket_size")
    return StepConfig(zero_stage(ds), precision(ds), reduce_dtype(ds), plan.accum, int(bucket) if bucket else None)


@dataclass(frozen=True)
class Scaling:
    """Both engines' step for one configuration at one world size."""
    model: Model
    step: StepConfig
    plan: BatchPlan
    note: str  # why the micro-batch differs from the file's, if it does
    flops_per_micro: float  # training FLOPs (3 x forward)
    estimates: dict[str, Estimate]  # engine -> its step


def scaling(cfg: PretrainConfig, ds: dict, world: int, network: Network, compute: Compute,
            fused_kernels: bool = True) -> Scaling:
    from train.estimate.costs import profile_config

    plan, note = batch_at(ds, world)
    value_bytes = 4 if precision(ds) == "fp32" else 2
    objective, prof = profile_config(cfg, ds, plan.micro, fused_kernels, value_bytes)
    model = model_of(objective, prof)
    step = step_config(ds, plan)
    return Scaling(model, step, plan, note, prof.train_flops,
                   {e: estimate(e, model, step, world, network, compute) for e in ENGINES})


def summary_line(cfg: PretrainConfig, ds: dict, world: int, gpu) -> str:
    """The dry run's line: the step's communication with the engine after, default links and MFU."""
    network, compute = Network(), Compute(gpu.peak_tflops)
    est = scaling(cfg, ds, world, network, compute, gpu.sm80).estimates["after"]
    return (f"communication per step on paper ({network.gpus_per_node} GPUs per node: {network.nodes(world)} node(s); "
            f"{network.intra_gbytes_s:g} GB/s within, {network.inter_gbits_s:g} Gb/s per node across; "
            f"{compute.mfu:.0%} MFU): {est.sent_bytes / 1e9:.3f} GB sent per rank, {est.comm_s * 1e3:.2f} ms of "
            f"which {est.exposed_s * 1e3:.2f} exposed beside {est.compute_s * 1e3:.1f} ms of compute, efficiency "
            f"{est.efficiency:.1%} (python -m tools.scaling --ds_config FILE: the assumptions, other world sizes)")
