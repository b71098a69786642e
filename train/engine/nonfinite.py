"""Optimizer steps with a non-finite loss or gradients: skipped, counted, and a run that keeps
producing them stopped with a message saying so.

Skipping is the engine's (train/engine/core.py): the fused optimizer step takes a `found_inf` flag
computed on the device from the gradients' sum of squares and leaves weights and moments as they
were, without a host read. `nan_if_not_finite` closes one gap: a non-finite loss whose gradients
happen to be finite (a NaN term that no weight feeds) becomes NaN gradients, which the check
catches. `DeviceHealth` keeps the counters on the device; the loop reads them with its window at
log steps and before every checkpoint, and `StepHealth` ends the run when `limit` consecutive
steps were skipped, or when fp16's dynamic loss scale collapsed (an overflow at its minimum).
The run ends without writing a checkpoint, so the last complete one stays newest (the weights
of skipped steps are unchanged, so a checkpoint written between two reads is sound). When no
step of the run was ever finite, the message blames the objective's configuration and input
rather than the lr: a diverging lr first trains, then breaks.
"""
from __future__ import annotations

import dataclasses

import torch

from model.objectives import OBJECTIVES, Objective
from train.engine.errors import NonFiniteError

STEADIER = "lower optim.blr, set gradient_clipping in the ds_config (e.g. 1.0), or train in bf16/fp32"
REMEDY = f"{STEADIER}; then continue from the last checkpoint with --resume auto"


def describe_objective(module: torch.nn.Module) -> str:
    """'objective mae (mae.mask_ratio 0.9, mae.decoder_dim 32 set)': the engine's module with its
    options away from their defaults; a module that is no registered objective is 'the objective'."""
    if not isinstance(module, Objective):
        return "the objective"
    name = next((n for n, (_, cls) in OBJECTIVES.items() if cls is type(module)), type(module).__name__)
    cfg, default = module.cfg, type(module.cfg)()
    changed = [f"{name}.{f.name} {getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != getattr(default, f.name)]
    return f"objective {name} ({', '.join(changed) + ' set' if changed else 'every option at its default'})"


def nan_if_not_finite(loss: torch.Tensor) -> torch.Tensor:
    """`loss` x 1 (exact), or x NaN when it is not finite, so that every gradient is NaN and the
    step is skipped. The factor is computed on the device: no host sync."""
    factor = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
    return loss * factor


class DeviceHealth:
    """Skipped-step counters as 0-dim fp32 tensors on the device, updated in the step (4 kernels)."""

    def __init__(self, device: torch.device):
        self.skipped = torch.zeros((), device=device)  # skipped optimizer steps, whole run
        self.streak = torch.zeros((), device=device)  # consecutive skipped steps up to the last one
        self.worst = torch.zeros((), device=device)  # the longest streak since the loop's last read

    def update(self, found_inf: torch.Tensor) -> None:
        self.skipped.add_(found_inf)
        self.streak.add_(1).mul_(found_inf)
        torch.maximum(self.worst, self.streak, out=self.worst)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"skipped_steps": self.skipped, "nonfinite_streak": self.streak, "nonfinite_worst": self.worst}

    def window_read(self) -> None:
        """After the loop read the counters: the next window's worst streak starts from the current one."""
        self.worst.copy_(self.streak)

    def state_dict(self) -> dict:
        return {"skipped": self.skipped.item(), "streak": self.streak.item()}

    def load_state_dict(self, state: dict) -> None:
        self.skipped.fill_(state["skipped"])
        self.streak.fill_(state["streak"])
        self.worst.fill_(state["streak"])


class StepHealth:
    """Judges the counters the loop read (DeviceHealth's, and the fp16 scaler's collapse flag)."""

    def __init__(self, limit: int):
        self.limit = limit  # consecutive skipped steps that stop the run (0 = never)
        self.last_read = 0  # the optimizer step of the previous read

    def check(self, values: dict[str, float], step: int, module: torch.nn.Module) -> None:
        """`values` read at optimizer step `step` (counted from 1); raises NonFiniteError to stop."""
        since, self.last_read = self.last_read, step
        applied = step - round(values["skipped_steps"])
        scale = values.get("loss_scale")
        if values.get("loss_scale_collapsed", 0.0) > 0:
            raise NonFiniteError(
                f"fp16 loss-scale collapse by step {step}: the gradients still overflow at the minimum loss "
                f"scale ({scale:g}), so fp16 cannot represent this model's gradients any more. Training stopped "
                f"without writing a checkpoint, so the last complete one is kept: {REMEDY}")
        worst, streak = round(values["nonfinite_worst"]), round(values["nonfinite_streak"])
        if not self.limit or worst < self.limit:
            return
        where = (f"({step - streak + 1}-{step})" if streak == worst
                 else f"(a run of them between steps {since + 1} and {step})")
        fp16 = f"; the fp16 loss scale is {scale:g}" if scale is not None else ""
        skipped = (f"{worst} consecutive optimizer steps {where} had a non-finite loss or gradients and were "
                   f"skipped (run.max_nonfinite_steps {self.limit}){fp16}")
        if applied <= 0:  # non-finite from this run's first step: nothing trained that an lr could break
            raise NonFiniteError(
                f"{skipped}. No step of this run had a finite loss, so the lr is an unlikely cause: the likely "
                f"one is the configuration or the input of the {describe_objective(module)}, e.g. a "
                f"mask ratio that leaves nothing to reconstruct, or images that do not fit the model (model.*, "
                f"data.*). Training stopped without writing a checkpoint; fix the option and start again")
        raise NonFiniteError(
            f"{skipped}. Training stopped without writing a checkpoint, so the last complete one is kept: {REMEDY}")
