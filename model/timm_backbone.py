"""Any timm model as a pretraining backbone (e.g. ConvNeXt, Swin for energy-based pretraining,
the paper's Table B): `create_model("timm/convnext_atto", img_size=32, in_chans=3)`.

The adapter adopts the timm model's top-level children and parameters as its own, so its
state_dict carries exactly timm's names: an exported backbone loads into
`timm.create_model(name, num_classes=0)` with no missing or unexpected keys. It offers what the
entry points read from an encoder (img_size, embed_dim, num_patches, timm_kwargs) and
`pooled_features(x)`, the model's pooled pre-logits features (B, num_features).

Attention: timm's attention modules pick, when built, between torch's fused SDPA and the explicit
softmax(q k^T / sqrt(d)) v (each module's `fused_attn` flag, from timm.layers.use_fused_attn()).
SDPA's fused kernels have no double backward, so `attn_backend="math"` (the twice-differentiable
backend that energy pretraining asks for) sets every module's flag off; any other backend keeps
timm's choice.

LayerNorm: the model's LayerNorms (timm's LayerNorm and LayerNorm2d, nn.LayerNorm) take
model/layer_norm.py's fp32 path for 16-bit inputs on the CPU, as our ViT's do.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.attention import TWICE_DIFFERENTIABLE
from model.layer_norm import normalise_in_fp32_on_cpu

TIMM_PREFIX = "timm/"


def is_timm_name(name: str) -> bool:
    if not name.startswith(TIMM_PREFIX):
        return False
    import timm

    return timm.is_model(name[len(TIMM_PREFIX):])


class TimmBackbone(nn.Module):
    num_patches = 0  # not a patch-token model: no MAE-style masking, no attention maps

    def __init__(self, name: str, img_size: int = 224, in_chans: int = 3, drop_path_rate: float = 0.0,
                 rpe: bool = False, attn_backend: str = "auto", **_vit_only):
        super().__init__()
        import timm

        if rpe:
            raise ValueError(f"rpe (iRPE) is a ViT option; timm model {name!r} has none")
        kwargs = dict(pretrained=False, num_classes=0, in_chans=in_chans)
        if drop_path_rate:  # models without stochastic depth (VGG, DenseNet) refuse the argument, even at 0
            kwargs["drop_path_rate"] = drop_path_rate
        try:  # resolution-dependent models (Swin, timm ViTs) take img_size; convolutional ones do not
            model = timm.create_model(name, img_size=img_size, **kwargs)
        except TypeError:
            try:
                model = timm.create_model(name, **kwargs)
            except TypeError as e:
                if "drop_path_rate" not in str(e):
                    raise
                raise ValueError(f"timm model {name!r} has no stochastic depth: set model.drop_path_rate 0") from None
        if attn_backend == TWICE_DIFFERENTIABLE:
            for module in model.modules():
                if hasattr(module, "fused_attn"):
                    module.fused_attn = False
        normalise_in_fp32_on_cpu(model)  # its LayerNorms' 16-bit CPU backward sums in fp32 (model/layer_norm.py)
        if any(True for _ in model.named_buffers(recurse=False)):
            raise ValueError(f"timm model {name!r} has top-level buffers, which this adapter cannot share")
        self.__dict__["inner"] = model  # not a submodule: its children are adopted below
        for child_name, child in model.named_children():
            self.add_module(child_name, child)
        for param_name, param in model.named_parameters(recurse=False):
            self.register_parameter(param_name, param)
        self.name, self.img_size, self.in_chans = name, img_size, in_chans
        # what pooled_features returns: the pre-logits width, which differs from num_features where a
        # pre-logits layer widens it (VGG, MobileNetV3, EfficientViT)
        self.embed_dim = getattr(model, "head_hidden_size", None) or model.num_features

    @property
    def patch_size(self) -> int:
        """The side of a patch-embedding model's patches (timm ViTs, Swin), else 0: its patch
        embedding floors the grid, so an image size off the grid loses its border pixels."""
        size = getattr(getattr(self, "patch_embed", None), "patch_size", 0)
        return max(size) if isinstance(size, (tuple, list)) else int(size or 0)

    def attention_modules(self) -> dict[str, bool]:
        """{module name: uses fused SDPA} for every timm attention module (empty for ConvNets)."""
        return {name: bool(m.fused_attn) for name, m in self.inner.named_modules() if hasattr(m, "fused_attn")}

    @property
    def attn_backend(self) -> str:
        """The attention backend in the dispatch's terms: sdpa if any module calls fused SDPA,
        else math (explicit attention, or none at all), which is twice differentiable."""
        return "sdpa" if any(self.attention_modules().values()) else TWICE_DIFFERENTIABLE

    def describe_attention(self) -> str:
        """One line for the run's log and meta.json."""
        modules = self.attention_modules()
        if not modules:
            return f"timm {self.name}: no attention modules"
        fused = self.attn_backend == "sdpa"
        path = "torch SDPA (fused)" if fused else "explicit softmax(q k^T) v (twice differentiable)"
        return f"timm {self.name}: {path} in {len(modules)} modules"

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.inner.set_grad_checkpointing(enable)

    def _apply(self, fn, recurse=True):  # .to() / .half(): top-level params of the inner model stay shared
        super()._apply(fn, recurse)
        for param_name, param in list(self._parameters.items()):
            setattr(self.inner, param_name, param)
        return self

    def pooled_features(self, x: torch.Tensor, pool: str = "avg") -> torch.Tensor:
        """(B, C, H, W) -> (B, num_features): timm's pooled pre-logits features (the model's own
        pooling; `pool` is accepted for the ViT's signature and ignored)."""
        return self.inner(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pooled_features(x)

    def no_weight_decay(self) -> set[str]:
        nwd = getattr(self.inner, "no_weight_decay", None)
        return set(nwd()) if nwd is not None else set()

    def timm_kwargs(self) -> dict:
        return {"timm_model": self.name, "img_size": self.img_size, "in_chans": self.in_chans, "num_classes": 0}
