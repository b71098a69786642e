"""Every rank holds every weight: one rank without any wrapper (every ZeRO stage: there is
nothing to shard), or ZeRO-0 on several ranks through PyTorch's DistributedDataParallel.

    module      the objective in the compute dtype (as DeepSpeed casts it: every floating parameter
                and buffer); DDP wraps it for the forward, the module itself is what the loop sees
    masters     fp32 copies of the trained parameters, the optimizer's tensors (fp32 training:
                the parameters themselves); their `.grad` sums the step's micro-batches in fp32

DDP all-reduces the gradients in buckets while the backward runs, averaging them; a comm hook
reduces them in the configured dtype (`communication_data_type`) when that differs from the
compute dtype. With accumulation, fp32 training skips the reduction on all but the last
micro-batch (DDP's no_sync: the local sums add up in `.grad`, fp32); bf16 / fp16 training reduces
every micro-batch and adds the averaged gradients into the fp32 masters, so that no sum is kept in
16 bits. After the optimizer step one multi-tensor copy casts the masters into the module.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from train.engine.config import EngineConfig
from train.engine.core import EngineCore


def reduce_in(dtype: torch.dtype):
    """A DDP comm hook that all-reduces each bucket in `dtype` and averages it (DDP's own hooks
    compress fp32 to bf16 / fp16; this one also widens bf16 / fp16 gradients to fp32)."""
    def hook(process_group, bucket):
        group = process_group or dist.group.WORLD
        buffer = bucket.buffer()
        wide = buffer.to(dtype).div_(dist.get_world_size(group))
        work = dist.all_reduce(wide, group=group, async_op=True)

        def back(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return work.get_future().then(back)

    return hook


class ReplicatedEngine(EngineCore):
    """See the module docstring. `make_optimizer(groups)` builds the optimizer over the given
    groups (each: "params" and the group's options); `make_schedule(optimizer)` its lr schedule."""

    def __init__(self, module: nn.Module, groups: list[dict], make_optimizer, make_schedule, cfg: EngineConfig,
                 device: torch.device):
        self.module, self.cfg = module, cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        names = {id(p): n for n, p in module.named_parameters()}
        self.names = [names[id(p)] for g in groups for p in g["params"]]
        self.params = [p for g in groups for p in g["params"]]
        module.to(device)
        if self.world > 1:  # every rank starts from rank 0's weights and buffers, exactly (fp32)
            for t in module.state_dict().values():
                if isinstance(t, torch.Tensor):
                    dist.broadcast(t, 0)
        self.low_precision = cfg.dtype != torch.float32
        if self.low_precision:
            self.masters = [p.detach().clone() for p in self.params]
            for m in self.masters:
                m.grad = torch.zeros_like(m)
            module.to(cfg.dtype)
            self.weights = [p.detach() for p in self.params]  # what the cast after each step writes into
            self.master_grads = [m.grad for m in self.masters]
        else:
            self.masters = self.params
        self.ddp = None
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                               broadcast_buffers=False, init_sync=False,  # broadcast above, in fp32
                                               gradient_as_bucket_view=True, bucket_cap_mb=cfg.bucket_mb())
            if cfg.reduce_dtype != cfg.dtype:
                self.ddp.register_comm_hook(None, reduce_in(cfg.reduce_dtype))
        opt_groups, start = [], 0
        for spec in groups:
            n = len(spec["params"])
            opt_groups.append({**{k: v for k, v in spec.items() if k != "params"},
                               "params": self.masters[start:start + n]})
            start += n
        top_scale = max(g.get("lr_scale", 1.0) for g in groups)  # the lr the loop logs
        self._setup_step(make_optimizer(opt_groups), make_schedule, cfg, device, top_scale)

    def __call__(self, batch):
        if self.ddp is None:
            return self.module(batch)
        # DDP decides in the forward whether the backward that follows reduces: no_sync must hold it
        with contextlib.nullcontext() if self.low_precision or self.last_micro else self.ddp.no_sync():
            return self.ddp(batch)

    def backward(self, loss: torch.Tensor) -> None:
        """This micro-batch's gradients added to the step's (reduced over ranks inside the backward
        where several hold the weights, when its forward said so)."""
        self._scaled(loss).backward()
        if self.low_precision:  # into the fp32 sums: the first micro-batch replaces, the others add
            grads = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None
            if any(g is None for g in grads):  # parameters this micro-batch did not reach
                into = [m for m, g in zip(self.master_grads, grads) if g is not None]
                if self.micro == 0:
                    torch._foreach_zero_([m for m, g in zip(self.master_grads, grads) if g is None])
                grads = [g for g in grads if g is not None]
            else:
                into = self.master_grads
            if self.micro == 0:
                torch._foreach_copy_(into, grads)
            elif grads:
                torch._foreach_add_(into, grads)
        elif self.cuda_graphs and self.ddp is None and self.micro == 0 and not self.last_micro:
            # fp32 on one rank sums the micro-batches in `.grad`, and the first one's may be memory of
            # the CUDA graphs' pool (autograd keeps a graph's output as the gradient), which the next
            # micro-batch's replay overwrites: the sum starts in memory of its own.
            for p in self.params:
                if p.grad is not None:
                    p.grad = p.grad.clone()
        self.micro += 1

    def _norm(self) -> torch.Tensor:
        grads = self.master_grads if self.low_precision else [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))  # fp32

    def _after_update(self) -> None:
        if self.low_precision:
            torch._foreach_copy_(self.weights, self.masters)
        else:
            for p in self.params:
                p.grad = None

    def describe(self) -> str:
        return self.cfg.describe(self.world)

    # --- checkpoints -----------------------------------------------------------------------------
    def master_weights(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.masters))

    def weights_loaded(self) -> None:
        if self.low_precision:
            torch._foreach_copy_(self.weights, self.masters)
