"""Adversarial position perturbations of AdPE (Wang et al. 2023, arXiv:2303.07598, section 4):
shared by all masked tokens, updated by projected gradient ascent from the model's own backward
(parallel mode, no second pass).

The perturbations are plain fp32 leaf tensors held outside the module's parameters and buffers,
so the engine neither casts them to fp16/bf16, nor partitions them, nor keeps a master copy
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

from model.constants import device_constant
from model.irpe import ContextualRPE, bilinear_corners

NORMS = ("linf", "l2")
UPDATES = ("steepest", "sign", "normalised", "adam")
ADAM_BETAS, ADAM_EPS = (0.9, 0.95), 1e-8  # AdPE's official adversary optimizer (its main optimizer's betas)


def _per_element(per_tensor: torch.Tensor, sizes: list[int], flat: torch.Tensor) -> torch.Tensor:
    """(k,) values, one per tensor of `sizes` elements, spread over the (sum(sizes),) `flat`."""
    return per_tensor.repeat_interleave(device_constant(tuple(sizes), flat.device), output_size=flat.numel())


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
        """One projected ascent step of every perturbation, on one flat vector of them all (a few
        kernels, whatever their number); a step whose gradients are not all finite (an fp16
        overflow, a skipped optimizer step) moves nothing."""
        if not self.tensors:
            return
        leaves = list(self.tensors.values())
        sizes = [t.numel() for t in leaves]
        grad = torch.cat([(t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1) for t in leaves])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(grad)  # same update on every rank: the mean gradient (a sum: sign and
            # normalised steps ignore the scale, Adam nearly so; divided below for Adam's moments)
            if self.update == "adam":
                grad /= dist.get_world_size()
        finite = torch.isfinite(grad.sum())  # NaN / inf anywhere makes the sum so
        grad = torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
        flat = torch.cat([t.detach().reshape(-1) for t in leaves])
        step = lr * self.scale
        if self.update == "adam":
            moved = self._adam_flat(flat, grad, sizes, finite, step)
        elif self.update == "sign":
            moved = flat + step * grad.sign()
        else:  # normalised: each tensor's own gradient norm
            norms = torch.stack(torch._foreach_norm(list(grad.split(sizes)))).clamp_min(1e-30)
            moved = flat + grad * _per_element(step / norms, sizes, grad)
        moved = self._project_flat(moved, sizes)
        new = torch.where(finite, moved, flat).split(sizes)
        torch._foreach_copy_([t.detach() for t in leaves], [n.view_as(t) for n, t in zip(new, leaves)])
        for t in leaves:
            t.grad = None

    def _project_flat(self, flat: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Each tensor's part onto its l_inf box or l_2 ball of radius eps."""
        if self.norm == "linf":
            return flat.clamp(-self.eps, self.eps)
        norms = torch.stack(torch._foreach_norm(list(flat.split(sizes)))).clamp_min(1e-12)
        factor = (self.eps / norms).clamp(max=1.0)
        return flat * _per_element(factor, sizes, flat)

    def _adam_flat(self, flat: torch.Tensor, grad: torch.Tensor, sizes: list[int], finite: torch.Tensor,
                   step: float) -> torch.Tensor:
        """Adam up the gradient over the flat vector; the per-tensor moments (kept by name, as
        checkpoints hold them) advance only on a finite step."""
        names = list(self.tensors)
        if not self.adam[names[0]]:
            for name, t in self.tensors.items():
                self.adam[name] = {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t),
                                   "t": torch.zeros((), device=t.device)}
        b1, b2 = ADAM_BETAS
        m = torch.cat([self.adam[n]["exp_avg"].reshape(-1) for n in names])
        v = torch.cat([self.adam[n]["exp_avg_sq"].reshape(-1) for n in names])
        t = self.adam[names[0]]["t"] + 1  # every tensor has taken the same steps
        m_new, v_new = m * b1 + grad * (1 - b1), v * b2 + grad * grad * (1 - b2)
        moved = flat + step * (m_new / (1 - b1 ** t)) / ((v_new / (1 - b2 ** t)).sqrt() + ADAM_EPS)
        m, v = torch.where(finite, m_new, m).split(sizes), torch.where(finite, v_new, v).split(sizes)
        t_kept = torch.where(finite, t, t - 1)
        for name, mi, vi in zip(names, m, v):
            state = self.adam[name]
            state["exp_avg"].copy_(mi.view_as(state["exp_avg"]))
            state["exp_avg_sq"].copy_(vi.view_as(state["exp_avg_sq"]))
            state["t"].copy_(t_kept)
        return moved

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
    coordinate mode: a delta (2,) added to their (row, col) offsets, through g~ and bilinear
    lookup, given as `corners` (`coordinate_corners` makes them for every block of a stack at once):
    (N, N, 4) corner buckets and weights for the masked rows, visible rows keeping the integer
    lookup; or, with `every_row` (coord_lookup official, as AdPE's official code), (B, N, N, 4) per
    sample for every patch row, visible rows reading the same lookup at delta 0; embedding mode:
    `embed` (buckets, H, d), the shape of the table, added to the table rows r_ij they use (one
    shared vector for all rows would shift each query's logits by a constant, which the softmax ignores)."""

    def __init__(self, masked: torch.Tensor, embed: torch.Tensor | None = None,
                 corners: tuple[torch.Tensor, torch.Tensor] | None = None, every_row: bool = False):
        self.masked, self.embed, self.corners, self.every_row = masked, embed, corners, every_row

    def __call__(self, rpe: ContextualRPE, q: torch.Tensor, qr: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, d), qr (B, H, T, buckets) scaled per-bucket scores, bias (B, H, T, T) -> perturbed bias."""
        B, H, T, d = q.shape
        scale = d**-0.5
        c = rpe.num_cls
        rows = self.masked[:, None, :, None]  # (B, 1, N, 1): perturbed query rows
        if self.corners is not None:
            N = T - c
            corners, weights = self.corners  # (N, N, 4), or (B, N, N, 4) for every row of every sample
            lead = B if self.every_row else 1
            patch_qr = qr[:, :, c:]  # (B, H, N, buckets)
            picked = patch_qr.gather(-1, corners.reshape(lead, 1, N, N * 4).expand(B, H, N, N * 4))
            continuous = (picked.reshape(B, H, N, N, 4) * weights.reshape(lead, 1, N, N, 4).to(q.dtype)).sum(-1)
            patch = continuous if self.every_row else torch.where(rows, continuous, bias[:, :, c:, c:])  # (B, H, N, N)
            bias = torch.cat([bias[:, :, :c], torch.cat([bias[:, :, c:, :c], patch], dim=3)], dim=2)
        if self.embed is not None:
            embed = self.embed.to(q.dtype).expand(-1, H, -1)  # (buckets, H, d): a shared table's perturbation too
            qa = torch.einsum("bhtd,nhd->bhtn", q[:, :, c:], embed) * scale  # (B, H, N, buckets)
            extra = qa.gather(-1, rpe.buckets[c:].expand(B, H, T - c, T))  # (B, H, N, T)
            shift = torch.where(rows, extra, torch.zeros_like(extra))
            bias = bias + torch.cat([torch.zeros_like(bias[:, :, :c]), shift], dim=2)
        return bias


def coordinate_corners(rpe: ContextualRPE, deltas: torch.Tensor, lookup: str = "project",
                       masked: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """deltas (L, 2), one offset shift per block of a stack sharing `rpe`'s grid and index ->
    each block's (corners, weights), computed in one pass for all L blocks; `lookup` one of
    model.irpe.COORD_LOOKUPS. project: (N, N, 4) each, for the masked rows. official: (B, N, N, 4)
    each for every patch row of the masked (B, N) samples, visible rows at delta 0 (as the official
    code's), mixed here once for the stack rather than in every block."""
    if lookup == "official" and masked is None:
        raise ValueError("the official coordinate lookup covers every patch row: pass the mask")
    shifts = deltas if lookup == "project" else torch.cat([deltas, deltas.new_zeros(1, 2)])  # (L or L+1, 2)
    corners, weights = bilinear_corners(rpe.rel + shifts[:, None, None].to(rpe.rel.dtype), **rpe.index_args,
                                        lookup=lookup)  # (L or L+1, N, N, 4) each
    if lookup == "official":  # masked rows at their block's shift, visible rows at the last (zero) one
        every_row = masked[None, :, :, None, None]  # (1, B, N, 1, 1)
        corners = torch.where(every_row, corners[:-1, None], corners[-1:, None])  # (L, B, N, N, 4)
        weights = torch.where(every_row, weights[:-1, None], weights[-1:, None])
    return list(zip(corners.unbind(0), weights.unbind(0)))
