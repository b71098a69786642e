"""The ImageNet statistics images are normalised with, and host values (Python numbers) as device
tensors, made once per device and dtype.

`torch.tensor(values, device=cuda)` copies from pageable host memory and waits for the device's
stream to reach the copy: a host-device sync wherever it runs inside a training step. Here the
copy is made once, from pinned memory without waiting, and the tensor is kept for every later call.
"""
from __future__ import annotations

import functools

import torch

# timm's IMAGENET_DEFAULT_MEAN / _STD, which the data pipeline normalises with (data/transforms.py),
# written out: importing timm loads every timm model and torchvision, seconds of start-up for each
# command line, and model/ builds every method's objective class to parse one (the test pins them)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@functools.lru_cache(maxsize=None)
def device_constant(values: tuple[float, ...] | tuple[int, ...], device: torch.device,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` as a 1-D tensor on `device` (never write into it: it is shared by every caller)."""
    with torch.inference_mode(False):  # a normal tensor even when first made under inference mode
        host = torch.tensor(values, dtype=dtype)
        if device.type == "cuda":
            host = host.pin_memory()
        return host.to(device, non_blocking=True)
