"""ZeRO stages 1-3 on several ranks through PyTorch's FSDP2: `fully_shard` on every transformer
block, then on the objective (the root), with the shared step of train/engine/core.py on top.

FSDP2 keeps each parameter as an fp32 DTensor sharded along dim 0 (the master weights, which
the fused AdamW updates in place), all-gathers a unit's parameters in the compute dtype before
the unit runs (the next unit's gather is issued while this one computes) and reduce-scatters its
gradients in the reduce dtype as soon as the backward has produced them, into sharded fp32
`.grad`s averaged over ranks. The stages differ in when (DeepSpeed's meaning of each stage):
    ZeRO-1  weights gathered once per optimizer step and kept through its micro-batches;
            gradients reduced once, in the last micro-batch's backward (the earlier ones add up
            unsharded, FSDP2's gradient sync off, in FSDP2's reduce dtype: the communication
            dtype, or fp32 with data_types.grad_accum_dtype fp32, the reduce-scatter then casting
            to the communication dtype: `ReduceScatterIn`)
    ZeRO-2  weights gathered once per optimizer step; gradients reduce-scattered in every
            micro-batch's backward (only the shard is kept, summed in fp32)
    ZeRO-3  weights gathered before each unit's forward and again for its backward, freed after
            each; gradients reduce-scattered in every micro-batch's backward
An objective whose loss differentiates through an input gradient (energy's restoration: a
backward inside the forward) keeps the weights gathered through its backward and reshards them
after it, because FSDP2 would otherwise reshard them at the inner backward.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from train.engine.config import EngineConfig
from train.engine.core import EngineCore


def units_of(module: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 gathers and reduces together: every transformer block (encoder and decoder)."""
    from model.vit import Block

    return [m for m in module.modules() if isinstance(m, Block)]


def prefetch_in_order(blocks: list[FSDPModule]) -> None:
    """Each block's forward issues the next block's all-gather before it computes, and each block's
    backward the previous block's, so the gathers overlap compute whether or not the host runs ahead
    of the device (FSDP2 otherwise issues a forward gather only when the host reaches the block).
    `blocks` in the order the forward runs them (registration order: the encoder's, then the
    decoder's); a block run out of that order is gathered where it runs, as without prefetching."""
    for earlier, later in zip(blocks, blocks[1:]):
        earlier.set_modules_to_forward_prefetch([later])
        later.set_modules_to_backward_prefetch([earlier])


