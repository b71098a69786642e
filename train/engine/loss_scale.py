"""fp16's loss scale, kept and updated on the device: no host read in the step.

The rule is DeepSpeed's dynamic loss scaler (its ds_config `fp16` section, the same keys and
meaning), written as tensor arithmetic so that the step never waits for the device:
  - an overflow (non-finite gradients) uses up one unit of hysteresis; with none left the
    scale halves (not below min_loss_scale: a scale below it, when min_loss_scale exceeds the
    initial scale, becomes min_loss_scale); an overflow at the minimum with no hysteresis
    left is a collapse, which the loop reports at its next read (train/engine/nonfinite.py);
  - an overflow-free step that follows k x `loss_scale_window` overflow-free steps (k >= 1)
    doubles the scale and restores the hysteresis (every overflow-free step restores it with
    consecutive_hysteresis);
  - `loss_scale` > 0 is a static scale that never changes.
torch's GradScaler (`torch._amp_update_scale_`) has no hysteresis and no minimum, hence this.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossScaleConfig:
    """A ds_config `fp16` section's scaler settings (DeepSpeed's defaults)."""
    loss_scale: float = 0.0  # 0 = dynamic; > 0 = this static scale
    initial_scale_power: int = 16  # dynamic: start at 2**power
    loss_scale_window: int = 1000  # overflow-free steps after which the next one doubles the scale
    hysteresis: int = 2  # overflows tolerated before the scale halves
    consecutive_hysteresis: bool = False  # every overflow-free step restores the hysteresis
    min_loss_scale: float = 1.0

    @classmethod
    def from_section(cls, fp16: dict) -> LossScaleConfig:
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in fp16.items() if k in keys})

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


class DeviceLossScale:
    """The scale and its counters as 0-dim fp32 tensors on `device`."""

    def __init__(self, cfg: LossScaleConfig, device: torch.device):
        self.cfg = cfg
        start = float(2 ** cfg.initial_scale_power) if cfg.dynamic else float(cfg.loss_scale)
        self.scale = torch.tensor(start, device=device)
        self.hysteresis_left = torch.tensor(float(cfg.hysteresis), device=device)
        self.good_steps = torch.zeros((), device=device)  # overflow-free steps since the last overflow
        self.collapsed = torch.zeros((), device=device)  # 1 once an overflow happened at the minimum scale

    def update(self, overflow: torch.Tensor) -> None:
        """After an optimizer step whose gradients overflowed (1.0) or not (0.0), on the device."""
        if not self.cfg.dynamic:
            return
        cfg, ok = self.cfg, 1.0 - overflow
        shrink = overflow * (self.hysteresis_left <= 1)  # an overflow with no hysteresis left
        # DeepSpeed's test: exactly at the minimum; a scale below it (min_loss_scale above the initial
        # scale) rises to the minimum instead
        self.collapsed.copy_(torch.maximum(self.collapsed, shrink * (self.scale == cfg.min_loss_scale)))
        halved = torch.clamp_min(self.scale / 2, cfg.min_loss_scale)
        self.good_steps.copy_((self.good_steps + 1) * ok)
        stable = self.good_steps - 1  # DeepSpeed's "stable interval": the overflow-free steps before this one
        grow = ok * (stable > 0) * (torch.remainder(stable, cfg.loss_scale_window) == 0)
        self.scale.copy_(torch.where(shrink > 0, halved, torch.where(grow > 0, self.scale * 2, self.scale)))
        restore = ok if cfg.consecutive_hysteresis else grow
        self.hysteresis_left.copy_(torch.where(restore > 0, float(cfg.hysteresis),
                                               self.hysteresis_left - overflow * (self.hysteresis_left > 1)))

    def state_dict(self) -> dict:
        return {k: getattr(self, k).detach().cpu() for k in ("scale", "hysteresis_left", "good_steps", "collapsed")}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's scale and counters; a static scale configured now keeps its value (a
        static scale is the usual way out of fp16 trouble, and update() never moves it again)."""
        for k, v in state.items():
            if k == "scale" and not self.cfg.dynamic:
                continue
            getattr(self, k).copy_(v)
