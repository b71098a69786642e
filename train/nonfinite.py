"""Optimizer steps with a non-finite loss or gradients: skipped, counted, and a run that keeps
producing them stopped with a message saying so.

Skipping is DeepSpeed's: every engine except ZeRO-0 fp32 checks the gradients before the update
(fp16 and bf16 overflow checks; ZeRO 1-3 fp32 through the gradient norm) and skips a step that
fails, without advancing the lr schedule; `engine.was_step_applied()` says which. Two gaps are
closed here:
  - a non-finite loss whose gradients happen to be finite (e.g. a NaN term that no weight
    feeds) would be applied: `nan_if_not_finite` turns it into NaN gradients, which every check
    catches;
  - a ZeRO-0 fp32 engine hands the optimizer over as is and applies every step:
    `skip_nonfinite_steps` gives it the same check, reported the way DeepSpeed's optimizers
    report an overflow (an `overflow` attribute the engine reads).
`StepHealth` counts the skipped steps and stops the run after `limit` consecutive ones, or at
once when fp16's dynamic loss scale collapses (DeepSpeed raises once it would go below its
minimum); the run stops without writing a checkpoint, so the last complete one stays newest.
When no step of the run was ever finite, the message blames the objective's configuration and
input rather than the lr: a diverging lr first trains, then breaks.
"""
from __future__ import annotations

import dataclasses

import torch

from model.objectives import OBJECTIVES, Objective

REMEDY = ("lower optim.blr, set gradient_clipping in the ds_config (e.g. 1.0), or train in bf16/fp32; then "
          "continue from the last checkpoint with --resume auto")


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


class NonFiniteError(RuntimeError):
    """Training diverged: the run stops and keeps its last checkpoint."""


def nan_if_not_finite(loss: torch.Tensor) -> torch.Tensor:
    """`loss` x 1 (exact), or x NaN when it is not finite, so that every gradient is NaN and the
    step is skipped. The factor is computed on the device: no host sync."""
    factor = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
    return loss * factor


def skip_nonfinite_steps(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make `optimizer.step()` skip (and flag in `optimizer.overflow`) a step whose gradients are
    not all finite. For ZeRO-0 fp32 engines only: the others check already. Costs one host sync
    per step (free on CPU; fp32 without ZeRO is a CPU / debugging set-up)."""
    inner = optimizer.step

    def step(closure=None):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        optimizer.overflow = bool(grads) and not bool(torch.stack(torch._foreach_norm(grads)).isfinite().all())
        return None if optimizer.overflow else inner(closure)

    optimizer.overflow = False
    optimizer.step = step
    return optimizer


def loss_scale(engine) -> float | None:
    """DeepSpeed's current fp16 loss scale (a host float); None when the engine is not fp16."""
    if not engine.fp16_enabled():
        return None
    return float(getattr(engine.optimizer, "cur_scale", None) or getattr(engine.optimizer, "loss_scale", 0.0))


class StepHealth:
    """Follows `engine.was_step_applied()` after each optimizer step (host values DeepSpeed has
    already synced for its own check: no extra sync)."""

    def __init__(self, limit: int):
        self.limit = limit  # consecutive skipped steps that stop the run (0 = never)
        self.streak = 0
        self.first_bad = 0
        self.any_applied = False  # whether a step of this run (this process) was ever applied

    def step(self, engine, optimizer_step: int) -> None:
        """After the engine.step() that ended optimizer step `optimizer_step` (counted from 1)."""
        if engine.was_step_applied():
            self.streak = 0
            self.any_applied = True
            return
        self.streak += 1
        if self.streak == 1:
            self.first_bad = optimizer_step
        if self.limit and self.streak >= self.limit:
            scale = loss_scale(engine)
            fp16 = f"; the fp16 loss scale is {scale:g}" if scale is not None else ""
            skipped = (f"{self.streak} consecutive optimizer steps ({self.first_bad}-{optimizer_step}) had a "
                       f"non-finite loss or gradients and were skipped (run.max_nonfinite_steps {self.limit}){fp16}")
            if not self.any_applied:  # non-finite from this run's first step: nothing trained that an lr could break
                raise NonFiniteError(
                    f"{skipped}. No step of this run had a finite loss, so the lr is an unlikely cause: the likely "
                    f"one is the configuration or the input of the {describe_objective(engine.module)}, e.g. a "
                    f"mask ratio that leaves nothing to reconstruct, or images that do not fit the model (model.*, "
                    f"data.*). Training stopped without writing a checkpoint; fix the option and start again")
            raise NonFiniteError(
                f"{skipped}. Training stopped without writing a checkpoint, so the last complete one is kept: {REMEDY}")


def loss_scale_collapse(error: Exception, engine, optimizer_step: int) -> NonFiniteError | None:
    """DeepSpeed's fp16 scaler raises a bare Exception once the scale cannot go lower: the error
    that says what it means, or None for any other exception."""
    if "loss scale already at minimum" not in str(error):
        return None
    return NonFiniteError(
        f"fp16 loss-scale collapse at step {optimizer_step}: the gradients still overflow at the minimum loss "
        f"scale ({loss_scale(engine):g}), so fp16 cannot represent this model's gradients any more. Training "
        f"stopped without writing a checkpoint, so the last complete one is kept: {REMEDY}")
