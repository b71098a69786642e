"""Vision Transformer encoder with timm-compatible parameter names and shapes.

`VisionTransformer(...).state_dict()` loads with strict=True into
`timm.models.vision_transformer.VisionTransformer` built from `timm_kwargs()`, and produces
the same features. Differences from timm are in behaviour only: the position embedding is the
fixed 2-D sin-cos table (a frozen Parameter, so it is saved under timm's name `pos_embed`; the
finetune objective unfreezes it, as MAE's fine-tuning recipe trains it),
attention goes through `kernels.attention`, and the token pipeline is split into steps
(`embed_patches` -> [objective edits tokens] -> `add_cls_token` -> `forward_tokens`) so
objectives can mask or rearrange tokens without any method-specific code in here.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels import AttentionMask, attention, resolve_backend
from model.init import mae_init_
from model.irpe import BiasHook, ContextualRPE
from model.layer_norm import LayerNorm
from model.pos_embed import sincos_2d


class PatchEmbed(nn.Module):
    """(B, C, H, W) -> (B, N, D) with N = (H/p)(W/p), row-major patch order."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not divisible by patch_size {patch_size}")
        self.img_size = img_size
        self.patch_size = patch_size
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(f"expected {self.img_size}x{self.img_size} images, got {tuple(x.shape[-2:])}")
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, D, gh, gw) -> (B, N, D)


class Attention(nn.Module):
    """Multi-head self-attention; `rpe_grid` adds iRPE relative positions (contextual, on keys)
    for a fixed sequence of 1 cls + gh*gw tokens, whose score bias a per-call `bias_hook` may edit."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, backend: str = "sdpa",
                 rpe_grid: tuple[int, int] | None = None):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed dim {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.backend = resolve_backend(backend)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.rpe = ContextualRPE(num_heads, dim // num_heads, rpe_grid) if rpe_grid is not None else None

    def forward(self, x: torch.Tensor, mask: AttentionMask | None = None,
                bias_hook: BiasHook | None = None) -> torch.Tensor:
        B, N, D = x.shape
        if bias_hook is not None and self.rpe is None:
            raise ValueError("a bias_hook edits the relative-position bias: build the model with rpe=True")
        # (B, N, 3D) -> q, k, v (B, H, N, d), views of the projection. Their gradients meet in the
        # projection's (B, N, 3, H, d) layout: eagerly, unbind's backward stacks them there in one
        # kernel, where indexing would fill a zero tensor and copy into it per index and then add
        # the three; compiled, inductor fuses indexing's backward into one kernel but copies each
        # input of a stack separately (tools/census.py counts both).
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, D // self.num_heads)
        parts = [qkv[:, :, i] for i in range(3)] if torch.compiler.is_compiling() else qkv.unbind(2)
        q, k, v = (t.transpose(1, 2) for t in parts)
        bias = self.rpe(q, bias_hook) if self.rpe is not None else None  # (B, H, N, N)
        out = attention(q, k, v, backend=self.backend, mask=mask, bias=bias)  # (B, H, N, d)
        return self.proj(out.transpose(1, 2).reshape(B, N, D))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


NormLayer = Callable[[int], nn.Module]
default_norm: NormLayer = partial(LayerNorm, eps=1e-6)


class DropPath(nn.Module):
    """Stochastic depth per sample, as timm's DropPath: in training each sample's residual branch is
    kept with probability 1 - drop_prob and scaled by its inverse. The probability lives in a 0-dim
    buffer, not a Python float: a compiled block (`Block.compile_static`) would otherwise be
    specialised on its own rate, so the linear rule's distinct rates gave every block a graph of its
    own, and past dynamo's recompile limit (8 graphs) `fullgraph` fails. Its fp32 bits are stored
    as int32, which `module.to(bfloat16)` leaves alone (a bf16 rate would be 0.8984 for 0.9)."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob = drop_prob  # for repr only: forward reads the buffer
        keep = torch.tensor(1.0 - drop_prob, dtype=torch.float32)
        self.register_buffer("keep_bits", keep.view(torch.int32), persistent=False)  # no state_dict key: timm's names
        # what the kept samples are divided by: keep, or 1 where nothing is kept (rate 1: zeros, as timm's, not 0 / 0)
        divisor = keep if drop_prob < 1.0 else torch.tensor(1.0)
        self.register_buffer("divisor_bits", divisor.view(torch.int32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = self.keep_bits.view(torch.float32)
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)  # (B, 1, ..., 1)
        return x * mask.div_(self.divisor_bits.view(torch.float32))

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:g}"


