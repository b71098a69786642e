"""LayerNorm whose bf16 / fp16 backward on the CPU sums the weight and bias gradients in fp32, as
CUDA's kernel does. PyTorch's CPU backward sums them over the (batch x tokens) rows in the input's
16-bit dtype, which drifts as rows grow: in bf16 more than 10% off at 20,000 rows
(tests/model/test_layer_norm.py). BatchNorm's and GroupNorm's CPU backwards sum in fp32 already.

`LayerNorm` is what our ViT and MAE decoder normalise with; `normalise_in_fp32_on_cpu(model)` gives
another library's model (a timm ConvNeXt's LayerNorm2d, a Swin's nn.LayerNorm) the same path.
Inside `norms_as_on_cuda()` both take nn.LayerNorm's own path on the CPU too: tools/census.py
counts on the CPU the kernels a CUDA step launches.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import cache
from typing import Iterator

import torch
from torch import nn

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters, state-dict keys and CUDA path), except that a bf16 / fp16
    input on the CPU is normalised in fp32 and cast back."""

    cpu_in_fp32 = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not in_fp32(x):
            return super().forward(x)
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


def in_fp32(x: torch.Tensor) -> bool:
    """Whether a norm normalises `x` in fp32 rather than with nn.LayerNorm's own kernel."""
    return LayerNorm.cpu_in_fp32 and x.device.type == "cpu" and x.dtype in SIXTEEN_BIT


class InFp32OnCpu:
    """Mixed into another library's LayerNorm class by `normalise_in_fp32_on_cpu`: the class's own
    forward (timm's LayerNorm2d permutes NCHW around F.layer_norm) runs on the input and the
    module's parameters widened to fp32, and its output is cast back; gradients reach the 16-bit
    parameters through the widening. Off the CPU or in fp32, the class's forward as it was."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not in_fp32(x):
            return super().forward(x)
        widened = {name: p.float() for name, p in self.named_parameters(recurse=False)}
        # the call re-enters this forward with an fp32 input, which takes the branch above
        return torch.func.functional_call(self, widened, (x.float(),)).to(x.dtype)


@cache
def in_fp32_on_cpu(cls: type[nn.LayerNorm]) -> type[nn.LayerNorm]:
    """`cls` with InFp32OnCpu mixed in, under the same name (a model's repr is unchanged)."""
    return type(cls.__name__, (InFp32OnCpu, cls), {"__module__": __name__,
                                                   "__qualname__": f"in_fp32_on_cpu({cls.__qualname__})"})


def normalise_in_fp32_on_cpu(model: nn.Module) -> nn.Module:
    """Every nn.LayerNorm in `model` (subclasses included) takes the fp32 path on the CPU; their
    parameters, state-dict keys and `isinstance` stay as they were. Returns `model`."""
    for module in model.modules():
        if isinstance(module, nn.LayerNorm) and not isinstance(module, (LayerNorm, InFp32OnCpu)):
            module.__class__ = in_fp32_on_cpu(type(module))
    return model


@contextmanager
def norms_as_on_cuda() -> Iterator[None]:
    """Every LayerNorm takes nn.LayerNorm's own path on the CPU too, until the block ends."""
    LayerNorm.cpu_in_fp32 = False
    try:
        yield
    finally:
        LayerNorm.cpu_in_fp32 = True
