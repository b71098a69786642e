"""How long a benchmark would take on this CPU, from its FLOP count (train/estimate/costs.py), said before it
starts; one sized for a GPU (longer than CPU_LIMIT_S) is refused unless asked for (--allow_cpu).

The estimate divides the matmul FLOPs by the rate this CPU reaches on one large fp32 matmul,
measured here in a fraction of a second: the fastest the work could go, so the time said is a
lower bound (norms, softmax, data loading and the optimizer come on top).
"""
from __future__ import annotations

import time

import torch

from data.progress import seconds
from train.config.errors import ConfigError

CPU_LIMIT_S = 300.0  # longer than this on a CPU: sized for a GPU
MATMUL_SIZE = 1024


def matmul_flops_per_s(size: int = MATMUL_SIZE, repeats: int = 3) -> float:
    """This CPU's fp32 matmul rate (FLOP/s), best of `repeats` products of two size x size matrices."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # the first call pays for thread start-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def check_cpu_time(flops: float, what: str, allow: bool, smaller: str) -> float:
    """Say how long `flops` of matmuls take at least on this CPU; ConfigError when that exceeds
    CPU_LIMIT_S and `allow` is False (naming a GPU, `smaller` and --allow_cpu). Returns the seconds."""
    rate = matmul_flops_per_s()
    least = flops / rate
    said = (f"{what}: {flops / 1e12:.3g} TFLOP of matmuls; this CPU multiplies at {rate / 1e9:.0f} GFLOP/s, so at "
            f"least {seconds(least)}")
    if least > CPU_LIMIT_S and not allow:
        raise ConfigError(f"{said}: it is sized for a GPU; run it on one, {smaller}, or pass --allow_cpu to run it "
                          f"here anyway")
    print(said, flush=True)
    return least
