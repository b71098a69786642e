"""Adversarial position perturbations of AdPE (METHODS.md section 2): shared by all masked tokens,
updated by projected gradient ascent from the model's own backward (parallel mode, no second pass).

The perturbations are plain fp32 leaf tensors held outside the module's parameters and buffers,
so DeepSpeed neither casts them to fp16/bf16, nor partitions them, nor keeps a master copy
that would undo the projection; they reach checkpoints through `get_extra_state`. After each
optimizer step the objective's `after_optimizer_step` hook (called by the loop for every
objective) averages their gradients over ranks (all_reduce sum / world size) and takes one
projected ascent step, with step size s = lr_t * scale (the main lr schedule times `scale`):

    sign:        a <- P(a + s * sign(g))                     steepest ascent for l_inf
    normalised:  a <- P(a + s * g / ||g||)                   steepest ascent for l_2
    adam:        a <- P(a + s * m_hat / (sqrt(v_hat) + 1e-8)) Adam (betas 0.9, 0.95) on -L, as
                 AdPE's official code (a negative learning rate in its optimizer, then projection)
    steepest:    sign for linf, normalised for l2 [project default]

with P the projection onto the l_inf box clip(., -eps, eps) or the l_2 ball v * min(1, eps/||v||).
sign and normalised steps ignore the gradient's scale (fp16 loss scaling, rank averaging);
Adam ignores a constant scale (up to its eps) but a loss scale that changes mid-run moves its
moments, so use it with bf16 / fp32 (no loss scaling).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from model.irpe import ContextualRPE, bilinear_corners

NORMS = ("linf", "l2")
UPDATES = ("steepest", "sign", "normalised", "adam")
ADAM_BETAS, ADAM_EPS = (0.9, 0.95), 1e-8  # AdPE's official adversary optimizer (its main optimizer's betas)


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


def adam_ascent_step_(a: torch.Tensor, grad: torch.Tensor, state: dict, step: float) -> torch.Tensor:
    """In place: one Adam step up the gradient (Adam on -L with lr `step`); state holds
    exp_avg, exp_avg_sq (shape of a) and step count t (0-dim), created on the first call."""
    if not state:
        state.update(exp_avg=torch.zeros_like(a), exp_avg_sq=torch.zeros_like(a), t=torch.zeros((), device=a.device))
    b1, b2 = ADAM_BETAS
    state["t"].add_(1)
    state["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
    state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
    m_hat = state["exp_avg"] / (1 - b1 ** state["t"])
    v_hat = state["exp_avg_sq"] / (1 - b2 ** state["t"])
    return a.add_(step * m_hat / (v_hat.sqrt() + ADAM_EPS))


class Adversaries:
    """Named fp32 perturbation tensors with projected ascent updates; owned by an objective (not an nn.Module)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], norm: str, eps: float, scale: float,
                 update: str = "steepest"):
        if norm not in NORMS:
            raise ValueError(f"adversary norm must be one of {NORMS}, got {norm!r}")
        if update not in UPDATES:
            raise ValueError(f"adversary update must be one of {UPDATES}, got {update!r}")
        self.norm, self.eps, self.scale = norm, eps, scale
        self.update = {"steepest": "sign" if norm == "linf" else "normalised"}.get(update, update)
        self.tensors = {name: torch.zeros(shape, requires_grad=True) for name, shape in shapes.items()}
        self.adam: dict[str, dict] = {name: {} for name in shapes}  # Adam moments per tensor (update adam)

    def get(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The perturbation for a forward pass (gradients flow back to the fp32 leaf)."""
        leaf = self.tensors[name]
        if leaf.device != device:  # follows the model to its device once
            moved = leaf.detach().to(device).requires_grad_()
            self.tensors[name] = leaf = moved
            self.adam[name] = {k: v.to(device) for k, v in self.adam[name].items()}
        return leaf.to(dtype)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        if not self.tensors:
            return
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in self.tensors.values()]
        if dist.is_available() and dist.is_initialized():  # same update on every rank: the mean gradient
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            grads = list(flat.split([g.numel() for g in grads]))
        for name, t, g in zip(self.tensors, self.tensors.values(), grads):
            g = g.view_as(t)
            finite = torch.isfinite(g).all()  # an fp16 overflow step is skipped by the optimizer too
            g = torch.nan_to_num(g)
            if self.update == "adam":
                state = self.adam[name]
                before = {k: v.clone() for k, v in state.items()}
                moved = adam_ascent_step_(t.detach().clone(), g, state, lr * self.scale)
                for k, v in state.items():  # an overflow step leaves the moments as they were
                    v.copy_(torch.where(finite, v, before[k] if k in before else torch.zeros_like(v)))
            else:
                moved = ascent_step_(t.detach().clone(), g, "linf" if self.update == "sign" else "l2",
                                     lr * self.scale)
            t.copy_(torch.where(finite, project_(moved, self.norm, self.eps), t))
            t.grad = None

    def norms(self) -> dict[str, torch.Tensor]:
        """0-dim tensors to log: each perturbation's norm in the constraint's norm."""
        out = {}
        for name, t in self.tensors.items():
            d = t.detach()
            out[f"adv_{name}"] = d.abs().max() if self.norm == "linf" else d.norm()
        return out

    def state_dict(self) -> dict:
        out = {name: t.detach().cpu().clone() for name, t in self.tensors.items()}
        if any(self.adam.values()):
            out["_adam"] = {name: {k: v.cpu().clone() for k, v in s.items()} for name, s in self.adam.items()}
        return out

    def load_state_dict(self, state: dict) -> None:
        """Checkpoints without Adam moments (older runs, or sign / normalised updates) start them afresh."""
        state = dict(state)
        adam = state.pop("_adam", {})
        for name, value in state.items():
            if name not in self.tensors or self.tensors[name].shape != value.shape:
                raise ValueError(f"adversary {name!r} of shape {tuple(value.shape)} does not match this objective")
            device = self.tensors[name].device
            self.tensors[name] = value.to(device, torch.float32).clone().requires_grad_()
            self.adam[name] = {k: v.to(device) for k, v in adam.get(name, {}).items()}


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
            embed = self.embed.to(q.dtype).expand(-1, H, -1)  # (buckets, H, d): a shared table's perturbation too
            qa = torch.einsum("bhtd,nhd->bhtn", q[:, :, c:], embed) * scale  # (B, H, N, buckets)
            extra = qa.gather(-1, rpe.buckets[c:].expand(B, H, T - c, T))  # (B, H, N, T)
            shift = torch.where(rows, extra, torch.zeros_like(extra))
            bias = bias + torch.cat([torch.zeros_like(bias[:, :, :c]), shift], dim=2)
        return bias
