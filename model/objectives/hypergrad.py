"""Finite-difference hypergradients for MLO-MAE (Guo et al. 2024, arXiv:2402.18128, appendix A).

Three levels, with one-step approximations of the lower solutions:
    E' = E - eta_E * grad_E L1(E, D; T)          (level I: weighted reconstruction, on D_tr)
    C' = C - eta_C * grad_C L2(E', C)            (level II: linear head on frozen E', on D_tr)
    L3 = CE(C'(E'(x_val)), y_val)                 (level III: validation loss, a function of T)
Chain rule (Eqs. 9-11), with v_E = dL3/dE', v_C = dL3/dC':
    w      = v_E - eta_C * H_{E',C}(L2) v_C       (the path through the head, `through_head`)
    dL3/dT = -eta_E * H_{T,E}(L1) w
Each mixed second derivative times a vector is a central finite difference of a first
derivative (the DARTS estimate): H_{a,b}(f) v = d/de grad_a f(b + e v) at e = 0
    ~ (grad_a f(b + eps v) - grad_a f(b - eps v)) / (2 eps),   eps = eps_scale / ||v||.
The perturbation is applied in place to the tensors the loss closures read and undone by
copying the saved values back, so the weights are bit-identical afterwards (adding +eps, -2 eps,
+eps would leave rounding residue; the reference code leaves them shifted altogether).

Where the Hessians are evaluated (the linearisation points) is the caller's choice: the exact
one-step hypergradient takes H(L1) at the pre-step E and H(L2) at (E', C); training evaluates
all three at the current weights, after the real optimizer steps, as Betty's implicit
reading of the DARTS estimate does (no copy of the model is kept).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

Tensors = Sequence[torch.Tensor]


def _global_norm(tensors: Tensors) -> torch.Tensor:
    """l2 norm over all tensors, in fp32 (fp64 inputs: fp64)."""
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.to(dtype)) for t in tensors]))


def central_difference(params: Tensors, direction: Tensors, grad_fn: Callable[[], Tensors],
                       eps_scale: float = 0.01) -> list[torch.Tensor]:
    """(grad_fn() at params + eps v  -  grad_fn() at params - eps v) / (2 eps), eps = eps_scale / ||v||.

    `params` are modified in place while grad_fn runs and restored bit-exactly afterwards (also on
    an exception). A zero direction gives zeros. No host synchronisation.
    """
    eps = eps_scale / _global_norm(direction).clamp_min(1e-30)  # 0-dim tensor on the device
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p, p0, v in zip(params, saved, direction, strict=True):
                p.copy_(p0 + eps.to(p.dtype) * v)
        plus = [g.detach() for g in grad_fn()]
        with torch.no_grad():
            for p, p0, v in zip(params, saved, direction, strict=True):
                p.copy_(p0 - eps.to(p.dtype) * v)
        minus = [g.detach() for g in grad_fn()]
    finally:
        with torch.no_grad():
            for p, p0 in zip(params, saved, strict=True):
                p.copy_(p0)
    return [(a - b) / (2 * eps.to(a.dtype)) for a, b in zip(plus, minus, strict=True)]


@dataclass
class Points:
    """The tensors each loss closure reads: encoder weights for L1 (enc_l1), encoder and head for
    L2 (enc_l2, head_l2) and for L3 (enc_l3, head_l3). Training passes the same tensors for all."""

    enc_l1: Tensors
    enc_l2: Tensors
    head_l2: Tensors
    enc_l3: Tensors
    head_l3: Tensors

    @classmethod
    def current(cls, enc: Tensors, head: Tensors) -> "Points":
        return cls(enc, enc, head, enc, head)


def mask_hypergradient(level1: Callable[[], torch.Tensor], level2: Callable[[], torch.Tensor],
                       level3: Callable[[], torch.Tensor], mask_params: Tensors, points: Points,
                       lr_enc: float, lr_head: float, through_head: bool = True,
                       eps_scale: float = 0.01) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """dL3/dT by the one-step unrolled approximation with finite-difference second-order terms.

    level1() -> L1 differentiable w.r.t. `mask_params` (the masking network T);
    level2() -> L2 differentiable w.r.t. points.enc_l2; level3() -> L3 differentiable w.r.t.
    points.enc_l3 and points.head_l3. Returns (gradient per tensor of mask_params, 0-dim
    diagnostics). With through_head False the head path (second term of Eq. 9) is dropped and
    w = v_E (BLO-MAE's lower level, where T does not reach C, passes lr_enc = gamma * eta_E).
    """
    l3 = level3()
    grads = torch.autograd.grad(l3, [*points.enc_l3, *points.head_l3])
    v_enc, v_head = grads[: len(points.enc_l3)], grads[len(points.enc_l3):]
    w = list(v_enc)
    if through_head:
        head_term = central_difference(points.head_l2, v_head,
                                       lambda: torch.autograd.grad(level2(), points.enc_l2), eps_scale)
        w = [v - lr_head * h for v, h in zip(v_enc, head_term, strict=True)]
    mixed = central_difference(points.enc_l1, w,
                               lambda: torch.autograd.grad(level1(), mask_params, allow_unused=True,
                                                           materialize_grads=True), eps_scale)
    hyper = [-lr_enc * g for g in mixed]
    stats = {"level3_loss": l3.detach(), "hypergrad_norm": _global_norm(hyper), "val_grad_norm": _global_norm(w)}
    return hyper, stats


class full_fp32:
    """TF32 off for matmuls and convolutions inside the block (restored after): the finite
    differences need fp32's resolution, and TF32 rounds inputs to 10 mantissa bits."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


class _Method(nn.Module):
    def __init__(self, owner: nn.Module, name: str):
        super().__init__()
        self.owner, self.name = owner, name

    def forward(self, *args):
        return getattr(self.owner, self.name)(*args)


def call_with(module: nn.Module, state: dict[str, torch.Tensor], method: str, *args):
    """module.<method>(*args) computed with the tensors of `state` (names as in module.state_dict())
    in place of the module's own parameters and buffers (torch.func.functional_call)."""
    return functional_call(_Method(module, method), {f"owner.{k}": v for k, v in state.items()}, args)
