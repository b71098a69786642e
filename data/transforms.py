"""Image transforms with explicit per-sample seeds (no hidden global RNG state).

Pretraining: RandomResizedCrop(size, scale (0.2, 1), bicubic) + horizontal flip (MAE).
Evaluation: resize the shorter side to size / crop_pct, then center-crop `size`.
Both convert to 3-channel RGB (grayscale is replicated) and normalise with the ImageNet
mean/std. torchvision draws crop parameters from the global torch RNG, so the draw happens
inside `fork_rng` with a seed derived from (seed, epoch, rank, worker, sample index): the same
sample position always gets the same crop, in any process, and the caller's RNG is untouched.
"""
from __future__ import annotations

import random

import numpy as np
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torchvision.transforms import InterpolationMode, RandomResizedCrop

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def to_normalized_tensor(img: Image.Image) -> torch.Tensor:
    """PIL (any mode) -> (3, H, W) float, ImageNet-normalised."""
    x = TF.pil_to_tensor(img.convert("RGB")).float() / 255.0
    return TF.normalize(x, IMAGENET_MEAN, IMAGENET_STD)


class PretrainTransform:
    def __init__(self, size: int, scale: tuple[float, float] = (0.2, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = size, list(scale), list(ratio)

    def __call__(self, img: Image.Image, seed: int) -> torch.Tensor:
        img = img.convert("RGB")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            i, j, h, w = RandomResizedCrop.get_params(img, self.scale, self.ratio)
            flip = bool(torch.rand(()) < 0.5)
        img = TF.resized_crop(img, i, j, h, w, [self.size, self.size], InterpolationMode.BICUBIC, antialias=True)
        if flip:
            img = TF.hflip(img)
        return to_normalized_tensor(img)


class MultiCropTransform:
    """MAE+ multi-crop tokenization (METHODS.md section 2): `num_crops` independent
    RandomResizedCrop(size, scale (0.08, 1), bicubic) + flip views of one image -> (k, 3, size, size).
    Crop c of a sample uses its own seed derived from (sample seed, c)."""

    def __init__(self, size: int, num_crops: int = 4, scale: tuple[float, float] = (0.08, 1.0)):
        if num_crops < 1:
            raise ValueError(f"num_crops must be >= 1, got {num_crops}")
        self.num_crops = num_crops
        self.crop = PretrainTransform(size, scale)

    def __call__(self, img: Image.Image, seed: int) -> torch.Tensor:
        return torch.stack([self.crop(img, (seed * 1_000_003 + c) % 2**63) for c in range(self.num_crops)])


class EvalTransform:
    def __init__(self, size: int, crop_pct: float = 0.875):
        self.size, self.resize = size, int(round(size / crop_pct))

    def __call__(self, img: Image.Image, seed: int = 0) -> torch.Tensor:
        img = TF.resize(img.convert("RGB"), self.resize, InterpolationMode.BICUBIC, antialias=True)
        return to_normalized_tensor(TF.center_crop(img, [self.size, self.size]))


class RandAugTransform:
    """MAE fine-tuning augmentation through timm: RandomResizedCrop (bicubic) + flip, RandAugment,
    normalisation, random erasing. timm draws from python's, numpy's and torch's global RNGs, so
    all three are seeded per sample and restored afterwards."""

    def __init__(self, size: int, scale: tuple[float, float] = (0.08, 1.0), policy: str = "rand-m9-mstd0.5-inc1",
                 reprob: float = 0.25):
        from timm.data import create_transform

        self.transform = create_transform(size, is_training=True, scale=scale, auto_augment=policy,
                                          interpolation="bicubic", re_prob=reprob, re_mode="pixel", re_count=1,
                                          mean=IMAGENET_MEAN, std=IMAGENET_STD)

    def __call__(self, img: Image.Image, seed: int) -> torch.Tensor:
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                random.seed(seed)
                np.random.seed(seed % 2**32)
                torch.manual_seed(seed)
                return self.transform(img.convert("RGB"))
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