class ReduceScatterIn:
    """FSDP2's reduce-scatter (`FSDPModule.set_custom_reduce_scatter`: an object with FSDP2's
    ReduceScatter's `allocate` and call), communicated in `dtype` while FSDP2 holds the gradients
    in a wider one (ZeRO-1's fp32 micro-batch sums): the flat input [n] is cast to `dtype`,
    reduce-scattered, and the shard [n / world] cast back into FSDP2's output. In fp16, whose sum
    over ranks can overflow where their mean would not, an average is divided in two parts,
    before the sum and after it (FSDP2's own rule for an fp16 reduce dtype)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        before, after = 1, 1
        if self.dtype == torch.float16 and op == dist.ReduceOp.AVG:
            op, world = dist.ReduceOp.SUM, group.size()
            while world % (before * 2) == 0 and world / before > before:
                before *= 2
            after = world // before
        narrow = (input_tensor / before if before > 1 else input_tensor).to(self.dtype)
        shard = torch.empty(output_tensor.shape, dtype=self.dtype, device=output_tensor.device)
        dist.reduce_scatter_tensor(shard, narrow, op=op, group=group)
        output_tensor.copy_(shard / after if after > 1 else shard)
        return None  # finished: FSDP2 records its event after the call, on the stream it runs the call on


class ShardedEngine(EngineCore):
    """See the module docstring; the constructor's arguments are ReplicatedEngine's."""

    def __init__(self, module: nn.Module, groups: list[dict], make_optimizer, make_schedule, cfg: EngineConfig,
                 device: torch.device):
        if cfg.stage not in (1, 2, 3):
            raise ValueError(f"the sharded engine runs ZeRO stages 1-3, not {cfg.stage}")
        self.module, self.cfg = module, cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        names = {id(p): n for n, p in module.named_parameters()}
        group_names = [[names[id(p)] for p in g["params"]] for g in groups]
        self.names = [n for g in group_names for n in g]
        module.to(device)
        for sub in module.modules():  # buffers in the compute dtype, as the replicated engine casts them
            for key, buf in sub._buffers.items():
                if buf is not None and buf.is_floating_point():
                    sub._buffers[key] = buf.to(cfg.dtype)
        mesh = init_device_mesh(device.type, (self.world,))
        # inputs are left as the loop made them (MAE's fp32 masking noise must stay fp32), as the replicated engine does
        # ZeRO-1's unsynced micro-batches add up in FSDP2's reduce dtype
        held = cfg.unsynced_dtype if cfg.stage == 1 and cfg.accum > 1 else cfg.reduce_dtype
        policy = MixedPrecisionPolicy(param_dtype=cfg.dtype, reduce_dtype=held, cast_forward_inputs=False)
        blocks = units_of(module)
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=cfg.stage == 3)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False)  # the backward starts there
        prefetch_in_order(blocks)
        self.units: list[FSDPModule] = [*blocks, module]
        if held != cfg.reduce_dtype:
            if not hasattr(module, "set_custom_reduce_scatter"):
                raise RuntimeError(f"data_types.grad_accum_dtype fp32 under ZeRO-1 sums in fp32 and communicates in "
                                   f"{cfg.reduce or cfg.precision} through FSDPModule.set_custom_reduce_scatter, which "
                                   f"torch {torch.__version__} lacks: upgrade torch, or set communication_data_type "
                                   f"fp32 (sums and reduces in fp32) or leave grad_accum_dtype out")
            for unit in self.units:
                unit.set_custom_reduce_scatter(ReduceScatterIn(cfg.reduce_dtype))
        # energy: the restoration's inner backward must not reshard the weights its outer backward uses
        self.double_backward = bool(getattr(module, "double_backward", False))
        if self.double_backward:  # the inner backward runs inside the forward, before backward() is called
            module.set_reshard_after_backward(False)
        params = dict(module.named_parameters())
        self.params = [params[n] for n in self.names]
        optimizer = make_optimizer([{**{k: v for k, v in spec.items() if k != "params"}, "params": [params[n] for n in g]}
                                    for spec, g in zip(groups, group_names)])
        self._setup_step(optimizer, make_schedule, cfg, device, max(g.get("lr_scale", 1.0) for g in groups))

    def __call__(self, batch):
        return self.module(batch)

    def backward(self, loss: torch.Tensor) -> None:
        last = self.last_micro
        if self.cfg.accum > 1 and self.cfg.stage == 1:
            self.module.set_requires_gradient_sync(last)
        if self.cfg.stage in (1, 2) or self.double_backward:  # ZeRO-1/2: gathered once per optimizer step
            self.module.set_reshard_after_backward(last and not self.double_backward)
        self._scaled(loss).backward()
        if self.double_backward and last:
            for unit in self.units:
                unit.reshard()
        self.micro += 1

    def _norm(self) -> torch.Tensor:
        local = [p.grad.to_local() for p in self.params if p.grad is not None]
        sumsq = (torch.stack(torch._foreach_norm(local)).square().sum() if local
                 else torch.zeros((), device=self.device))
        dist.all_reduce(sumsq)  # each rank holds a shard of every gradient
        return sumsq.sqrt()

    def _after_update(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter whole on every rank, in the compute dtype, until the block ends (the
        trainer's evaluation and figures, MLO-MAE's levels II-III): nothing is resharded by a
        forward or backward run inside it."""
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.units:
                unit.reshard()
                unit.set_reshard_after_forward(self.cfg.stage == 3 and unit is not self.module, recurse=False)
                unit.set_reshard_after_backward(not self.double_backward, recurse=False)

    def describe(self) -> str:
        return self.cfg.describe(self.world)

    # --- checkpoints -----------------------------------------------------------------------------
    def master_weights(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.params))
