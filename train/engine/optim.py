"""Parameter groups, AdamW and the per-step warmup + half-cycle cosine schedule."""
from __future__ import annotations

import math

import torch
from torch import nn

from model.objectives.base import Objective


def no_weight_decay_names(module: nn.Module) -> set[str]:
    """Full names listed by any submodule's `no_weight_decay()` (tokens, position tables): every
    Objective has the method, and so may any module inside it (the encoder, a decoder, an iRPE
    table, a timm backbone: timm's convention), so each module is asked if it defines one."""
    names: set[str] = set()
    for prefix, sub in module.named_modules():
        if hasattr(sub, "no_weight_decay"):  # plain torch layers (Linear, LayerNorm) have none
            names |= {f"{prefix}.{n}" if prefix else n for n in sub.no_weight_decay()}
    if isinstance(module, Objective):  # the objective may decay what a submodule exempts (MAE+ decay_tokens)
        names -= module.decayed_names()
    return names


def param_groups(module: nn.Module, weight_decay: float) -> tuple[list[dict], dict[str, int]]:
    """Two groups: decayed weight matrices; undecayed biases, norms, tokens, position tables.

    Frozen parameters (fixed sin-cos tables) are left out. Returns the groups and a summary of
    how many parameters each holds, for the log.
    """
    skip = no_weight_decay_names(module)
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    summary = {
        "decay_tensors": len(decay), "decay_params": sum(p.numel() for p in decay),
        "no_decay_tensors": len(no_decay), "no_decay_params": sum(p.numel() for p in no_decay),
    }
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]], summary


def build_optimizer(groups: list[dict], optim_cfg) -> torch.optim.Optimizer:
    """The engine's optimizer over its flat tensors: PyTorch's fused AdamW (one kernel per group
    that also unscales the gradients and skips a step flagged non-finite: train/engine/core.py), or LARS."""
    if optim_cfg.name == "lars":
        return LARS(groups, lr=0.0)
    return torch.optim.AdamW(groups, lr=0.0, betas=optim_cfg.betas, fused=True)


def warmup_cosine(step: int, peak_lr: float, min_lr: float, warmup_steps: float, total_steps: int) -> float:
    """MAE's schedule in optimizer steps: linear from 0, then half-cycle cosine to min_lr."""
    if step < warmup_steps:
        return peak_lr * step / warmup_steps
    progress = (step - warmup_steps) / max(1.0, total_steps - warmup_steps)
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class WarmupCosineSchedule:
    """Sets every group's lr before each optimizer step (groups may carry an `lr_scale`).

    The engine (train/engine/core.py) calls `step()` after every optimizer step, a skipped one too, and
    saves `state_dict()` in its checkpoints; the lr for step s depends only on s, so resume is exact.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, min_lr: float, warmup_steps: float,
                 total_steps: int):
        self.optimizer = optimizer
        self.peak_lr, self.min_lr = peak_lr, min_lr
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.last_step = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        return warmup_cosine(step, self.peak_lr, self.min_lr, self.warmup_steps, self.total_steps)

    def _apply(self) -> None:
        lr = self.lr_at(self.last_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = int(state["last_step"])
        self._apply()


def layer_id(name: str, depth: int) -> int:
    """MAE's layer ids for layer-wise lr decay: patch embed, cls, pos -> 0; block i -> i + 1;
    everything after the blocks (final norm, fc_norm, head) -> depth + 1. Names are encoder-relative."""
    if name.startswith(("cls_token", "pos_embed", "patch_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def layer_decay_groups(encoder: nn.Module, weight_decay: float, layer_decay: float,
                       prefix: str = "", skip: set[str] | None = None) -> list[dict]:
    """Groups keyed by (layer id, decay or not), each with lr_scale = layer_decay^(depth + 1 - id);
    the schedule multiplies its lr by lr_scale. `prefix` strips a wrapper's name (e.g. 'encoder.');
    `skip`: the full (prefixed) names kept out of weight decay, by default the encoder's own."""
    depth = len(encoder.blocks)
    if skip is None:
        skip = {prefix + n for n in no_weight_decay_names(encoder)}
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in encoder.named_parameters():
        if not p.requires_grad:
            continue
        decayed = not (p.ndim <= 1 or prefix + name in skip)
        lid = layer_id(name, depth)
        group = groups.setdefault((lid, decayed), {
            "params": [], "weight_decay": weight_decay if decayed else 0.0,
            "lr_scale": layer_decay ** (depth + 1 - lid), "names": [],
        })
        group["params"].append(p)
        group["names"].append(prefix + name)
    return [groups[k] for k in sorted(groups)]


