"""Communication of one optimizer step of data-parallel training, on paper: the bytes each rank
sends, by collective, and the part of their time that hides behind compute, for two engines.

Engines (N = trained parameters, w / r = bytes of a value in the compute / reduce dtype):
- `before`, the flat-buffer engine: every collective over one flat buffer after the backward,
  blocking, nothing overlapped. ZeRO-0: all-reduce of the fp32 gradients (4 N) after the last
  micro-batch. ZeRO-1: reduce-scatter of the fp32 gradients (4 N) after the last micro-batch, then
  all-gather of the updated weights (w N) after the optimizer step. ZeRO-2: reduce-scatter of the
  compute-dtype gradients (w N) after every micro-batch, all-gather of the weights after the step.
  ZeRO-3 was FSDP2 already: as `after`'s ZeRO-3 with the gradients reduced in fp32.
- `after`, PyTorch's engines. ZeRO-0: DDP, the gradients all-reduced in the reduce dtype in
  buckets (`reduce_bucket_size` elements, else DDP's 25 MiB) as they become ready in the backward;
  once per step with fp32 compute (no_sync on the earlier micro-batches), every micro-batch with
  fp16 / bf16 compute (the unsynced micro-batches accumulate in fp32 locally). ZeRO-1-3: FSDP2,
  one unit per transformer block + the root (the rest of the model). ZeRO-1: each unit's weights
  all-gathered (w) once per step, in the first micro-batch's forward, and kept through the step's
  micro-batches; each unit's gradients reduce-scattered (r) once per step, in the last
  micro-batch's backward. ZeRO-2: the same gather, the reduce-scatter every micro-batch. ZeRO-3:
  all-gather in every forward and again in every backward (the root keeps its weights between
  them, FSDP2's default), reduce-scatter every micro-batch.
  ZeRO-1-3 (both engines) all-reduce one scalar after the backward: the gradients' sum of squares
  (norm, clipping, non-finite check).

Collectives are rings: an all-reduce of S bytes sends 2 (W-1)/W S bytes from each rank, a
reduce-scatter or all-gather (W-1)/W S. A collective takes latency + sent / bus bandwidth (NCCL's
bus bandwidth is defined so). On one node the bus bandwidth is NVLink's (default 360 GB/s, H100).
Across nodes a ring crosses each node boundary once per channel, and NCCL spreads its channels
over the node's NICs, so every byte a rank sends also leaves its node once: the bus bandwidth is
the node's inter-node bandwidth (default 4 x 200 Gb/s InfiniBand = 100 GB/s, shared by its 8 GPUs)
when that is below NVLink's. A hierarchical (2D) all-reduce has the same bound, (n-1)/n for
(W-1)/W. Latency per collective: 10 us within a node, 30 us across (the order of NCCL's small-message
latency; it matters for the per-unit collectives of ZeRO-3 and the scalar).

Compute: the objective's training FLOPs per micro-batch (3 x forward matmuls, train/estimate/costs.py) at
an MFU (default 40%) of the GPU's dense peak; the forward takes 1/3 of a unit's time, 1/4 when the
block is recomputed in backward (activation checkpointing). The optimizer step's own time is not
counted. The timeline has two streams, each in order: compute, and communication (collectives
share the links, so they run one after another). A collective starts when its input is ready and
the links are free; a unit's compute starts when its weights are gathered and the unit before it
is done. Overlap follows: a unit's gradient collective is issued when its backward ends and hides
behind the backward of the units still to run; a forward all-gather is prefetched one unit ahead
and hides behind the forward of the unit before it; the first unit's all-gather of a forward
cannot hide, nor the last unit's (or bucket's) reduction, which the end of every backward waits
for (DDP's and FSDP2's end-of-backward callbacks do); what exceeds the compute window waits too.
The root's compute is placed first in the forward and first in the backward (its prediction head
and loss are differentiated first); its gradients are ready at the end of the backward.
Exposed = step time - compute time; overlapped = communication time - exposed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DDP_BUCKET_BYTES = 25 * 2**20  # torch DistributedDataParallel's bucket_cap_mb default
ENGINES = ("before", "after")
NORM_BYTES = 4  # the fp32 sum of squares


def ring_factor(kind: str, world: int) -> float:
    """Bytes each rank sends per byte of the collective's full tensor, in a ring of `world` ranks."""
    if kind == "all_reduce":
        return 2 * (world - 1) / world
    if kind in ("reduce_scatter", "all_gather"):
        return (world - 1) / world
    raise ValueError(f"unknown collective {kind!r}")


