"""The arithmetic of an objective's optimizer step, by phase, counted rather than modelled.

`step_flops` builds the configured objective on PyTorch's meta device (shapes only: no memory, no
arithmetic) and runs its training step there under a counter of torch's FLOP formulas
(`FlopCount`), one per phase: the forward (for energy with its restoration steps, which differentiate inside the
forward), autograd's backward (for energy a double backward), and the objective's after-step
hook (MLO-MAE's levels II and III, AdPE's adversary). The counter takes every matmul,
convolution and attention, forward and backward, so it sees the passes that costs.py's
convention (training = 3 x forward matmuls) leaves out. The optimizer's update is elementwise:
not counted. `steps` optimizer steps are run and averaged, so hooks that work every k-th step
are spread over their period.

`optimizer_step_flops` is one rank's optimizer step with its accumulation; `training_flops` is
what train/bench.py's TFLOP/s and MFU and the dry run's "training GFLOPs" take: the count for the
objectives whose modules' forward hooks miss part of the step (energy, MLO-MAE), costs.py's
model for the rest (the count within 1% there: tests/train/estimate/test_training_flops.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from model.objectives import OBJECTIVES, build_objective
from train.config.options import PretrainConfig, encoder_img_size, section
from train.config.plan import build_encoder
from train.estimate.costs import Profile, example_batch

PHASES = ("forward", "backward", "after_step")


class FlopCount(TorchDispatchMode):
    """FLOPs of the aten ops run inside it, by torch's own formulas (torch.utils.flop_counter's
    registry: matmuls, convolutions, attention, forward and backward). FlopCounterMode itself also
    tracks modules with backward hooks, which autograd.grad on a leaf (energy's restoration) refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops += count(*args, **kwargs, out_val=out)
        return out


def step_batch(cfg: PretrainConfig, micro: int, device="meta") -> dict[str, torch.Tensor]:
    """A batch shaped like the training stream's, with a D_val batch where the objective reads one
    (MLO-MAE: data/split.py attaches it); labels 0, a class every classifier has; off the meta
    device, Gaussian images (all-zero ones would tie every TopK logit)."""
    batch = example_batch(cfg.data, micro, encoder_img_size(cfg), cfg.model.in_chans, device)
    if batch["image"].device.type != "meta":
        batch["image"] = torch.randn_like(batch["image"])
    batch["label"] = batch["label"].clamp(max=0)
    batch["val_image"], batch["val_label"] = batch["image"], batch["label"]
    return batch


def build_step(cfg: PretrainConfig, micro: int, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "meta") -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The configured objective in `dtype` as the engine casts it (what stays fp32, such as MLO-MAE's
    masking network and head and its level-III copies, stays fp32) and one micro-batch, on `device`."""
    with torch.device(device):
        objective = build_objective(cfg.objective, build_encoder(cfg), section(cfg)).to(dtype)
        batch = step_batch(cfg, micro, device)
        batch["image"] = batch["image"].to(dtype)
        batch["val_image"] = batch["image"]
    return objective, batch


def run_step(objective: torch.nn.Module, batch: dict[str, torch.Tensor], phase: Callable[[str, Callable], object],
             optimizer: torch.optim.Optimizer | None = None) -> None:
    """One optimizer step of one micro-batch as the loop runs it, each part through
    `phase(name, fn)`: forward, backward, the optimizer's update (when given), after_step."""
    loss = phase("forward", lambda: objective(batch)["loss"])
    phase("backward", loss.backward)
    if optimizer is not None:
        phase("optimizer", optimizer.step)
    objective.zero_grad(set_to_none=True)
    phase("after_step", lambda: objective.after_optimizer_step(1e-4, [batch]))


def flops_by_step(cfg: PretrainConfig, micro: int, steps: int = 1,
                  dtype: torch.dtype = torch.bfloat16) -> list[dict[str, float]]:
    """FLOPs per image of each of `steps` optimizer steps of one micro-batch, by phase (PHASES)."""
    objective, batch = build_step(cfg, micro, dtype)
    out = []
    for _ in range(steps):
        totals = dict.fromkeys(PHASES, 0.0)

        def counted(phase: str, fn):
            with FlopCount() as counter:
                result = fn()
            totals[phase] += counter.flops / micro
            return result

        run_step(objective, batch, counted)
        out.append(totals)
    return out


def step_flops(cfg: PretrainConfig, micro: int, steps: int = 1,
               dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """FLOPs per image of one optimizer step of one micro-batch, by phase (PHASES), averaged over
    `steps` steps (hooks that work every k-th step spread over their period)."""
    each = flops_by_step(cfg, micro, steps, dtype)
    return {phase: sum(s[phase] for s in each) / steps for phase in PHASES}


def optimizer_step_flops(cfg: PretrainConfig, micro: int, accum: int,
                         dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """FLOPs (not per image) of one optimizer step on one rank, by phase (PHASES): `accum` micro-batches
    of `micro` images through forward and backward (one counted, times `accum`: each is the same
    arithmetic), then the after-step hook on the step's `accum` micro-batches. The hook is taken in
    its steady state: averaged over its period (Objective.after_step_period) after a first period
    that fills what it keeps (MLO-MAE with level2_batch own reads the step before's batches)."""
    objective, batch = build_step(cfg, micro, dtype)
    with FlopCount() as forward:
        loss = objective(batch)["loss"]
    with FlopCount() as backward:
        loss.backward()
    objective.zero_grad(set_to_none=True)
    period = objective.after_step_period
    after_step = 0
    for step in range(2 * period):
        with FlopCount() as hook:
            objective.after_optimizer_step(1e-4, [batch] * accum)
        after_step += hook.flops if step >= period else 0
    return {"forward": accum * forward.flops, "backward": accum * backward.flops, "after_step": after_step / period}


def training_flops(cfg: PretrainConfig, prof: Profile, micro: int, accum: int) -> float:
    """Training FLOPs of one rank's optimizer step of `accum` micro-batches of `micro` images, what
    MFU divides by: modelled (3 x the forward of what trains, from `prof` of one micro-batch:
    train/estimate/costs.py), or counted by running the step where the objective computes what
    its modules' forward hooks do not see (Objective.counted_flops: energy, MLO-MAE)."""
    if not OBJECTIVES[cfg.objective][1].counted_flops:
        return prof.train_flops * accum
    return sum(optimizer_step_flops(cfg, micro, accum).values())
