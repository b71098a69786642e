"""A plain-PyTorch MAE, built the way the paper's reference implementation is organised, as the
baseline our engine is measured against (tools/gpu_check.py bench).

Written here from He et al. 2022 (section 3 and appendix A.1), not copied: timm `Block`s (pre-norm,
qkv bias, LayerNorm eps 1e-6), a conv patch embedding, fixed 2-D sin-cos positions, a cls token,
random masking by argsort of uniform noise, a lighter decoder with a shared mask token, the
per-patch MSE on normalised pixels over removed patches; trained with torch.optim.AdamW
(betas 0.9/0.95, weight decay 0.05 on weights only) under torch.autocast, with a GradScaler in
fp16. No DeepSpeed, no fused kernels of ours. Like the reference training loop it reads the loss
on the host every step (`loss.item()`, to stop on a non-finite loss).
"""
from __future__ import annotations

import contextlib
import time
from functools import partial
from typing import Callable

import torch
from timm.models.vision_transformer import Block
from torch import nn


def sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """(grid*grid, dim) fixed positions: half the channels encode the row, half the column."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)  # (dim/4,)
    rows, cols = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                                indexing="ij")
    parts = []
    for coord in (rows.reshape(-1), cols.reshape(-1)):
        angles = coord[:, None] * omega[None]  # (N, dim/4)
        parts += [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=1).float()  # (N, dim)


class BaselineMAE(nn.Module):
    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int, depth: int, num_heads: int,
                 decoder_dim: int, decoder_depth: int, decoder_heads: int, mask_ratio: float = 0.75,
                 norm_pix_loss: bool = True, mlp_ratio: float = 4.0):
        super().__init__()
        self.patch_size, self.mask_ratio, self.norm_pix_loss = patch_size, mask_ratio, norm_pix_loss
        grid = img_size // patch_size
        self.num_patches = grid * grid
        norm = partial(nn.LayerNorm, eps=1e-6)
        self.patch_embed = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.register_buffer("pos", sincos_2d(embed_dim, grid)[None])  # (1, N, D), not trained
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm)
                                    for _ in range(depth))
        self.norm = norm(embed_dim)
        self.decoder_embed = nn.Linear(embed_dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        self.register_buffer("decoder_pos", sincos_2d(decoder_dim, grid)[None])  # (1, N, Dd)
        self.decoder_blocks = nn.ModuleList(Block(decoder_dim, decoder_heads, mlp_ratio, qkv_bias=True,
                                                  norm_layer=norm) for _ in range(decoder_depth))
        self.decoder_norm = norm(decoder_dim)
        self.decoder_pred = nn.Linear(decoder_dim, patch_size * patch_size * in_chans)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, p*p*C)."""
        B, C, H, W = images.shape
        p = self.patch_size
        x = images.reshape(B, C, H // p, p, W // p, p)
        return torch.einsum("bchpwq->bhwpqc", x).reshape(B, (H // p) * (W // p), p * p * C)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        B = images.shape[0]
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos  # (B, N, D)
        keep = int(self.num_patches * (1 - self.mask_ratio))
        noise = torch.rand(B, self.num_patches, device=images.device)
        shuffle = noise.argsort(dim=1)
        restore = shuffle.argsort(dim=1)
        ids_keep = shuffle[:, :keep]  # (B, L)
        x = torch.gather(x, 1, ids_keep[..., None].expand(-1, -1, x.shape[-1]))  # (B, L, D)
        x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.decoder_embed(self.norm(x))  # (B, 1+L, Dd)
        masks = self.mask_token.expand(B, self.num_patches - keep, -1)
        y = torch.cat([x[:, 1:], masks], dim=1)
        y = torch.gather(y, 1, restore[..., None].expand(-1, -1, y.shape[-1]))  # (B, N, Dd) in patch order
        y = torch.cat([x[:, :1], y], dim=1) + torch.cat([torch.zeros_like(self.decoder_pos[:, :1]), self.decoder_pos], 1)
        for blk in self.decoder_blocks:
            y = blk(y)
        pred = self.decoder_pred(self.decoder_norm(y))[:, 1:]  # (B, N, p*p*C)
        target = self.patchify(images.float())
        if self.norm_pix_loss:
            mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
            target = (target - mean) / (var + 1e-6) ** 0.5
        removed = torch.ones(B, self.num_patches, device=images.device)
        removed[:, :keep] = 0
        removed = torch.gather(removed, 1, restore)  # (B, N), 1 = removed
        per_patch = ((pred.float() - target) ** 2).mean(-1)
        return (per_patch * removed).sum() / removed.sum()


def optimizer(model: nn.Module, lr: float, weight_decay: float = 0.05, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on every tensor of two or more dimensions: weight matrices and the
    cls and mask tokens (as MAE's pretraining code decays them), not biases and norms; `fused` None
    is torch's default (foreach on CUDA), True the fused kernel."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=fused)


def no_phases(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class BaselineStep:
    """One training step of the reference loop: autocast forward, (scaled) backward, AdamW step,
    `loss.item()`. `phase(name)` marks its parts (data, forward, backward, step, loop) for the
    census (tools/census.py); the default marks nothing."""

    def __init__(self, model: BaselineMAE, batches, dtype: torch.dtype, device: torch.device,
                 fused: bool | None = None, lr: float = 1.5e-4):
        self.model, self.batches, self.dtype, self.device = model, batches, dtype, device
        self.opt = optimizer(model, lr=lr, fused=fused)
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        self.losses: list[float] = []
        model.train()

    def __call__(self, phase: Callable[[str], contextlib.AbstractContextManager] = no_phases) -> None:
        with phase("data"):
            images = next(self.batches)["image"]
        with phase("forward"), torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            loss = self.model(images)
        with phase("loop"):
            self.losses.append(loss.item())  # the reference loop's per-step finiteness check (a host sync)
        with phase("step"):
            self.opt.zero_grad(set_to_none=True)
        with phase("backward"):
            self.scaler.scale(loss).backward()
        with phase("step"):
            self.scaler.step(self.opt)
            self.scaler.update()


def time_training(model: BaselineMAE, batches, steps: int, warmup: int, dtype: torch.dtype,
                  device: torch.device, fused: bool | None = None) -> dict:
    """Images/s and step time of `steps` training steps after `warmup`; `batches` yields {"image": (B, C, H, W)}
    on `device`. fp16 uses a GradScaler; peak memory (CUDA) is taken over the timed steps."""
    step = BaselineStep(model, batches, dtype, device, fused)
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    batch = images_per_batch(batches)
    out = {"images_per_s": steps * batch / elapsed, "step_time_s": elapsed / steps, "loss": step.losses[-1],
           "dtype": str(dtype).removeprefix("torch."), "grad_scaler": dtype == torch.float16,
           "optimizer": "fused" if step.opt.defaults.get("fused") else "foreach"}
    if device.type == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def images_per_batch(batches) -> int:
    return batches.batch_size