class Block(nn.Module):
    """Pre-norm transformer block; attention and MLP classes are arguments (timm style)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path: float = 0.0,
        attn_backend: str = "sdpa",
        norm_layer: NormLayer = default_norm,
        attn_layer: type[nn.Module] = Attention,
        mlp_layer: type[nn.Module] = Mlp,
        rpe_grid: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.norm1 = norm_layer(dim)
        extra = {"rpe_grid": rpe_grid} if rpe_grid is not None else {}
        self.attn = attn_layer(dim, num_heads, qkv_bias=qkv_bias, backend=attn_backend, **extra)
        self.norm2 = norm_layer(dim)
        self.mlp = mlp_layer(dim, int(dim * mlp_ratio))
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    compiled_forward: Callable | None = None  # set by compile_static

    def forward(self, x: torch.Tensor, attn_mask: AttentionMask | None = None,
                bias_hook: BiasHook | None = None) -> torch.Tensor:
        """x: (B, N, D) -> (B, N, D)."""
        if self.compiled_forward is not None:
            return self.compiled_forward(x, attn_mask, bias_hook)
        return self.block_forward(x, attn_mask, bias_hook)

    def block_forward(self, x: torch.Tensor, attn_mask: AttentionMask | None,
                      bias_hook: BiasHook | None) -> torch.Tensor:
        extra = {"bias_hook": bias_hook} if bias_hook is not None else {}  # attn_layer classes without hooks work
        x = x + self.drop_path(self.attn(self.norm1(x), attn_mask, **extra))
        return x + self.drop_path(self.mlp(self.norm2(x)))

    def compile_static(self, cuda_graphs: bool = False) -> None:
        """torch.compile the block's computation as one graph (`fullgraph`: a graph break is an
        error, not a silent split), static in every dimension: without `dynamic=False`, the second
        shape the shared code meets (the MAE decoder's token count and width after the encoder's)
        makes dynamo mark those dimensions symbolic for every block, and inductor then tiles and
        fuses for unknown sizes (and a symbolic batch alone costs host time at every call). A
        training micro-batch has one size, so each block shape gets one graph. `cuda_graphs`: the
        graph is also replayed as a CUDA graph ("reduce-overhead"), so the host issues one launch
        per block instead of its kernels (the caller marks each step's start:
        torch.compiler.cudagraph_mark_step_begin). Module hooks (DDP's, FSDP2's) stay outside the
        graph, as with torchtitan's per-block compile."""
        self.compiled_forward = torch.compile(self.block_forward, dynamic=False, fullgraph=True,
                                              mode="reduce-overhead" if cuda_graphs else None)


