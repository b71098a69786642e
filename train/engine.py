"""The training engine: data parallel with ZeRO stages 0-2, fp32 / bf16 / fp16, gradient
accumulation and clipping, as a ds_config describes them, in plain PyTorch over flat buffers.

Why not DeepSpeed's engine: its step checks every gradient tensor separately (15 kernels each)
and copies each gradient into its buckets in backward, so a ViT-B step made 4.5x the kernel
launches of a plain PyTorch loop and waited for the GPU 6 times (docs/PERFORMANCE.md). Here a
step is: forward, backward, then a handful of kernels over flat buffers, and no host read.

Buffers (N = the trained parameters' elements, padded; S = N / world, this rank's shard):
    params  (N,) compute dtype   every trained parameter is a view into it (module.to(dtype) first,
                                 as DeepSpeed casts the module); gathered after each update
    grads   (N,) fp32            the micro-batches' gradients, summed (stages 0-1); stage 2 keeps
                                 only its shard (S,) and reduces every micro-batch
    master  (S,) fp32            the optimizer's weights (stage 0: (N,)); for fp32 training a view
                                 of `params`, else its own fp32 copy
The optimizer (fused AdamW, or LARS) sees each optimizer group's part of the master shard as
one tensor. One optimizer step, on the device:
    sumsq = <g, g> (all-reduced over ranks when sharded)     -> gradient norm, found_inf
    fused AdamW(grad_scale = world x loss scale / clip coefficient, found_inf)
    params <- master (cast; all-gather when sharded); counters and the fp16 scale updated
A step with non-finite gradients is skipped inside the fused kernel (found_inf, as torch's
GradScaler does): weights and moments stay as they were; the loop reads the counters at its
log steps (train/nonfinite.py). ZeRO-3 is train/engine_fsdp.py.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from train.flat import FlatLayout, copy_ranges
from train.loss_scale import DeviceLossScale, LossScaleConfig
from train.nonfinite import DeviceHealth

log = logging.getLogger("engine")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_FILE = "model.pt"


def optim_file(rank: int) -> str:
    return f"optim_rank{rank:05d}.pt"


@dataclass(frozen=True)
class EngineConfig:
    """What the engine takes from the final ds_config (train/ds_config.py checked it)."""
    stage: int
    precision: str  # fp32 | bf16 | fp16
    accum: int  # micro-batches per optimizer step
    clip: float  # gradient_clipping: max global l2 norm, 0 = none
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)

    @classmethod
    def from_ds_config(cls, ds: dict) -> EngineConfig:
        from train.ds_config import precision, zero_stage

        prec = precision(ds)
        return cls(zero_stage(ds), prec, ds["gradient_accumulation_steps"], float(ds.get("gradient_clipping", 0.0)),
                   LossScaleConfig.from_section(ds.get("fp16", {})) if prec == "fp16" else LossScaleConfig())

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]


class EngineCore:
    """What both engines share (this file's Engine, train/engine_fsdp.py's FSDPEngine): the
    optimizer's state made before its first step, the loss scaled for the backward, the step from
    the gradients' global sum of squares (the non-finite flag, the norm, clipping folded into the
    optimizer's unscaling), the counters, and what the loop reads."""

    def _setup_step(self, optimizer, make_schedule, cfg: EngineConfig, device: torch.device, lr_scale: float,
                    grad_divisor: float) -> None:
        """`grad_divisor`: what the optimizer divides the gradients by besides the loss scale (the
        rank count where they are summed over ranks)."""
        self.optimizer, self.cfg = optimizer, cfg
        init_state = getattr(optimizer, "init_state", None) or adamw_state
        for t in (t for g in optimizer.param_groups for t in g["params"]):
            optimizer.state[t] = init_state(t)
        self.schedule = make_schedule(optimizer)
        self.scaler = DeviceLossScale(cfg.loss_scale, device) if cfg.precision == "fp16" else None
        self.health = DeviceHealth(device)
        self.grad_norm = torch.zeros((), device=device)  # of the last optimizer step, unscaled
        self.grad_divisor = torch.tensor(float(grad_divisor), device=device)
        self.lr_scale = lr_scale  # the first parameter group's: the lr the loop logs
        self.micro = 0  # micro-batches since the last optimizer step
        self.steps = 0  # optimizer steps taken (applied or skipped)

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss as backward takes it: times the fp16 loss scale, over the accumulation."""
        if self.scaler is not None:
            loss = loss * self.scaler.scale.to(loss.dtype)
        return loss / self.cfg.accum if self.cfg.accum > 1 else loss

    def _optimizer_step(self, sumsq: torch.Tensor) -> torch.Tensor:
        """One optimizer step from the gradients' global sum of squares (before unscaling); returns
        found_inf (1.0: the step was skipped inside the fused kernel, weights and moments kept)."""
        found_inf = torch.isfinite(sumsq).logical_not().float()
        grad_scale = self.grad_divisor if self.scaler is None else self.grad_divisor * self.scaler.scale
        self.grad_norm = sumsq.sqrt() / grad_scale
        if self.cfg.clip > 0:  # one scale for every gradient: folded into the optimizer's unscaling
            grad_scale = grad_scale / torch.clamp(self.cfg.clip / (self.grad_norm + 1e-6), max=1.0)
        self.optimizer.grad_scale, self.optimizer.found_inf = grad_scale, found_inf
        self.optimizer.step()
        return found_inf

    def _finish_step(self, found_inf: torch.Tensor) -> None:
        self.health.update(found_inf)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        self.schedule.step()
        self.micro = 0
        self.steps += 1

    @property
    def accum(self) -> int:
        return self.cfg.accum

    @property
    def dtype(self) -> torch.dtype:
        return self.cfg.dtype

    def get_lr(self) -> float:
        """The lr of the next optimizer step (the first parameter group's)."""
        return self.schedule.lr_at(self.schedule.last_step) * self.lr_scale

    def device_state(self) -> dict[str, torch.Tensor]:
        """0-dim device tensors the loop reads at its log steps: gradient norm, skip counters, fp16 scale."""
        out = {"grad_norm": self.grad_norm, **self.health.tensors()}
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.scale
            out["loss_scale_collapsed"] = self.scaler.collapsed
        return out

    def _counters(self) -> dict:
        out = {"steps": self.steps, "health": self.health.state_dict()}
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.state_dict()
        return out

    def _load_counters(self, model: dict) -> None:
        """Schedule, step count, skip counters and fp16 scale from a checkpoint's MODEL_FILE."""
        self.schedule.load_state_dict(model["schedule"])
        counters = model["engine"]
        self.steps = counters["steps"]
        self.health.load_state_dict(counters["health"])
        if self.scaler is not None and "loss_scale" in counters:
            self.scaler.load_state_dict(counters["loss_scale"])


class Engine(EngineCore):
    """One objective trained data-parallel (see the module docstring). `make_optimizer(groups)`
    builds the optimizer over the given groups (each: "params" and the group's options);
    `make_schedule(optimizer)` its lr schedule, stepped after every optimizer step."""

    def __init__(self, module: nn.Module, groups: list[dict], make_optimizer, make_schedule, cfg: EngineConfig,
                 device: torch.device, per_param: bool = False):
        if cfg.stage not in (0, 1, 2):
            raise ValueError(f"train/engine.py runs ZeRO stages 0-2, not {cfg.stage} (train/engine_fsdp.py)")
        if per_param and cfg.stage > 0 and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("an optimizer of whole per-parameter tensors (LARS) needs ZeRO stage 0")
        self.module, self.cfg, self.device = module, cfg, device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.sharded = cfg.stage >= 1 and self.world > 1
        names = {id(p): n for n, p in module.named_parameters()}
        named_groups = [[(names[id(p)], p) for p in g["params"]] for g in groups]
        self.layout = FlatLayout(named_groups, self.world)
        self.params = [p for g in named_groups for _, p in g]
        module.to(device)
        full = torch.zeros(self.layout.padded, device=device)  # fp32: the starting weights, exact
        torch._foreach_copy_(self.layout.views(full), [p.detach() for p in self.params])
        if self.world > 1:  # every rank starts from rank 0's weights
            dist.broadcast(full, 0)
        module.to(cfg.dtype)  # as DeepSpeed's engine: every floating parameter and buffer
        self.flat_params = full if cfg.dtype == torch.float32 else full.to(cfg.dtype)
        for p, view in zip(self.params, self.layout.views(self.flat_params)):
            p.data = view
        self.start, self.end = self.layout.shard(self.rank) if self.sharded else (0, self.layout.padded)
        if cfg.dtype == torch.float32:
            self.master = self.flat_params[self.start:self.end]
        else:
            self.master = full[self.start:self.end].clone()
        del full
        # gradient buffers: the full sum of micro-batches (stages 0-1; stage 2: one micro-batch at a
        # time, in the compute dtype) and, when sharded, this rank's reduced shard in fp32
        stage2 = cfg.stage == 2 and self.sharded
        self.flat_grads = torch.zeros(self.layout.padded, device=device, dtype=cfg.dtype if stage2 else torch.float32)
        self.grad_views = self.layout.views(self.flat_grads)
        self.shard_grads = (torch.zeros(self.end - self.start, device=device) if self.sharded
                            else self.flat_grads[self.start:self.end])
        self.stage2_micro = torch.zeros(self.end - self.start, device=device, dtype=cfg.dtype) if stage2 else None
        # the optimizer's tensors: each group's part of the master shard (per_param: each parameter's)
        self.pieces: list[tuple[int, int]] = []  # flat range of each optimizer tensor, in order
        opt_groups = []
        for g, spec in enumerate(groups):
            tensors = []
            ranges = ([(s.offset, s.offset + s.numel) for s in self.layout.slots if s.group == g] if per_param
                      else [(seg.start, seg.end) for seg in self.layout.segments(self.start, self.end) if seg.group == g])
            for a, b in ranges:
                t = self.master[a - self.start:b - self.start]
                t.grad = self.shard_grads[a - self.start:b - self.start]
                if per_param:
                    slot = next(s for s in self.layout.slots if s.offset == a)
                    t, t.grad = t.view(slot.shape), t.grad.view(slot.shape)
                tensors.append(t)
                self.pieces.append((a, b))
            if tensors:  # a group with no part in this shard is left out
                opt_groups.append({**{k: v for k, v in spec.items() if k != "params"}, "params": tensors})
        optimizer = make_optimizer(opt_groups)
        self.opt_tensors = [t for g in optimizer.param_groups for t in g["params"]]
        # the gradients are sums over ranks: the optimizer divides by their count
        self._setup_step(optimizer, make_schedule, cfg, device, groups[0].get("lr_scale", 1.0), self.world)

    # --- the loop's calls ------------------------------------------------------------------------
    def __call__(self, batch):
        return self.module(batch)

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of `loss` (this micro-batch's mean) added to the step's sum."""
        self._scaled(loss).backward()
        first = self.micro == 0 or self.stage2_micro is not None
        grads, into, unused = [], [], []
        for p, view in zip(self.params, self.grad_views):
            if p.grad is None:
                unused.append(view)
            else:
                grads.append(p.grad)
                into.append(view)
                p.grad = None
        if first:
            torch._foreach_copy_(into, grads)
            if unused:
                torch._foreach_zero_(unused)
        elif grads:
            torch._foreach_add_(into, grads)
        if self.stage2_micro is not None:  # ZeRO-2: reduce this micro-batch now, keep only this rank's shard
            dist.reduce_scatter_tensor(self.stage2_micro, self.flat_grads)
            if self.micro == 0:
                self.shard_grads.copy_(self.stage2_micro)
            else:
                self.shard_grads.add_(self.stage2_micro)
        self.micro += 1

    def step(self) -> None:
        """Called after every micro-batch (as DeepSpeed's engine.step()); the last one of an
        optimizer step updates the weights."""
        if self.micro < self.cfg.accum:
            return
        self._reduce()
        g = self.shard_grads
        sumsq = torch.dot(g, g)  # fp32; NaN / inf if any element is
        if self.sharded:
            dist.all_reduce(sumsq)
        found_inf = self._optimizer_step(sumsq)
        self._publish()
        self._finish_step(found_inf)

    def _reduce(self) -> None:
        """The summed gradients of every rank where the optimizer reads them."""
        if self.world == 1 or self.stage2_micro is not None:
            return
        if self.sharded:
            dist.reduce_scatter_tensor(self.shard_grads, self.flat_grads)
        else:
            dist.all_reduce(self.flat_grads)

    def _publish(self) -> None:
        """The updated master weights into the compute-dtype parameters of every rank."""
        mine = self.flat_params[self.start:self.end]
        if mine.data_ptr() != self.master.data_ptr():
            mine.copy_(self.master)
        if self.sharded:
            dist.all_gather_into_tensor(self.flat_params, mine)

    @property
    def stage(self) -> int:
        return self.cfg.stage

    def gathered(self):
        """Every parameter whole on every rank: always so below ZeRO-3."""
        return contextlib.nullcontext()

    # --- checkpoints -----------------------------------------------------------------------------
    def full_master(self) -> torch.Tensor:
        """The fp32 weights of every trained parameter, flat (a collective when sharded)."""
        if not self.sharded:
            return self.master
        full = torch.empty(self.layout.padded, device=self.device)
        dist.all_gather_into_tensor(full, self.master)
        return full

    def save(self, tag_dir: Path, client: dict) -> None:
        """Collective. Rank 0: MODEL_FILE (fp32 weights, buffers, objective state, schedule,
        counters, `client`); every rank holding optimizer state: its optim file."""
        master = self.full_master()
        if self.rank == 0:
            state = self.module.state_dict()
            for slot, view in zip(self.layout.slots, self.layout.views(master)):
                state[slot.name] = view.detach().to("cpu", copy=True)
            torch.save({"module": state, "layout": self.layout.describe(), "schedule": self.schedule.state_dict(),
                        "engine": self._counters(), "client": client}, tag_dir / MODEL_FILE)
        if self.sharded or self.rank == 0:
            pieces = []
            for (a, b), t in zip(self.pieces, self.opt_tensors):
                st = self.optimizer.state[t]
                pieces.append({"start": a, "end": b,
                               "state": {k: (v.detach().flatten() if v.shape == t.shape else v.detach()).cpu()
                                         for k, v in st.items()}})
            torch.save({"layout": self.layout.describe(), "optimizer": type(self.optimizer).__name__,
                        "pieces": pieces}, tag_dir / optim_file(self.rank))

    def load(self, tag_dir: Path) -> dict:
        """Weights, optimizer state, schedule and counters from a checkpoint tag of any world size
        and ZeRO stage (train/engine_fsdp.py's too); returns its client state."""
        model = torch.load(tag_dir / MODEL_FILE, map_location="cpu", weights_only=True, mmap=True)
        self.module.load_state_dict(model["module"])  # every parameter (cast) and buffer, objective state
        state = model["module"]
        for slot in self.layout.slots:  # this rank's part of the fp32 weights, exact
            lo, hi = max(slot.offset, self.start), min(slot.offset + slot.numel, self.end)
            if lo < hi:
                self.master[lo - self.start:hi - self.start].copy_(
                    state[slot.name].reshape(-1)[lo - slot.offset:hi - slot.offset])
        self._load_optimizer(tag_dir)
        self._load_counters(model)
        self._publish()
        return model["client"]

    def _load_optimizer(self, tag_dir: Path) -> None:
        saved = saved_optimizer_pieces(tag_dir, self.optimizer)
        named = {s.name: (s.offset, s.numel) for s in self.layout.slots}
        for (a, b), t in zip(self.pieces, self.opt_tensors):
            mine = {n: r for n, r in named.items() if r[0] < b and r[0] + r[1] > a}
            for key, value in self.optimizer.state[t].items():
                if value.shape != t.shape:  # a scalar (AdamW's step): the same in every piece
                    value.copy_(saved[key][0][2])
                else:
                    copy_ranges(value.view(-1), a, mine, saved[key])


Piece = tuple[dict[str, tuple[int, int]], int, torch.Tensor]  # (layout {name: (offset, numel)}, first element, values)


def saved_optimizer_pieces(tag_dir: Path, optimizer) -> dict[str, list[Piece]]:
    """Every rank's optimizer state in a checkpoint tag, by state key: [(the saving run's layout
    {name: (offset, numel)}, the piece's first flat element, its values)] for train/flat.py's
    copy_ranges. Refused when the tag holds another optimizer's state."""
    files = sorted(tag_dir.glob("optim_rank*.pt"))
    saved = [torch.load(f, map_location="cpu", weights_only=True, mmap=True) for f in files]
    kind = type(optimizer).__name__
    if any(s["optimizer"] != kind for s in saved):
        raise ValueError(f"{tag_dir} holds {saved[0]['optimizer']} state; this run's optimizer is {kind}")
    out: dict[str, list] = {}
    for s in saved:
        layout = {n: (o, c) for n, o, c in s["layout"]}
        for piece in s["pieces"]:
            for key, values in piece["state"].items():
                out.setdefault(key, []).append((layout, piece["start"], values))
    return out


def adamw_state(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """torch's AdamW state for a tensor, made before the first step (a checkpoint loads into it);
    the fused kernel keeps `step` as an fp32 tensor beside the moments."""
    return {"step": torch.zeros((), dtype=torch.float32, device=t.device),
            "exp_avg": torch.zeros_like(t, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(t, memory_format=torch.preserve_format)}
