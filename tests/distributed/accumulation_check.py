"""Run on two ranks by tests/distributed/test_accumulation.py (not collected by pytest).

    accumulation_check.py OUT_DIR

ZeRO-1 with ACCUM micro-batches per step, on a module whose loss is (weight * x).sum(), so a
micro-batch's gradient is its x (over ACCUM, the engine's loss scaling). Rank r's first
micro-batch holds (r + 1) and the others (r + 1) * 2**-(m + 2), m the compute dtype's mantissa
bits: each later one is under half a unit in the last place of the running sum in the compute
dtype, so a sum kept there ends where it started, and a sum kept in fp32 does not. For each
setting (precision, data_types.grad_accum_dtype, communication_data_type) rank 0 writes the
sharded gradients of two optimizer steps and the dtypes the reduce-scatters of ReduceScatterIn
communicated in, to OUT_DIR/accumulation.json; ReduceScatterIn's fp16 mean of two values whose
sum fp16 cannot hold; and, for ZeRO-0 (DDP), how many gradient buckets each micro-batch's
backward all-reduced and the gradient the step ends with.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rank_end import end_rank
from torch import nn

from train.engine import distributed
from train.engine.config import EngineConfig
from train.engine.loss_scale import LossScaleConfig
from train.engine.replicated import ReplicatedEngine
from train.engine.sharded import ReduceScatterIn, ShardedEngine

ACCUM = 8
WIDTH = 8  # four elements per rank
SETTINGS = (("bf16", "", ""), ("bf16", "fp32", ""), ("bf16", "", "fp32"), ("fp16", "", ""), ("fp16", "fp32", ""))
MANTISSA = {"bf16": 7, "fp16": 10}


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, batch):
        return {"loss": (self.weight * batch["x"]).sum(dtype=torch.float32)}


def gradients(precision: str, accumulate: str, reduce: str, rank: int) -> list[list[float]]:
    """The local gradient shard after each of two optimizer steps' backwards."""
    cfg = EngineConfig(stage=1, precision=precision, accum=ACCUM, clip=0.0, reduce=reduce, accumulate=accumulate,
                       loss_scale=LossScaleConfig(loss_scale=1.0))  # fp16: a static scale of 1 keeps the values exact
    module = Scale()
    adamw = lambda groups: torch.optim.AdamW(groups, lr=0.0, fused=True)  # noqa: E731 (the engine's fused step)
    constant = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # noqa: E731
    engine = ShardedEngine(module, [{"params": [module.weight]}], adamw, constant, cfg, torch.device("cpu"))
    small = 2.0 ** -(MANTISSA[precision] + 2)
    shards = []
    for _ in range(2):
        for m in range(ACCUM):
            x = torch.full((WIDTH,), (rank + 1) * (1.0 if m == 0 else small))
            engine.backward(engine({"x": x})["loss"])
            if m == ACCUM - 1:
                shards.append(engine.params[0].grad.to_local().tolist())
            engine.step()
    return shards


DDP_ACCUM = 3


def ddp_reductions(precision: str, rank: int) -> dict:
    """ZeRO-0 with DDP_ACCUM micro-batches: the buckets each micro-batch's backward all-reduced
    (a counting comm hook around DDP's own all-reduce), and the step's gradient. Rank r's
    micro-batch m holds (r + 1) * (m + 1)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    cfg = EngineConfig(stage=0, precision=precision, accum=DDP_ACCUM, clip=0.0,
                       loss_scale=LossScaleConfig(loss_scale=1.0))
    module = Scale()
    adamw = lambda groups: torch.optim.AdamW(groups, lr=0.0, fused=True)  # noqa: E731 (the engine's fused step)
    constant = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # noqa: E731
    engine = ReplicatedEngine(module, [{"params": [module.weight]}], adamw, constant, cfg, torch.device("cpu"))
    buckets = []

    def counting(state, bucket):
        buckets[-1] += 1
        return allreduce_hook(state, bucket)

    engine.ddp.register_comm_hook(None, counting)
    for m in range(DDP_ACCUM):
        buckets.append(0)
        engine.backward(engine({"x": torch.full((WIDTH,), float((rank + 1) * (m + 1)))})["loss"])
    grad = (engine.master_grads[0] if engine.low_precision else module.weight.grad).tolist()
    engine.step()
    return {"buckets": buckets, "grad": grad}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank, _, _ = distributed.init()
    communicated = []
    plain = dist.reduce_scatter_tensor

    def recording(output, input, *args, **kwargs):  # noqa: A002 (torch's keyword names)
        communicated.append(str(input.dtype).removeprefix("torch."))
        return plain(output, input, *args, **kwargs)

    dist.reduce_scatter_tensor = recording
    result = {}
    for precision, accumulate, reduce in SETTINGS:
        communicated.clear()
        shards = gradients(precision, accumulate, reduce, rank)
        result[f"{precision} {accumulate or '-'} {reduce or '-'}"] = {"shards": shards, "communicated": communicated[:]}
    # fp16: each rank's 40000 averages to 40000, but their sum (80000) is past fp16's largest value
    shard = torch.empty(WIDTH // 2)
    ReduceScatterIn(torch.float16)(shard, torch.full((WIDTH,), 40000.0), dist.group.WORLD, dist.ReduceOp.AVG)
    result["fp16 mean of 40000"] = shard.tolist()
    for precision in ("fp32", "bf16"):
        result[f"ddp {precision}"] = ddp_reductions(precision, rank)
    if rank == 0:
        (out / "accumulation.json").write_text(json.dumps(result))
    end_rank()


if __name__ == "__main__":
    main(Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))
