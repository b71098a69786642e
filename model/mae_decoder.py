"""The MAE decoder: fills removed positions with a shared mask token and predicts pixels.

Parameter names follow the official MAE release (decoder_embed, mask_token,
decoder_pos_embed, decoder_blocks, decoder_norm, decoder_pred) so its checkpoints map 1:1.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from model.init import mae_init_
from model.irpe import BiasHook
from model.pos_embed import sincos_2d
from model.vit import Block, default_norm, run_block


class MAEDecoder(nn.Module):
    def __init__(
        self,
        grid_size: tuple[int, int],
        patch_size: int,
        in_chans: int,
        encoder_dim: int,
        decoder_dim: int = 512,
        depth: int = 8,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        attn_backend: str = "sdpa",
        rpe: bool = False,
    ):
        super().__init__()
        self.num_patches = grid_size[0] * grid_size[1]
        self.decoder_embed = nn.Linear(encoder_dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        self.decoder_pos_embed = nn.Parameter(
            sincos_2d(decoder_dim, grid_size, cls_token=True)[None], requires_grad=False
        )  # (1, 1+N, Dd)
        self.decoder_blocks = nn.ModuleList(
            Block(decoder_dim, num_heads, mlp_ratio, qkv_bias=True, attn_backend=attn_backend,
                  rpe_grid=grid_size if rpe else None)
            for _ in range(depth)
        )
        self.decoder_norm = default_norm(decoder_dim)
        self.decoder_pred = nn.Linear(decoder_dim, patch_size**2 * in_chans)
        self.grad_checkpointing = False
        mae_init_(self)
        nn.init.normal_(self.mask_token, std=0.02)

    def no_weight_decay(self) -> set[str]:
        return {"mask_token", "decoder_pos_embed"}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def forward(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """latent (B, 1+L, De) = [cls, kept tokens in shuffled order]; ids_restore (B, N).

        Returns per-patch predictions (B, N, p*p*C) in the original (row-major) patch order.
        """
        x = self.decoder_embed(latent)  # (B, 1+L, Dd)
        B, L1, Dd = x.shape
        N = ids_restore.shape[1]
        mask_tokens = self.mask_token.expand(B, N + 1 - L1, Dd)
        shuffled = torch.cat([x[:, 1:], mask_tokens], dim=1)  # (B, N, Dd), kept first
        unshuffled = torch.gather(shuffled, 1, ids_restore[..., None].expand(-1, -1, Dd))
        return self.decode(torch.cat([x[:, :1], unshuffled], dim=1))

    def forward_keep(self, latent: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Several decodings per encoded sequence, each keeping a different subset of its tokens.

        latent (B, 1+N, De) covers every patch position; keep (B, P, N) bool. Decoding (b, j) sees
        latent[b]'s cls and its tokens where keep[b, j], the mask token elsewhere (MixedAE's
        unmixing: one decoding per source image of a mixed image). Returns (B, P, N, p*p*C).
        The per-position embedding happens once per latent, before the P-fold expansion.
        """
        x = self.decoder_embed(latent)  # (B, 1+N, Dd)
        B, P, N = keep.shape
        Dd = x.shape[-1]
        patches = torch.where(keep[..., None], x[:, None, 1:], self.mask_token)  # (B, P, N, Dd)
        cls = x[:, None, :1].expand(B, P, 1, Dd)
        out = self.decode(torch.cat([cls, patches], dim=2).reshape(B * P, 1 + N, Dd))
        return out.reshape(B, P, N, -1)

    def decode(self, x: torch.Tensor, bias_hooks: Sequence[BiasHook | None] | None = None) -> torch.Tensor:
        """(B, 1+N, Dd) decoder tokens in patch order -> (B, N, p*p*C) predictions (cls dropped).
        `bias_hooks`: one edit of the relative-position bias (or None) per block, as the encoder's
        forward_tokens takes them (built with rpe=True)."""
        if bias_hooks is not None and len(bias_hooks) != len(self.decoder_blocks):
            raise ValueError(f"bias_hooks has {len(bias_hooks)} entries for {len(self.decoder_blocks)} blocks")
        x = x + self.decoder_pos_embed
        for i, block in enumerate(self.decoder_blocks):
            x = run_block(block, x, None, bias_hooks[i] if bias_hooks is not None else None,
                          recompute=self.grad_checkpointing)
        return self.decoder_pred(self.decoder_norm(x))[:, 1:]