def run_block(block: Block, x: torch.Tensor, attn_mask: AttentionMask | None = None,
              bias_hook: BiasHook | None = None, recompute: bool = False) -> torch.Tensor:
    """block(x, ...), or with activation checkpointing (non-reentrant: the recomputation sees the
    same drop-path draws, and gradients of any order flow through it)."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(block, x, attn_mask, bias_hook, use_reentrant=False)
    return block(x, attn_mask, bias_hook)


class VisionTransformer(nn.Module):
    """ViT encoder: conv patch embed, cls token, fixed sin-cos positions, pre-norm blocks, norm.

    global_pool: 'token' (cls feature, MAE pretraining / linear probe) or 'avg' (mean of patch
    tokens followed by `fc_norm`, MAE fine-tuning); num_classes=0 means no head.
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        num_classes: int = 0,
        global_pool: str = "token",
        attn_backend: str = "sdpa",
        rpe: bool = False,
    ):
        super().__init__()
        if global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
        self.arch = dict(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
            depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
        )
        self.rpe = rpe  # iRPE in every block: extra `blocks.i.attn.rpe.table` parameters timm does not have
        self.img_size, self.embed_dim = img_size, embed_dim
        self.global_pool = global_pool
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # Fixed table, saved under timm's name; requires_grad=False keeps it out of the optimizer
        # (pretraining, linear probe); model/objectives/finetune.py turns it on.
        self.pos_embed = nn.Parameter(
            sincos_2d(embed_dim, self.patch_embed.grid_size, cls_token=True)[None], requires_grad=False
        )  # (1, 1+N, D)
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # stochastic depth grows with depth
        rpe_grid = self.patch_embed.grid_size if rpe else None
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_path=dpr[i], attn_backend=attn_backend,
                  rpe_grid=rpe_grid)
            for i in range(depth)
        )
        # timm: final norm before a cls-token head, fc_norm after average pooling instead.
        self.norm = default_norm(embed_dim) if global_pool == "token" else nn.Identity()
        self.fc_norm = default_norm(embed_dim) if global_pool == "avg" else nn.Identity()
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.grad_checkpointing = False  # set_grad_checkpointing: recompute blocks in backward
        mae_init_(self)
        nn.init.normal_(self.cls_token, std=0.02)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Keep only each block's input for backward and recompute the block there (timm's name)."""
        self.grad_checkpointing = enable

    def reset_head(self, num_classes: int) -> None:
        """A fresh Linear classifier (timm's name `head`) on the pooled feature."""
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def no_weight_decay(self) -> set[str]:
        """Parameter names (relative to this module) exempt from weight decay besides 1-D ones."""
        return {"cls_token", "pos_embed"}

    def timm_kwargs(self) -> dict:
        """Keyword arguments of timm's VisionTransformer that rebuild this encoder exactly."""
        extra = {"rpe": True} if self.rpe else {}  # not a timm argument: such encoders load only into ours
        return dict(
            **self.arch,
            **extra,
            class_token=True,
            global_pool=self.global_pool,
            num_classes=self.head.out_features if isinstance(self.head, nn.Linear) else 0,
        )

    # --- token pipeline: objectives call these steps and edit the tokens in between ---
    def embed_patches(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, D) patch tokens with their position embedding added."""
        return self.patch_embed(x) + self.pos_embed[:, 1:]

    def add_cls_token(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L, D) -> (B, 1+L, D); the cls token gets the (zero) cls position."""
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(tokens.shape[0], -1, -1)
        return torch.cat([cls, tokens], dim=1)

    def forward_tokens(
        self,
        x: torch.Tensor,
        block_input: torch.Tensor | None = None,
        attn_masks: Sequence[AttentionMask | None] | None = None,
        bias_hooks: Sequence[BiasHook | None] | None = None,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D) through all blocks and the final norm.

        Hooks for objectives (none by default): `block_input` (B, T, D) is added to the input of
        every block (e.g. MixedAE's segment embeddings); `attn_masks` gives each block's
        attention a per-call restriction (kernels.SegmentMask / TopKMask, or None = dense);
        `bias_hooks` gives each block's relative-position bias a per-call edit (model.irpe.BiasHook,
        or None; needs rpe=True), e.g. an objective's perturbation of the positions.
        """
        for name, per_block in (("attn_masks", attn_masks), ("bias_hooks", bias_hooks)):
            if per_block is not None and len(per_block) != len(self.blocks):
                raise ValueError(f"{name} has {len(per_block)} entries for {len(self.blocks)} blocks")
        for i, block in enumerate(self.blocks):
            if block_input is not None:
                x = x + block_input
            x = run_block(block, x, attn_masks[i] if attn_masks is not None else None,
                          bias_hooks[i] if bias_hooks is not None else None,
                          recompute=self.grad_checkpointing)
        return self.norm(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, 1+N, D)."""
        return self.forward_tokens(self.add_cls_token(self.embed_patches(x)))

    def pooled_features(self, x: torch.Tensor, pool: str = "avg") -> torch.Tensor:
        """(B, C, H, W) -> (B, D): the mean of the patch tokens (avg) or the cls token, after the
        blocks' norm; an avg-pooled encoder (fine-tuned: no final norm) normalises the mean with its
        `fc_norm`, as its classifier sees it (timm's pre-logits). Its cls token is left unnormalised."""
        tokens = self.forward_features(x)
        return self.fc_norm(tokens[:, 1:].mean(dim=1)) if pool == "avg" else tokens[:, 0]

    def forward_head(self, feats: torch.Tensor) -> torch.Tensor:
        pooled = feats[:, 1:].mean(dim=1) if self.global_pool == "avg" else feats[:, 0]
        return self.head(self.fc_norm(pooled))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
