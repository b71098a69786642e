from kernels.attention import (
           BACKENDS,
           AttentionMask,
           attention,
           math_attention,
           resolve_backend,
)
from kernels.masked import GLOBAL, SegmentMask, TopKMask

__all__ = ["BACKENDS", "GLOBAL", "AttentionMask", "SegmentMask", "TopKMask", "attention", "math_attention",
           "resolve_backend"]