def build_param_groups(objective: nn.Module, weight_decay: float, layer_decay: float) -> tuple[list[dict], dict]:
    """The optimizer's groups for any objective: with layer_decay < 1 the encoder's parameters are
    grouped by layer (lr_scale = decay^(depth + 1 - id)) and the rest of the objective keeps scale 1."""
    if layer_decay >= 1.0:
        return param_groups(objective, weight_decay)
    # the objective's names: it may decay what the encoder exempts (MAE+ decay_tokens), with or without layer decay
    encoder_groups = layer_decay_groups(objective.encoder, weight_decay, layer_decay, prefix="encoder.",
                                        skip=no_weight_decay_names(objective))
    in_encoder = {id(p) for p in objective.encoder.parameters()}
    rest, _ = param_groups(objective, weight_decay)
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in in_encoder]} for g in rest]
    groups = [{k: v for k, v in g.items() if k != "names"} for g in encoder_groups] + [g for g in rest if g["params"]]
    decayed = [p for g in groups if g["weight_decay"] > 0 for p in g["params"]]
    undecayed = [p for g in groups if g["weight_decay"] == 0 for p in g["params"]]
    summary = {"decay_tensors": len(decayed), "decay_params": sum(p.numel() for p in decayed),
               "no_decay_tensors": len(undecayed), "no_decay_params": sum(p.numel() for p in undecayed),
               "layer_groups": len(encoder_groups)}
    return groups, summary


class LARS(torch.optim.Optimizer):
    """LARS as used for MAE's linear probe (momentum SGD with a layer-wise trust ratio).

    For parameters with more than one dimension: g <- g + wd * w, then g <- g * trust * ||w|| / ||g||
    when both norms are positive; biases and norm parameters (1-D) take the plain momentum step.
    Then mu <- momentum * mu + g; w <- w - lr * mu.
    Like the fused AdamW, it reads `grad_scale` (gradients are divided by it) and `found_inf` (1:
    the step leaves weights and momentum as they were) when the engine sets them, without a host read.
    """

    def __init__(self, params, lr: float = 0.0, weight_decay: float = 0.0, momentum: float = 0.9,
                 trust_coefficient: float = 0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      trust_coefficient=trust_coefficient))

    @staticmethod
    def init_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of `p` before its first step (the engine makes it so a checkpoint can load into it)."""
        return {"mu": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if grad_scale is None else p.grad / grad_scale
                if p.ndim > 1:
                    g = g.add(p, alpha=group["weight_decay"])
                    w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
                    ratio = torch.where((w_norm > 0) & (g_norm > 0),
                                        group["trust_coefficient"] * w_norm / g_norm, torch.ones_like(w_norm))
                    g = g.mul(ratio)
                state = self.state[p]
                if "mu" not in state:
                    state.update(self.init_state(p))
                if found_inf is None:
                    mu = state["mu"].mul_(group["momentum"]).add_(g)
                    p.add_(mu, alpha=-group["lr"])
                else:  # a skipped step keeps both
                    mu = state["mu"] * group["momentum"] + g
                    keep = found_inf > 0
                    state["mu"].copy_(torch.where(keep, state["mu"], mu))
                    p.copy_(torch.where(keep, p, p - group["lr"] * mu))
        return loss
