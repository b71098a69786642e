"""MAE objective (Masked Autoencoders Are Scalable Vision Learners, He et al. 2022, arXiv:2111.06377,
section 3).

Encoder sees only the kept ~25% of patch tokens (+cls); the decoder reconstructs every patch;
the loss is the per-patch MSE to normalized pixels, averaged over removed patches only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.mae_decoder import MAEDecoder
from model.objectives.base import Objective, ObjectiveConfig, register_objective
from model.objectives.masking import (
    Masking,
    check_mask_ratio,
    check_supplied,
    gather_tokens,
    masking_from_mask,
    masking_from_noise,
    num_kept,
)
from model.objectives.patches import normalized_pixels, patchify, unpatchify
from model.vit import VisionTransformer


@dataclass
class MAEConfig(ObjectiveConfig):
    mask_ratio: float = field(default=0.75, metadata={"range": "(0, 1)"})  # share of patches removed, in (0, 1)
    norm_pix_loss: bool = True  # reconstruct per-patch normalised pixels (MAE's default)
    decoder_dim: int = field(default=512, metadata={"range": "[4, inf)"})  # MAE decoder width
    decoder_depth: int = field(default=8, metadata={"range": "[1, inf)"})  # MAE decoder blocks
    decoder_heads: int = field(default=16, metadata={"range": "[1, inf)"})  # MAE decoder attention heads

    # `section`, not "mae": a method deriving this config reports the options under its own name
    def validate(self) -> None:
        check_decoder(self.section, self.decoder_dim, self.decoder_heads)

    def check_fits(self, img_size: int, patch_size: int, depth: int, micro_batch: int) -> None:
        check_mask_ratio(f"{self.section}.mask_ratio", self.mask_ratio, (img_size // patch_size) ** 2)


def check_decoder(section: str, dim: int, heads: int) -> None:
    """The MAE decoder's width against its heads and its 2-D sin-cos position table (a quarter of
    the width per sin/cos of each axis)."""
    if dim % heads:
        raise ValueError(f"{section}.decoder_dim {dim} is not divisible by {section}.decoder_heads {heads}")
    if dim % 4:
        raise ValueError(f"{section}.decoder_dim {dim} is not a multiple of 4, which its 2-D sin-cos position "
                         f"table needs (e.g. {dim // 4 * 4 or 4})")


def per_patch_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """pred, target (B, N, P) -> (B, N) mean squared error per patch, in fp32 (fp64 stays)."""
    compute = torch.promote_types(pred.dtype, torch.float32)  # fp16/bf16 -> fp32
    return ((pred.to(compute) - target.to(compute)) ** 2).mean(dim=-1)


def masked_patch_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """pred, target (B, N, P); mask (B, N) with 1 = removed. Mean per-patch MSE over removed."""
    return (per_patch_mse(pred, target) * mask).sum() / mask.sum()


@register_objective("mae", MAEConfig)
class MAEObjective(Objective):
    def __init__(self, encoder: VisionTransformer, cfg: MAEConfig):
        cfg.validate()
        super().__init__(encoder, cfg)
        pe = encoder.patch_embed
        self.patch_size = pe.patch_size
        self.decoder = MAEDecoder(
            pe.grid_size, pe.patch_size, pe.proj.in_channels, encoder.embed_dim,
            cfg.decoder_dim, cfg.decoder_depth, cfg.decoder_heads,
            attn_backend=encoder.blocks[0].attn.backend,
        )

    def make_masking(self, batch: dict[str, torch.Tensor], batch_size: int, device: torch.device) -> Masking:
        """Caller-supplied `mask` (1 = removed) or `mask_noise` (B, N) take precedence over fresh noise."""
        N = self.encoder.num_patches
        if "mask" in batch:
            check_supplied("mask", batch["mask"], batch_size, N)
            return masking_from_mask(batch["mask"])
        noise = batch.get("mask_noise")
        if noise is None:
            noise = torch.rand(batch_size, N, device=device)
        else:
            check_supplied("mask_noise", noise, batch_size, N)
        return masking_from_noise(noise, num_kept(N, self.cfg.mask_ratio))

    def encode(self, images: torch.Tensor, masking: Masking, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """(B, C, H, W) -> latent (B, 1+L, D) over the kept tokens. Positions are added before masking.
        `tokens` (B, N, D): the patch embeddings when the caller already has them."""
        tokens = self.encoder.embed_patches(images) if tokens is None else tokens  # (B, N, D)
        kept = gather_tokens(tokens, masking.ids_keep)  # (B, L, D)
        return self.encoder.forward_tokens(self.encoder.add_cls_token(kept))

    def target(self, images: torch.Tensor) -> torch.Tensor:
        t = patchify(images.to(torch.promote_types(images.dtype, torch.float32)), self.patch_size)  # (B, N, p*p*C), fp32 in bf16/fp16 runs
        return normalized_pixels(t) if self.cfg.norm_pix_loss else t

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        images = batch["image"]
        masking = self.make_masking(batch, images.shape[0], images.device)
        pred = self.decoder(self.encode(images, masking), masking.ids_restore)  # (B, N, p*p*C)
        loss = masked_patch_loss(pred, self.target(images), masking.mask)
        # pred for inspection, detached: a view (the decoder drops its cls row) that requires grad
        # makes FSDP2 warn at every forward of the root module
        return {"loss": loss, "pred": pred.detach(), "mask": masking.mask}

    def vis_masking(self, images: torch.Tensor, noise: torch.Tensor) -> Masking:
        """The masking the figures show: MAE's random masking from the fixed noise (B, N)."""
        return masking_from_noise(noise, num_kept(self.encoder.num_patches, self.cfg.mask_ratio))

    @torch.no_grad()
    def visualizations(self, images: torch.Tensor, noise: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Rows of (B, C, H, W) images in the input's normalised space: original, masked input
        (removed patches zeroed), reconstruction, reconstruction with the visible patches pasted.
        Normalised-pixel predictions are mapped back with each patch's true mean/std (as MAE's demo)."""
        masking = self.vis_masking(images, noise)
        pred = self.decoder(self.encode(images, masking), masking.ids_restore).float()  # (B, N, p*p*C)
        target = patchify(images.float(), self.patch_size)
        if self.cfg.norm_pix_loss:
            mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True, unbiased=True)
            pred = pred * (var + 1e-6) ** 0.5 + mean
        removed = masking.mask[..., None]  # (B, N, 1)
        shape = (self.patch_size, self.encoder.patch_embed.grid_size, images.shape[1])
        return {"mae_reconstruction": [
            images.float(),
            unpatchify(target * (1 - removed), *shape),
            unpatchify(pred, *shape),
            unpatchify(target * (1 - removed) + pred * removed, *shape),
        ]}
