"""ZeRO-3: every parameter sharded across the ranks, through PyTorch's FSDP2 (`fully_shard` on each
transformer block, then on the objective), with train/engine.py's step around it.

FSDP2 keeps each parameter as an fp32 DTensor sharded along dim 0 (the master weights), gathers a
block's parameters in the compute dtype just before the block runs and frees them after it, and
reduce-scatters each micro-batch's gradients in fp32 into the sharded `.grad` (averaged over
ranks). The step is train/engine.py's: the sum of squares of the local gradient shards,
all-reduced, gives the norm and `found_inf`; the fused AdamW over the DTensor parameters unscales
(loss scale, clipping) and skips a non-finite step on the device; counters and the fp16 scale are
updated on the device. Checkpoints use train/engine.py's format (weights and optimizer state by
parameter name and flat range), so a ZeRO-3 run resumes on stage 0-2 and back.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from train.engine import MODEL_FILE, EngineConfig, EngineCore, optim_file, saved_optimizer_pieces
from train.flat import FlatLayout, copy_ranges


def _rows(p: nn.Parameter, rank: int, world: int) -> tuple[int, int]:
    """The dim-0 rows of `p` that `rank` holds (torch.chunk's split, as FSDP2 shards)."""
    n = p.shape[0]
    per = -(-n // world)
    return min(n, rank * per), min(n, (rank + 1) * per)


class FSDPEngine(EngineCore):
    """train/engine.py's Engine interface for ZeRO-3 (see the module docstring)."""

    def __init__(self, module: nn.Module, groups: list[dict], make_optimizer, make_schedule, cfg: EngineConfig,
                 device: torch.device):
        from model.vit import Block

        self.module, self.cfg, self.device = module, cfg, device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        names = {id(p): n for n, p in module.named_parameters()}
        group_names = [[names[id(p)] for p in g["params"]] for g in groups]
        module.to(device)
        for sub in module.modules():  # buffers in the compute dtype, as the engine of stages 0-2 has them
            for key, buf in sub._buffers.items():
                if buf is not None and buf.is_floating_point():
                    sub._buffers[key] = buf.to(cfg.dtype)
        policy = MixedPrecisionPolicy(param_dtype=cfg.dtype, reduce_dtype=torch.float32)
        for sub in module.modules():
            if isinstance(sub, Block):
                fully_shard(sub, mp_policy=policy)
        fully_shard(module, mp_policy=policy)
        params = dict(module.named_parameters())
        named_groups = [[(n, params[n]) for n in g] for g in group_names]
        self.params = [p for g in named_groups for _, p in g]
        self.names = [n for g in named_groups for n, _ in g]
        # checkpoints: a virtual flat vector of every parameter end to end (no padding), in which
        # this rank's rows of each parameter are one range
        self.layout = FlatLayout(named_groups, world=1, align=1)
        optimizer = make_optimizer([{**{k: v for k, v in spec.items() if k != "params"}, "params": [p for _, p in g]}
                                    for spec, g in zip(groups, named_groups)])
        # FSDP2 averages the gradients over ranks itself: nothing to divide by but the loss scale
        self._setup_step(optimizer, make_schedule, cfg, device, groups[0].get("lr_scale", 1.0), 1.0)

    def __call__(self, batch):
        return self.module(batch)

    def backward(self, loss: torch.Tensor) -> None:
        self._scaled(loss).backward()  # FSDP2 reduce-scatters into the sharded .grad, adding to the earlier micro-batches'
        self.micro += 1

    def step(self) -> None:
        if self.micro < self.cfg.accum:
            return
        local = [p.grad.to_local() for p in self.params if p.grad is not None]
        sumsq = torch.stack(torch._foreach_norm(local)).square().sum() if local else torch.zeros((), device=self.device)
        dist.all_reduce(sumsq)
        found_inf = self._optimizer_step(sumsq)
        self.optimizer.zero_grad(set_to_none=True)
        self._finish_step(found_inf)

    @property
    def stage(self) -> int:
        return 3

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter whole on every rank (evaluation outside the objective's forward)."""
        self.module.unshard()
        try:
            yield
        finally:
            self.module.reshard()

    # --- checkpoints: train/engine.py's format ----------------------------------------------------
    def save(self, tag_dir: Path, client: dict) -> None:
        # every parameter whole (frozen ones too: FSDP2 shards them alike); a collective in the same order on every rank
        full = {n: p.full_tensor() for n, p in self.module.named_parameters()}
        if self.rank == 0:
            state = {k: v for k, v in self.module.state_dict().items() if k not in full}
            state.update({n: t.detach().to("cpu", copy=True) for n, t in full.items()})
            torch.save({"module": state, "layout": self.layout.describe(), "schedule": self.schedule.state_dict(),
                        "engine": self._counters(), "client": client}, tag_dir / MODEL_FILE)
        del full
        pieces = []
        for slot, p in zip(self.layout.slots, self.params):
            a, b = _rows(p, self.rank, self.world)
            row = slot.numel // p.shape[0]
            st = self.optimizer.state[p]
            pieces.append({"start": slot.offset + a * row, "end": slot.offset + b * row, "state": {
                k: (v.to_local().detach().flatten() if hasattr(v, "to_local") else v.detach()).cpu() for k, v in st.items()}})
        torch.save({"layout": self.layout.describe(), "optimizer": type(self.optimizer).__name__, "pieces": pieces},
                   tag_dir / optim_file(self.rank))

    def load(self, tag_dir: Path) -> dict:
        model = torch.load(tag_dir / MODEL_FILE, map_location="cpu", weights_only=True, mmap=True)
        state = model["module"]
        sharded = dict(self.module.named_parameters())
        missing, unexpected = self.module.load_state_dict({k: v for k, v in state.items() if k not in sharded},
                                                          strict=False)
        if unexpected or set(missing) - set(sharded) or set(sharded) - set(state):
            raise ValueError(f"{tag_dir / MODEL_FILE} does not fit this objective: missing "
                             f"{sorted((set(missing) - set(sharded)) | (set(sharded) - set(state)))}, "
                             f"unexpected {sorted(unexpected)}")
        saved = saved_optimizer_pieces(tag_dir, self.optimizer)
        with torch.no_grad():
            for name, p in sharded.items():  # this rank's rows of every parameter
                a, b = _rows(p, self.rank, self.world)
                p.to_local().copy_(state[name][a:b])
            for slot, name, p in zip(self.layout.slots, self.names, self.params):
                a, b = _rows(p, self.rank, self.world)
                if a == b:
                    continue
                row = slot.numel // p.shape[0]
                for key, value in self.optimizer.state[p].items():
                    if not hasattr(value, "to_local"):  # AdamW's step
                        value.copy_(saved[key][0][2])
                    else:
                        copy_ranges(value.to_local().view(-1), slot.offset + a * row, {name: (slot.offset, slot.numel)},
                                    saved[key])
        self._load_counters(model)
        return model["client"]
