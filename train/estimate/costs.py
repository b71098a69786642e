"""What one micro-batch of an objective costs, from its actual token counts: FLOPs and activation memory.

The objective is built on PyTorch's meta device (shapes only, no memory, no arithmetic) and run
on an example batch with forward hooks on every Linear / Conv2d (matmul FLOPs from the input
and weight shapes), every attention layer (QK^T and PV: 4 B T^2 D FLOPs) and every transformer
block (B, T, D and what its attention keeps for backward). So the counts are those of the code
that trains: MAE's visible tokens, MixedAE's mixed images and per-source decodings, MAE+'s crops,
energy's restoration steps.

Conventions (say them next to any number derived here):
- Modelled training FLOPs (`Profile.train_flops`, what CPU-time guards and the communication
  model take) = 3 x forward FLOPs of what trains (backward = 2 x forward) + 1 x forward FLOPs run
  without gradient (a linear probe's frozen encoder), matmuls only (norms, softmax, GELU and the
  optimizer are not counted), as in the MFU literature. Passes an objective runs outside its
  modules' forwards (energy's restoration gradients, MLO-MAE's levels II-III) are not seen here:
  MFU and the dry run's FLOPs are counted by train/estimate/step_flops.py instead.
- Activation bytes per block, in the compute dtype: 8 D + 2 hidden values per token (norm
  inputs, qkv, q/k/v, attention output, MLP input, MLP hidden before and after GELU), plus a
  T x T matrix per head where attention keeps one (the math reference, the PyTorch TopK
  composition, an additive relative-position bias); flash / memory-efficient SDPA and the fused
  Triton kernels keep none. A checkpointed block keeps its input only and recomputes one block
  at a time in backward; a block run without gradient (a frozen encoder) keeps nothing, and
  holds its values only while it runs. Objectives with a double backward (energy) keep about 2.2x their
  forward activations, the backward graph being kept for the outer backward (measured: the
  tensors autograd saves for energy ViT-B on CPU are 2.18x this forward estimate).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.masked import SegmentMask, TopKMask
from model.objectives import build_objective
from model.objectives.base import Objective
from train.config.ds_config import activation_checkpointing
from train.config.options import PretrainConfig, encoder_img_size, section
from train.config.plan import build_encoder
from train.engine.execution import apply_execution_options

DOUBLE_BACKWARD_FACTOR = 2.2


@dataclass
class BlockCall:
    batch: int
    tokens: int
    dim: int
    hidden: int
    heads: int
    kept_matrix_bytes: float  # bytes per (batch x head x T x T) element the attention keeps for backward
    checkpointed: bool
    module: str = ""  # the block's qualified name in the objective (one block may be called several times)
    forward_flops: float = 0.0  # matmul FLOPs inside the block during this call
    attention: str = "dense"  # the call's kind: dense | segment | topk | biased (kernels.attention.describe_paths)
    backend: str = "sdpa"  # the block's attention backend (sdpa | math | flash_attn)
    trains: bool = True  # run with gradient; without (torch.no_grad: a frozen encoder) it keeps nothing for backward


@dataclass
class Profile:
    """One micro-batch forward of an objective."""
    forward_flops: float = 0.0
    frozen_flops: float = 0.0  # the part of forward_flops run without gradient: no backward follows it
    blocks: list[BlockCall] = field(default_factory=list)
    other_values: float = 0.0  # outputs of layers outside blocks (patch embedding, decoder embed / prediction)
    double_backward: bool = False

    @property
    def train_flops(self) -> float:
        return 3.0 * (self.forward_flops - self.frozen_flops) + self.frozen_flops

    def tokens(self, prefix_dim: int | None = None) -> int:
        """Tokens through blocks (of width `prefix_dim` only, when given) in one forward."""
        return sum(c.batch * c.tokens for c in self.blocks if prefix_dim is None or c.dim == prefix_dim)

    def activation_bytes(self, value_bytes: int) -> float:
        """Bytes held for backward at the end of the forward, plus one block's working set: a
        checkpointed block's recomputation in backward, or a block run without gradient (which
        keeps nothing, but holds its own values while it runs)."""
        full = [value_bytes * c.batch * c.tokens * (8 * c.dim + 2 * c.hidden)
                + c.kept_matrix_bytes * c.batch * c.heads * c.tokens ** 2 for c in self.blocks]
        kept = sum(0.0 if not c.trains else value_bytes * c.batch * c.tokens * c.dim if c.checkpointed else f
                   for c, f in zip(self.blocks, full))
        working = max((f for c, f in zip(self.blocks, full) if c.checkpointed or not c.trains), default=0.0)
        total = kept + working + value_bytes * self.other_values
        return DOUBLE_BACKWARD_FACTOR * total if self.double_backward else total


def _kept_matrix_bytes(attn: nn.Module, mask, rpe: bool, fused_kernels: bool, value_bytes: int) -> float:
    """Bytes per T x T element per head that one attention call keeps for backward."""
    kept = float(value_bytes) if rpe else 0.0  # the additive bias SDPA differentiates through
    if attn.backend == "math":
        return kept + 4.0  # fp32 probabilities
    if isinstance(mask, TopKMask) and not fused_kernels:
        return kept + 5.0  # fp32 probabilities + the boolean keep-mask of the composition
    if isinstance(mask, SegmentMask) and not fused_kernels:
        # SDPA turns the (B, 1, T, T) boolean mask into an additive one of q's dtype, kept for backward
        return kept + value_bytes / attn.num_heads
    return kept


def _attention_kind(mask, rpe: bool) -> str:
    """How kernels.attention dispatches a call with this mask and relative-position bias."""
    if rpe:
        return "biased"
    return "topk" if isinstance(mask, TopKMask) else "segment" if isinstance(mask, SegmentMask) else "dense"


def profile(objective: Objective, batch: dict[str, torch.Tensor], fused_kernels: bool = True,
            value_bytes: int = 2) -> Profile:
    """Run `objective(batch)` with hooks; tensors may live on the meta device. `fused_kernels`:
    whether restricted attention would run the Triton kernels (sm80+ GPUs)."""
    from model.vit import Attention, Block

    out = Profile(double_backward=objective.double_backward)
    in_block: set[int] = set()
    for block in objective.modules():
        if isinstance(block, Block):
            in_block |= {id(m) for m in block.modules()}
    checkpointed = {id(b) for m in objective.modules() if getattr(m, "grad_checkpointing", False)
                    for b in m.modules() if isinstance(b, Block)}
    pending: dict[int, tuple] = {}
    names = {id(m): name for name, m in objective.named_modules()}
    flops_before: dict[int, float] = {}  # the count when a block started: what it adds is its own

    def add(flops: float) -> None:
        out.forward_flops += flops
        if not torch.is_grad_enabled():
            out.frozen_flops += flops

    def linear_hook(module, args, output):
        x = args[0]
        add(2.0 * x.numel() * module.out_features)  # (tokens x in) @ (in x out)
        if id(module) not in in_block and torch.is_grad_enabled():
            out.other_values += output.numel()

    def conv_hook(module, args, output):
        k = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
        add(2.0 * output.numel() * k)
        if id(module) not in in_block and torch.is_grad_enabled():
            out.other_values += output.numel()

    def attention_pre_hook(module, args, kwargs):
        x = args[0]
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        rpe = module.rpe is not None
        B, T, D = x.shape
        add(4.0 * B * T * T * D)
        pending[id(module)] = (mask, rpe)

    def block_pre_hook(module, args):
        flops_before[id(module)] = out.forward_flops

    def block_hook(module, args, output):
        B, T, D = args[0].shape
        mask, rpe = pending.pop(id(module.attn), (None, False))
        out.blocks.append(BlockCall(B, T, D, module.mlp.fc1.out_features, module.attn.num_heads,
                                    _kept_matrix_bytes(module.attn, mask, rpe, fused_kernels, value_bytes),
                                    id(module) in checkpointed, names[id(module)],
                                    out.forward_flops - flops_before.pop(id(module)), _attention_kind(mask, rpe),
                                    module.attn.backend, torch.is_grad_enabled()))

    handles = []
    for m in objective.modules():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(linear_hook))
        elif isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, Attention):
            handles.append(m.register_forward_pre_hook(attention_pre_hook, with_kwargs=True))
        elif isinstance(m, Block):
            handles.append(m.register_forward_pre_hook(block_pre_hook))
            handles.append(m.register_forward_hook(block_hook))
    try:
        objective(batch)
    finally:
        for h in handles:
            h.remove()
    return out


def example_batch(data_cfg, micro: int, img_size: int, in_chans: int, device="meta") -> dict[str, torch.Tensor]:
    """A batch shaped like the training stream's (multi-crop: (B, k, C, S, S))."""
    crops = (data_cfg.num_crops,) if data_cfg.train_transform == "multicrop" else ()
    return {"image": torch.zeros(micro, *crops, in_chans, img_size, img_size, device=device),
            "label": torch.zeros(micro, dtype=torch.long, device=device)}