@dataclass(frozen=True)
class Network:
    """Links between GPUs (module docstring)."""
    gpus_per_node: int = 8
    intra_gbytes_s: float = 360.0  # NCCL bus bandwidth within a node (H100 NVLink)
    inter_gbits_s: float = 800.0  # InfiniBand per node (4 x 200 Gb/s), shared by its GPUs
    intra_latency_us: float = 10.0
    inter_latency_us: float = 30.0

    def nodes(self, world: int) -> int:
        return -(-world // self.gpus_per_node)

    def bus_bytes_s(self, world: int) -> float:
        intra = self.intra_gbytes_s * 1e9
        return intra if world <= self.gpus_per_node else min(intra, self.inter_gbits_s / 8 * 1e9)

    def latency_s(self, world: int) -> float:
        return 1e-6 * (self.intra_latency_us if world <= self.gpus_per_node else self.inter_latency_us)


@dataclass(frozen=True)
class Compute:
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    mfu: float = 0.40

    def seconds(self, flops: float) -> float:
        return flops / (self.mfu * self.peak_tflops * 1e12)


@dataclass(frozen=True)
class Unit:
    """An FSDP unit: a transformer block, or the root (what is outside the blocks)."""
    name: str
    params: int  # trained parameters
    forward_flops: float  # of one micro-batch
    checkpointed: bool = False

    def forward_s(self, compute: Compute) -> float:
        return (0.25 if self.checkpointed else 1 / 3) * compute.seconds(3 * self.forward_flops)

    def backward_s(self, compute: Compute) -> float:
        return compute.seconds(3 * self.forward_flops) - self.forward_s(compute)


@dataclass(frozen=True)
class Model:
    root: Unit
    blocks: tuple[Unit, ...]  # in forward order

    @property
    def params(self) -> int:
        return self.root.params + sum(b.params for b in self.blocks)

    @property
    def units(self) -> tuple[Unit, ...]:
        return (self.root, *self.blocks)


@dataclass(frozen=True)
class StepConfig:
    """What a ds_config says about communication."""
    stage: int
    precision: str  # compute dtype: fp32 | bf16 | fp16
    reduce_dtype: str  # the gradients' over ranks (`after`; train/config/ds_config.py reduce_dtype)
    accum: int  # micro-batches per optimizer step
    bucket_elements: int | None = None  # zero_optimization.reduce_bucket_size (DDP's buckets)

    def bucket_bytes(self) -> float:
        if self.bucket_elements:
            return self.bucket_elements * DTYPE_BYTES[self.reduce_dtype]
        return DDP_BUCKET_BYTES


@dataclass
class Timeline:
    """One optimizer step on two in-order streams: compute and communication (module docstring)."""
    world: int
    network: Network
    compute_at: float = 0.0  # when the compute stream is next free
    comm_at: float = 0.0  # when the links are next free
    compute_s: float = 0.0
    comm_s: float = 0.0
    sent: dict[str, float] = field(default_factory=dict)  # bytes each rank sends, by collective
    calls: dict[str, int] = field(default_factory=dict)

    def compute(self, seconds: float, ready: float = 0.0) -> float:
        """Run `seconds` of compute once `ready`; returns its start."""
        start = max(self.compute_at, ready)
        self.compute_at = start + seconds
        self.compute_s += seconds
        return start

    def collective(self, kind: str, what: str, dtype: str, payload: float, ready: float) -> float:
        """A collective of `payload` bytes (the full tensor) issued at `ready`; returns its end."""
        if self.world == 1:
            return ready
        sent = ring_factor(kind, self.world) * payload
        start = max(self.comm_at, ready)
        seconds = self.network.latency_s(self.world) + sent / self.network.bus_bytes_s(self.world)
        self.comm_at = start + seconds
        self.comm_s += seconds
        label = f"{kind} {what} {dtype}"
        self.sent[label] = self.sent.get(label, 0.0) + sent
        self.calls[label] = self.calls.get(label, 0) + 1
        return self.comm_at

    def wait_for_links(self) -> None:
        """The compute stream waits for every collective issued so far."""
        self.compute_at = max(self.compute_at, self.comm_at)


@dataclass(frozen=True)
class Estimate:
    engine: str
    world: int
    nodes: int
    compute_s: float
    comm_s: float
    step_s: float
    sent: dict[str, float]  # bytes each rank sends per step, by collective
    calls: dict[str, int]  # collectives per step, by kind

    @property
    def sent_bytes(self) -> float:
        return sum(self.sent.values())

    @property
    def exposed_s(self) -> float:
        return self.step_s - self.compute_s

    @property
    def overlapped_s(self) -> float:
        return max(0.0, self.comm_s - self.exposed_s)  # not below 0 by rounding

    @property
    def efficiency(self) -> float:
        return self.compute_s / self.step_s


def _forward(t: Timeline, model: Model, compute: Compute, gather: str | None) -> None:
    """One micro-batch's forward; `gather`: the dtype every unit's weights are all-gathered in
    (prefetched one unit ahead), None when they are whole already."""
    units = model.units
    ready = [0.0] * len(units)
    if gather:
        ready[0] = t.collective("all_gather", "weights", gather, DTYPE_BYTES[gather] * units[0].params, t.compute_at)
    for i, unit in enumerate(units):
        start = t.compute(unit.forward_s(compute), ready[i])
        if gather and i + 1 < len(units):
            nxt = units[i + 1]
            ready[i + 1] = t.collective("all_gather", "weights", gather, DTYPE_BYTES[gather] * nxt.params, start)


def _backward(t: Timeline, model: Model, compute: Compute, gather: str | None, reduce: str | None,
              reduce_dtype: str, bucket_bytes: float = 0.0) -> None:
    """One micro-batch's backward. `gather`: the dtype the blocks' weights are all-gathered in again
    (ZeRO-3; the root keeps its own), prefetched one unit ahead. `reduce`: "units" (a reduce-scatter
    per unit as its gradients are ready), "buckets" (DDP's all-reduce of `bucket_bytes` at a time,
    the gradients becoming ready evenly through each block's backward) or None (no sync)."""
    begin = t.compute_at
    blocks = model.blocks[::-1]
    ready = [0.0] * len(blocks)
    if gather and blocks:
        ready[0] = t.collective("all_gather", "weights", gather, DTYPE_BYTES[gather] * blocks[0].params, begin)
    t.compute(model.root.backward_s(compute))
    r = DTYPE_BYTES[reduce_dtype]
    pending = 0.0  # gradient bytes of the open bucket
    for j, block in enumerate(blocks):
        start = t.compute(block.backward_s(compute), ready[j])
        if gather and j + 1 < len(blocks):
            ready[j + 1] = t.collective("all_gather", "weights", gather, DTYPE_BYTES[gather] * blocks[j + 1].params,
                                        start)
        end, grads = t.compute_at, r * block.params
        if reduce == "units":
            t.collective("reduce_scatter", "gradients", reduce_dtype, grads, end)
        elif reduce == "buckets":
            done = 0.0
            while pending + grads - done >= bucket_bytes:  # a bucket fills during this block's backward
                done += bucket_bytes - pending
                t.collective("all_reduce", "gradients", reduce_dtype, bucket_bytes, start + (end - start) * done / grads)
                pending = 0.0
            pending += grads - done
    root_grads = r * model.root.params
    if reduce == "units":
        t.collective("reduce_scatter", "gradients", reduce_dtype, root_grads, t.compute_at)
    elif reduce == "buckets" and pending + root_grads > 0:  # the last bucket, with the root's gradients
        t.collective("all_reduce", "gradients", reduce_dtype, pending + root_grads, t.compute_at)
    if reduce:
        t.wait_for_links()  # the end-of-backward callback waits for the reductions


def _norm(t: Timeline) -> None:
    """The gradients' sum of squares all-reduced after the backward; the optimizer step waits for it."""
    t.collective("all_reduce", "gradient norm", "fp32", NORM_BYTES, t.compute_at)
    t.wait_for_links()


def _fsdp(t: Timeline, model: Model, step: StepConfig, compute: Compute, reduce_dtype: str) -> None:
    """FSDP2 per unit (module docstring: ZeRO-1-3)."""
    last = step.accum - 1
    for k in range(step.accum):
        gather_forward = k == 0 or step.stage == 3
        _forward(t, model, compute, step.precision if gather_forward else None)
        reduce = "units" if step.stage >= 2 or k == last else None
        _backward(t, model, compute, step.precision if step.stage == 3 else None, reduce, reduce_dtype)
    _norm(t)


def _before(t: Timeline, model: Model, step: StepConfig, compute: Compute) -> None:
    if step.stage == 3:
        return _fsdp(t, model, step, compute, "fp32")
    w, n = DTYPE_BYTES[step.precision], model.params
    for _ in range(step.accum):
        _forward(t, model, compute, None)
        _backward(t, model, compute, None, None, step.precision)
        if step.stage == 2:
            t.collective("reduce_scatter", "gradients", step.precision, w * n, t.compute_at)
            t.wait_for_links()
    if step.stage == 0:
        t.collective("all_reduce", "gradients", "fp32", 4 * n, t.compute_at)
        t.wait_for_links()
        return
    if step.stage == 1:
        t.collective("reduce_scatter", "gradients", "fp32", 4 * n, t.compute_at)
        t.wait_for_links()
    _norm(t)
    t.collective("all_gather", "weights", step.precision, w * n, t.compute_at)  # after the optimizer step
    t.wait_for_links()


def _after(t: Timeline, model: Model, step: StepConfig, compute: Compute) -> None:
    if step.stage >= 1:
        return _fsdp(t, model, step, compute, step.reduce_dtype)
    last = step.accum - 1
    every_micro = step.precision != "fp32"  # the unsynced micro-batches would need fp32 gradients kept whole
    for k in range(step.accum):
        _forward(t, model, compute, None)
        sync = every_micro or k == last
        _backward(t, model, compute, None, "buckets" if sync else None, step.reduce_dtype, step.bucket_bytes())


def estimate(engine: str, model: Model, step: StepConfig, world: int, network: Network = Network(),
             compute: Compute = Compute()) -> Estimate:
    """One optimizer step of `engine` (before | after) on `world` ranks (module docstring)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if step.stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {step.stage}")
    t = Timeline(world, network)
    (_before if engine == "before" else _after)(t, model, step, compute)
    return Estimate(engine, world, network.nodes(world), t.compute_s, t.comm_s, max(t.compute_at, t.comm_at),
                    dict(t.sent), dict(t.calls))
