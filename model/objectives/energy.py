"""Energy-inspired pretraining (Energy-Inspired Self-Supervised Pretraining for Vision Models, Wang et al.
2023, arXiv:2302.01384, section 2.2 and appendix A).

Energy E(x) = h(psi(x)): the backbone's pooled features (ViT: mean of the patch tokens
**[project default]**; timm ConvNeXt / Swin: timm's pooled pre-logits) and a bias-free Linear to 1.
Restoration from a corruption x~0 = corrupt(x), for n = 1..N:
    x~n = x~(n-1) - alpha * grad_x E(SG(x~(n-1)))
with the input gradient taken with create_graph=True, so the loss trains the backbone and the
head through it (double backward); loss = mean over steps of SmoothL1(beta 1)(x~n, x).
alpha = exp(log_alpha) is learnable (init 1.0 **[project default]**).

Precision: the double backward runs in the engine's dtype (fp32, bf16 or fp16); the energy and
the loss are fp32. Under fp16 the inner gradient is taken of E * `fp16_inner_scale` and divided
back, so small input gradients do not flush to zero (the engine's fp16 loss scale only covers
the outer backward). Attention must be twice differentiable: SDPA's flash and memory-efficient
kernels and flash-attn are not, so the ViT is built with the dispatch's `math` backend
(`encoder_overrides`), and timm backbones with it turn their fused attention off
(model/timm_backbone.py); `check_twice_differentiable` refuses any other encoder.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import TWICE_DIFFERENTIABLE
from model.objectives import corruptions as C
from model.objectives.base import Objective, ObjectiveConfig, register_objective
from model.timm_backbone import TimmBackbone

CORRUPTIONS = ("grid", "blank_small", "blank_large", "sr", "denoise", "colorize")


@dataclass
class EnergyConfig(ObjectiveConfig):
    takes_timm_backbones: ClassVar[bool] = True  # the energy reads pooled features only (paper, Table B)
    steps: int = field(default=2, metadata={"range": "[1, inf)"})  # N restoration steps
    alpha_init: float = field(default=1.0, metadata={"range": "(0, inf)"})  # initial step size (alpha = exp(log_alpha), learnable)
    corruption: str = "mixture"  # mixture | grid | blank_small | blank_large | sr | denoise | colorize
    mixture: str = "grid,sr,denoise,colorize"  # the mixture's parts (the paper's main setting: masking, SR, denoising, colorization)
    grid_cell: int = field(default=16, metadata={"range": "[1, inf)"})  # px per grid cell (paper: 16, 24, 32)
    grid_ratio: float = field(default=0.75, metadata={"range": "(0, 1)"})  # share of cells blanked [project default: MAE's ratio]
    small_blanks: int = field(default=75, metadata={"range": "[1, inf)"})  # blanks per image in the small-blank corruption
    small_area: tuple[float, float] = field(default=(0.01, 0.025), metadata={"range": "(0, 1]"})  # of the image area, per blank
    large_blanks: int = field(default=25, metadata={"range": "[1, inf)"})  # blanks per image in the large-blank corruption
    large_area: tuple[float, float] = field(default=(0.02, 0.08), metadata={"range": "(0, 1]"})  # U(0.5, 2.0) / 25 of the area [project interpretation]
    sr_scale: int = field(default=16, metadata={"range": "[1, inf)"})  # super-resolution factor (paper: 14, 16, 24, 32 at 224 px)
    pool: str = "avg"  # ViT features: avg (patch tokens) | cls
    fp16_inner_scale: float = field(default=1024.0, metadata={"range": "(0, inf)"})  # scale of E before the inner gradient under fp16

    def validate(self) -> None:
        if self.corruption != "mixture" and self.corruption not in CORRUPTIONS:
            raise ValueError(f"energy.corruption must be mixture or one of {CORRUPTIONS}, got {self.corruption!r}")
        parts = self.mixture_parts()
        unknown = [p for p in parts if p not in CORRUPTIONS]
        if not parts or unknown:
            raise ValueError(f"energy.mixture lists unknown corruptions {unknown}; choose from {CORRUPTIONS}")
        if self.pool not in ("avg", "cls"):
            raise ValueError(f"energy.pool must be avg or cls, got {self.pool!r}")
        for name in ("small_area", "large_area"):
            lo, hi = getattr(self, name)
            if lo > hi:  # each bound's range is its field's
                raise ValueError(f"energy.{name} must be low,high with low <= high, got {lo},{hi}")

    def mixture_parts(self) -> list[str]:
        return [p.strip() for p in self.mixture.split(",") if p.strip()]

    def used(self) -> list[str]:
        return self.mixture_parts() if self.corruption == "mixture" else [self.corruption]

    def encoder_overrides(self) -> dict:
        """Attention must support double backward: the ViT's dispatch backend, timm's explicit path."""
        return {"attn_backend": TWICE_DIFFERENTIABLE}

    def check_fits(self, img_size: int, patch_size: int, depth: int, micro_batch: int) -> None:
        used = self.used()
        if "grid" in used and img_size % self.grid_cell:
            raise ValueError(f"energy.grid_cell {self.grid_cell} does not tile {img_size} px images; choose a divisor")
        if "sr" in used and img_size % self.sr_scale:
            raise ValueError(f"energy.sr_scale {self.sr_scale} does not divide {img_size} px images; choose a divisor")

    def check_input(self, in_chans: int) -> None:
        if "colorize" in self.used() and in_chans != 3:
            raise ValueError(f"energy corruption colorize needs RGB input but model.in_chans is {in_chans}; "
                             f"set model.in_chans 3 or leave colorize out of energy.mixture")

    def corruption_fns(self) -> dict[str, Callable]:
        fns = {
            "grid": partial(C.grid_mask, cell=self.grid_cell, ratio=self.grid_ratio),
            "blank_small": partial(C.random_blanks, count=self.small_blanks, area=self.small_area),
            "blank_large": partial(C.random_blanks, count=self.large_blanks, area=self.large_area),
            "sr": partial(C.super_resolution, scale=self.sr_scale),
            "denoise": C.denoise,
            "colorize": C.colorize,
        }
        return {name: fns[name] for name in self.used()}


def check_twice_differentiable(encoder: nn.Module) -> None:
    """Refuse an encoder whose attention has no double backward: our ViT on another backend than
    the twice-differentiable one, or a timm backbone with a module still on fused SDPA (the error
    would otherwise come from autograd in the first step, far from its cause)."""
    fix = f"build it with attn_backend {TWICE_DIFFERENTIABLE!r} (create_model(..., attn_backend=...); pretrain.py does)"
    if isinstance(encoder, TimmBackbone):
        fused = [name for name, on in encoder.attention_modules().items() if on]
        if fused:
            raise ValueError(f"energy pretraining needs double backward through attention, but timm {encoder.name}'s "
                             f"modules {fused[:3]}{' ...' if len(fused) > 3 else ''} use fused SDPA, which has none; "
                             f"{fix}, which turns timm's fused attention off")
        return
    backends = {block.attn.backend for block in getattr(encoder, "blocks", [])}
    if backends - {TWICE_DIFFERENTIABLE}:
        raise ValueError(f"energy pretraining needs double backward through attention; {fix}, not "
                         f"{sorted(backends)}")


@register_objective("energy", EnergyConfig)
class EnergyObjective(Objective):
    double_backward = True  # the loss differentiates through input gradients (memory estimates: train/estimate/costs.py)
    counted_flops = True  # the restoration's input gradients are taken inside the forward

    def __init__(self, encoder: nn.Module, cfg: EnergyConfig):
        cfg.validate()
        super().__init__(encoder, cfg)
        check_twice_differentiable(encoder)
        self.head = nn.Linear(encoder.embed_dim, 1, bias=False)  # energy head h
        nn.init.xavier_uniform_(self.head.weight)
        # shape (1,): a tensor like every other trained one (flat buffers, checkpoints by flat range)
        self.log_alpha = nn.Parameter(torch.full((1,), math.log(cfg.alpha_init)))
        self.corrupt_fns = cfg.corruption_fns()

    def no_weight_decay(self) -> set[str]:
        return {"log_alpha"}

    def energy(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B,) fp32 energies."""
        return self.head(self.encoder.pooled_features(x, self.cfg.pool)).float().squeeze(-1)

    def corrupt(self, images: torch.Tensor, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (corrupted (B, C, H, W), index into cfg.used() per sample or None for a single corruption).
        Randomness from `generator`, or the global RNG (seeded per rank, checkpointed) when None."""
        if self.cfg.corruption != "mixture":
            return self.corrupt_fns[self.cfg.corruption](images, generator=generator), None
        return C.mixture(images, self.corrupt_fns, generator)

    def restore(self, corrupted: torch.Tensor, create_graph: bool = True) -> list[torch.Tensor]:
        """The chain x~1..x~N from x~0 = corrupted; each step's input is detached (SG)."""
        alpha = self.log_alpha.exp()[0]
        scale = self.cfg.fp16_inner_scale if corrupted.dtype == torch.float16 else 1.0
        chain, x = [], corrupted
        for _ in range(self.cfg.steps):
            x = x.detach().requires_grad_()
            with torch.enable_grad():
                (grad,) = torch.autograd.grad(self.energy(x).sum() * scale, x, create_graph=create_graph)
            x = x - alpha.to(x.dtype) * (grad / scale)
            chain.append(x)
        return chain

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        images = batch["image"]
        corrupted, _ = self.corrupt(images)
        chain = self.restore(corrupted.detach())
        target = images.float()
        per_step = [F.smooth_l1_loss(x.float(), target, beta=1.0) for x in chain]
        loss = torch.stack(per_step).mean()
        # Weights that only shift E by a constant (the final norm's bias) get no gradient, yet the
        # double-backward graph still reaches them with an undefined one, which ZeRO's gradient
        # hooks cannot take; a zero-weighted term gives every weight a defined (zero) gradient.
        loss = loss + 0.0 * sum(p.view(-1)[0] for p in self.parameters() if p.requires_grad)
        out = {"loss": loss, "alpha": self.log_alpha.exp()[0].detach(),
               "corrupted_l1": F.smooth_l1_loss(corrupted.float(), target, beta=1.0).detach()}
        out.update({f"loss_step{i + 1}": v.detach() for i, v in enumerate(per_step)})
        return out

    @torch.no_grad()
    def visualizations(self, images: torch.Tensor, noise: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Rows: corrupted, step 1, step N, original (one fixed corruption draw per call)."""
        corrupted, _ = self.corrupt(images, torch.Generator(images.device).manual_seed(0))
        chain = self.restore(corrupted, create_graph=False)
        return {"energy_restoration": [corrupted.float(), chain[0].float(), chain[-1].float(), images.float()]}
