from kernels.attention import BACKENDS, attention, math_attention, resolve_backend

__all__ = ["BACKENDS", "attention", "math_attention", "resolve_backend"]
