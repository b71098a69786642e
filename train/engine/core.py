"""The step every engine shares (train/engine/replicated.py, train/engine/sharded.py): the
optimizer's state made before its first step, the loss scaled for the backward, one optimizer step
from the gradients' global sum of squares, the counters, and what the loop calls.

One optimizer step, on the device, without a host read:
    norm = the gradients' global l2 norm (their squares all-reduced over ranks where each holds a shard)
    found_inf = norm is not finite                      -> the step is skipped inside the fused kernel
    fused AdamW(grad_scale = loss scale / clip coefficient, found_inf)
    counters and the fp16 loss scale updated on the device (train/engine/nonfinite.py, train/engine/loss_scale.py)
Gradients arrive averaged over ranks (DDP and FSDP2 both average), so the optimizer divides by
the loss scale only; clipping is folded into that one scale. A skipped step leaves weights and
moments as they were, as torch's GradScaler does.
"""
from __future__ import annotations

import abc
import contextlib
from pathlib import Path

import torch

from model.adamw_state import adamw_state  # made before the first step: a checkpoint loads into it
from train.engine.config import EngineConfig
from train.engine.loss_scale import DeviceLossScale
from train.engine.nonfinite import DeviceHealth
from train.engine.state_files import load as load_tag
from train.engine.state_files import save as save_tag

LOSS_DTYPES = (torch.float32, torch.float64)


def check_loss_dtype(loss: torch.Tensor) -> None:
    """Refuse a 16-bit loss: backward seeds it with the fp16 loss scale (2**16 by default), which is
    inf in fp16, so every step would overflow; in bf16 the loss keeps 8 bits of mantissa. A dtype
    check reads no device value: no host sync."""
    if loss.dtype not in LOSS_DTYPES:
        raise TypeError(f"the objective's loss is {loss.dtype}, the engine takes a torch.float32 (or float64) loss: "
                        f"compute the loss in fp32, e.g. logits.float() before the loss function")