def profile_config(cfg: PretrainConfig, ds_config: dict, micro: int, fused_kernels: bool, value_bytes: int = 2):
    """(the configured objective built on the meta device with the ds_config's activation
    checkpointing, the profile of one micro-batch: FLOPs and activations from its token counts)."""
    with torch.device("meta"):
        objective = build_objective(cfg.objective, build_encoder(cfg), section(cfg))
        apply_execution_options(objective, activation_checkpointing(ds_config), compile_blocks=False)
        batch = example_batch(cfg.data, micro, encoder_img_size(cfg), cfg.model.in_chans)
        return objective, profile(objective, batch, fused_kernels, value_bytes)


def attention_shapes(prof: Profile) -> list[tuple[int, int, int]]:
    """The distinct (heads, tokens, head dim) of the blocks' attention in a profile, sorted."""
    return sorted({(c.heads, c.tokens, c.dim // c.heads) for c in prof.blocks})


def attention_calls(prof: Profile) -> list[tuple[int, int, int, str, str]]:
    """The distinct (heads, tokens, head dim, kind, backend) of the blocks' attention, sorted: what
    decides the kernel a call runs (BlockCall.attention, .backend)."""
    return sorted({(c.heads, c.tokens, c.dim // c.heads, c.attention, c.backend) for c in prof.blocks})
