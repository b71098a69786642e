"""Adversarial position perturbations of AdPE (METHODS.md section 2): shared by all masked tokens,
updated by projected gradient ascent from the model's own backward (parallel mode, no second pass).

The perturbations are plain fp32 leaf tensors held outside the module's parameters and buffers,
so DeepSpeed neither casts them to fp16/bf16, nor partitions them, nor keeps a master copy
that would undo the projection; they reach checkpoints through `get_extra_state`. After each
optimizer step the objective's `after_optimizer_step` hook (called by the loop for every
objective) averages their gradients over ranks and takes one PGD step:

    l_inf:  a <- clip(a + lr_t * scale * sign(g), -eps, eps)
    l_2:    a <- Pi_eps(a + lr_t * scale * g / ||g||),  Pi_eps(v) = v * min(1, eps / ||v||)

i.e. steepest ascent for the norm of the constraint with a step that follows the main lr
schedule (lr_t) times `scale` [project default 1]. The steps are invariant to fp16 loss scaling.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from model.irpe import ContextualRPE, bilinear_corners

NORMS = ("linf", "l2")


# Tensor arithmetic only (no data-dependent Python branches), so a step never waits on the device.

def project_(a: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    """In place: onto the l_inf box or the l_2 ball of radius eps."""
    if norm == "linf":
        return a.clamp_(-eps, eps)
    return a.mul_((eps / a.norm().clamp_min(1e-12)).clamp(max=1.0))


def ascent_step_(a: torch.Tensor, grad: torch.Tensor, norm: str, step: float) -> torch.Tensor:
    """In place: one steepest-ascent step of size `step` for the given norm (a zero gradient: no move)."""
    if norm == "linf":
        return a.add_(step * grad.sign())
    return a.add_(grad * (step / grad.norm().clamp_min(1e-30)))


class Adversaries:
    """Named fp32 perturbation tensors with PGD updates; owned by an objective (not an nn.Module)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], norm: str, eps: float, scale: float):
        if norm not in NORMS:
            raise ValueError(f"adversary norm must be one of {NORMS}, got {norm!r}")
        self.norm, self.eps, self.scale = norm, eps, scale
        self.tensors = {name: torch.zeros(shape, requires_grad=True) for name, shape in shapes.items()}

    def get(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The perturbation for a forward pass (gradients flow back to the fp32 leaf)."""
        leaf = self.tensors[name]
        if leaf.device != device:  # follows the model to its device once
            moved = leaf.detach().to(device).requires_grad_()
            self.tensors[name] = leaf = moved
        return leaf.to(dtype)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        if not self.tensors:
            return
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in self.tensors.values()]
        if dist.is_available() and dist.is_initialized():  # same update on every rank
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat)
            grads = list(flat.split([g.numel() for g in grads]))
        for t, g in zip(self.tensors.values(), grads):
            g = g.view_as(t)
            finite = torch.isfinite(g).all()  # an fp16 overflow step is skipped by the optimizer too
            moved = project_(ascent_step_(t.detach().clone(), torch.nan_to_num(g), self.norm, lr * self.scale),
                             self.norm, self.eps)
            t.copy_(torch.where(finite, moved, t))
            t.grad = None

    def norms(self) -> dict[str, torch.Tensor]:
        """0-dim tensors to log: each perturbation's norm in the constraint's norm."""
        out = {}
        for name, t in self.tensors.items():
            d = t.detach()
            out[f"adv_{name}"] = d.abs().max() if self.norm == "linf" else d.norm()
        return out

    def state_dict(self) -> dict:
        return {name: t.detach().cpu().clone() for name, t in self.tensors.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            if name not in self.tensors or self.tensors[name].shape != value.shape:
                raise ValueError(f"adversary {name!r} of shape {tuple(value.shape)} does not match this objective")
            device = self.tensors[name].device
            self.tensors[name] = value.to(device, torch.float32).clone().requires_grad_()


class RPEPerturbation:
    """One block's relative-position perturbation for one forward pass, for masked query rows only;
    a model.irpe.BiasHook, passed per block through the ViT's forward_tokens (`bias_hooks`).

    masked (B, N) bool marks the patch tokens whose query rows are perturbed (every key, cls too);
    delta (2,) is added to their (row, col) offsets (coordinate mode, through g~ and bilinear
    lookup); embed (buckets, H, d), the shape of the table, is added to the table rows r_ij they
    use (embedding mode; one shared vector for all rows would shift each query's logits by a
    constant, which the softmax ignores)."""

    def __init__(self, masked: torch.Tensor, delta: torch.Tensor | None = None, embed: torch.Tensor | None = None):
        self.masked, self.delta, self.embed = masked, delta, embed

    def __call__(self, rpe: ContextualRPE, q: torch.Tensor, qr: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, d), qr (B, H, T, buckets) scaled per-bucket scores, bias (B, H, T, T) -> perturbed bias."""
        B, H, T, d = q.shape
        scale = d**-0.5
        c = rpe.num_cls
        rows = self.masked[:, None, :, None]  # (B, 1, N, 1): perturbed query rows
        if self.delta is not None:
            N = T - c
            corners, weights = bilinear_corners(rpe.rel + self.delta.to(rpe.rel.dtype), **rpe.index_args)
            patch_qr = qr[:, :, c:]  # (B, H, N, buckets)
            picked = patch_qr.gather(-1, corners.reshape(1, 1, N, N * 4).expand(B, H, N, N * 4))
            continuous = (picked.reshape(B, H, N, N, 4) * weights.to(q.dtype)).sum(-1)  # (B, H, N, N)
            patch = torch.where(rows, continuous, bias[:, :, c:, c:])
            bias = torch.cat([bias[:, :, :c], torch.cat([bias[:, :, c:, :c], patch], dim=3)], dim=2)
        if self.embed is not None:
            qa = torch.einsum("bhtd,nhd->bhtn", q[:, :, c:], self.embed.to(q.dtype)) * scale  # (B, H, N, buckets)
            extra = qa.gather(-1, rpe.buckets[c:].expand(B, H, T - c, T))  # (B, H, N, T)
            shift = torch.where(rows, extra, torch.zeros_like(extra))
            bias = bias + torch.cat([torch.zeros_like(bias[:, :, :c]), shift], dim=2)
        return bias
