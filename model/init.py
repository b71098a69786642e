"""The MAE initialisation (MAE, He et al. 2022, arXiv:2111.06377, appendix A.1).

xavier_uniform for every Linear and for the patch-embedding conv viewed as a 2-D matrix, zero
biases, LayerNorm (1, 0). Tokens (cls, mask) are drawn N(0, 0.02) by the modules that own them.
One bias differs from the official code: it leaves the patch-embedding conv's bias at PyTorch's
default (uniform within 1/sqrt(fan_in)); here it is zero like every other (docs/methods/MAE.md).
"""
from __future__ import annotations

from torch import nn


def mae_init_(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Conv2d):
            # Same fan-in/fan-out as the equivalent Linear on flattened patches.
            nn.init.xavier_uniform_(m.weight.view(m.weight.shape[0], -1))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