class EngineCore(abc.ABC):
    """What the loop calls: engine(batch), backward(loss), step() after every micro-batch,
    after_optimizer_step(lr, batches) after every optimizer step, device_state() at reads; and
    save(tag) / load(tag) for checkpoints (train/engine/state_files.py: the same files from every
    engine, so a checkpoint resumes on any world size and ZeRO stage)."""

    cuda_graphs = False  # the module's compiled blocks replay as CUDA graphs (train/run/build.py uses_cuda_graphs)

    module: torch.nn.Module  # the objective (FSDP2 wraps it in place; DDP's wrapper is kept apart)
    names: list[str]  # the trained parameters' names, in optimizer order
    rank: int
    world: int

    def _setup_step(self, optimizer, make_schedule, cfg: EngineConfig, device: torch.device, lr_scale: float) -> None:
        self.optimizer, self.cfg, self.device = optimizer, cfg, device
        init_state = getattr(optimizer, "init_state", None) or adamw_state
        for t in (t for g in optimizer.param_groups for t in g["params"]):
            optimizer.state[t] = init_state(t)
        self.schedule = make_schedule(optimizer)
        self.scaler = DeviceLossScale(cfg.loss_scale, device) if cfg.precision == "fp16" else None
        self.health = DeviceHealth(device)
        self.grad_norm = torch.zeros((), device=device)  # of the last optimizer step, unscaled
        self.one = torch.ones((), device=device)  # the gradient scale without fp16's loss scale
        self.lr_scale = lr_scale  # the largest group's (under layer decay: the head's, 1): the lr the loop logs
        self.micro = 0  # micro-batches since the last optimizer step
        self.steps = 0  # optimizer steps taken (applied or skipped)

    # --- the loop's calls ------------------------------------------------------------------------
    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss as backward takes it: times the fp16 loss scale, over the accumulation."""
        check_loss_dtype(loss)
        if self.scaler is not None:
            loss = loss * self.scaler.scale.to(loss.dtype)
        return loss / self.cfg.accum if self.cfg.accum > 1 else loss

    @property
    def last_micro(self) -> bool:
        """The micro-batch about to run backward is the optimizer step's last."""
        return self.micro == self.cfg.accum - 1

    @torch.no_grad()
    def step(self) -> None:
        """Called after every micro-batch (as DeepSpeed's engine.step()); the last one of an
        optimizer step updates the weights. Under no_grad: nothing here is differentiated, and
        reading FSDP2's DTensor gradients (`to_local`) with grad mode on runs an autograd Function
        per parameter, about 1 ms of host time a step at ViT-B."""
        if self.micro < self.cfg.accum:
            return
        found_inf = self._optimizer_step(self._norm())
        self._after_update()
        self.health.update(found_inf)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        self.schedule.step()
        self.micro = 0
        self.steps += 1

    @abc.abstractmethod
    def _norm(self) -> torch.Tensor:
        """The global l2 norm of the step's gradients (before unscaling; NaN / inf if any element is)."""

    def _after_update(self) -> None:
        """After the optimizer step: the compute-dtype weights follow the master weights, gradients cleared."""

    def _optimizer_step(self, norm: torch.Tensor) -> torch.Tensor:
        """One optimizer step; returns found_inf (1.0: skipped inside the fused kernel)."""
        found_inf = torch.isfinite(norm).logical_not().float()
        grad_scale = self.one if self.scaler is None else self.scaler.scale
        self.grad_norm = norm / grad_scale
        if self.cfg.clip > 0:  # one scale for every gradient: folded into the optimizer's unscaling
            grad_scale = grad_scale / torch.clamp(self.cfg.clip / (self.grad_norm + 1e-6), max=1.0)
        self.optimizer.grad_scale, self.optimizer.found_inf = grad_scale, found_inf
        self.optimizer.step()
        return found_inf

    def after_optimizer_step(self, lr: float, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The objective's hook for state outside the optimizer (AdPE's adversaries, MLO-MAE's
        levels II-III), with every weight whole where the objective reads them there."""
        with self.gathered() if getattr(self.module, "hook_reads_weights", False) else contextlib.nullcontext():
            return self.module.after_optimizer_step(lr, batches)

    def gathered(self):
        """Every parameter whole on every rank (collective where they are sharded)."""
        return contextlib.nullcontext()

    def share_running_stats(self) -> None:
        """Collective: every rank takes rank 0's BatchNorm running statistics (the linear probe's),
        which each rank otherwise updates from its own batches. DDP's default broadcasts rank 0's
        buffers before every forward, so an evaluation, as in MAE's code, reads rank 0's; checkpoints
        hold rank 0's too, so an evaluation after a resume reads the same."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        stats = [t for m in self.module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                 for t in (m.running_mean, m.running_var, m.num_batches_tracked) if t is not None]
        for t in stats:
            torch.distributed.broadcast(t, 0)

    @property
    def accum(self) -> int:
        return self.cfg.accum

    @property
    def dtype(self) -> torch.dtype:
        return self.cfg.dtype

    @property
    def stage(self) -> int:
        return self.cfg.stage

    def get_lr(self) -> float:
        """The lr of the next optimizer step: the largest any parameter group takes (under layer-wise
        decay the head's, the schedule's own lr; the layers below take lr_scale times it)."""
        return self.schedule.lr_at(self.schedule.last_step) * self.lr_scale

    def device_state(self) -> dict[str, torch.Tensor]:
        """0-dim device tensors the loop reads at its log steps: gradient norm, skip counters, fp16 scale."""
        out = {"grad_norm": self.grad_norm, **self.health.tensors()}
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.scale
            out["loss_scale_collapsed"] = self.scaler.collapsed
        return out

    @abc.abstractmethod
    def describe(self) -> str:
        """How this engine trains and communicates, for the start line and meta.json."""

    # --- checkpoints -----------------------------------------------------------------------------
    def counters(self) -> dict:
        out = {"steps": self.steps, "health": self.health.state_dict(), "schedule": self.schedule.state_dict()}
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.state_dict()
        return out

    def load_counters(self, counters: dict) -> None:
        self.schedule.load_state_dict(counters["schedule"])
        self.steps = counters["steps"]
        self.health.load_state_dict(counters["health"])
        if self.scaler is not None and "loss_scale" in counters:
            self.scaler.load_state_dict(counters["loss_scale"])

    def save(self, tag_dir: Path, client: dict) -> None:
        """Collective: the tag's engine files (train/engine/state_files.py)."""
        save_tag(self, tag_dir, client)

    def load(self, tag_dir: Path) -> dict:
        """Weights, optimizer state, schedule and counters from a tag written by any engine, world
        size or ZeRO stage; returns its client state."""
        return load_tag(self, tag_dir)

    # what train/engine/state_files.py reads and writes, per engine
    @abc.abstractmethod
    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 weights the optimizer updates, by parameter name (DTensors where sharded)."""

    def weights_finite(self) -> bool:
        """Every master weight finite, on every rank (one collective where there are several). The
        step skips non-finite gradients, but an update from finite ones can still overflow the
        weights (an lr or weight decay far too large): checked before a checkpoint keeps them."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        local = [w.to_local() if isinstance(w, DTensor) else w for w in self.master_weights().values()]
        finite = torch.stack([torch.isfinite(w).all() for w in local]).all().float() if local else self.one.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def weights_loaded(self) -> None:
        """After the master weights were overwritten: the compute-dtype weights follow."""
