"""Image transforms with explicit per-sample seeds (no hidden global RNG state).

Pretraining: RandomResizedCrop(size, scale (0.2, 1), bicubic) + horizontal flip (MAE), returned
as uint8 (3, S, S): the training stream ships bytes from the workers (4x less than float32 to
copy and pin) and normalises on the training device (`normalize_uint8`). The crop is drawn with
torchvision's algorithm from a private random.Random seeded by (seed, epoch, rank, worker, sample
index): the same sample position always gets the same crop, in any process, and no global RNG
is touched. Evaluation: resize the shorter side to size / crop_pct, then center-crop `size`,
normalised. All convert to 3-channel 8-bit RGB (data/image_modes.py: grayscale replicated, CMYK
converted, 16-bit grey scaled by >> 8); normalisation uses the ImageNet mean/std.

Decoding (`data.decode`, data/transform_settings.py DECODES) for the pretraining crops:
  cpu        RGB / grayscale JPEGs decoded by libjpeg-turbo straight into a uint8 tensor
             (torchvision.io.decode_jpeg; other images through PIL), the crop resized on the
             tensor (antialiased bicubic);
  cpu_draft  let libjpeg decode at 1/2, 1/4 or 1/8 scale when every crop of the image still has
             at least `size` pixels per side at that scale (DCT-domain downscaling; PIL's
             `Image.draft`), then crop and resize the smaller image; the crop covers the same
             region of the picture, only the resampling differs slightly from `cpu`;
  nvjpeg     the workers only read the header and draw the crop; the JPEG bytes go to the
             training device, where torchvision.io.decode_jpeg decodes the batch (nvJPEG on
             CUDA) and each crop is resized there (data/device_decode.py).
Transforms take (lazily opened PIL image, seed), plus the encoded bytes when they declare
`takes_bytes` (the bytes let libjpeg decode without PIL's copy).
"""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from timm.data.constants import IMAGENET_DEFAULT_MEAN as IMAGENET_MEAN  # one copy, shared with model/
from timm.data.constants import IMAGENET_DEFAULT_STD as IMAGENET_STD
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F2

from data.image_modes import to_rgb

try:  # deprecated in torchvision 0.29 in favour of TorchCodec; PIL decodes when it is gone
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # pragma: no cover
    decode_jpeg = None

def to_normalized_tensor(img: Image.Image) -> torch.Tensor:
    """PIL (any mode) -> (3, H, W) float, ImageNet-normalised."""
    x = TF.pil_to_tensor(to_rgb(img)).float() / 255.0
    return TF.normalize(x, IMAGENET_MEAN, IMAGENET_STD)


@functools.lru_cache(maxsize=None)
def _mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, 1, 1) constants, made once per device: a fresh host-to-GPU copy every step would wait
    for the GPU."""
    return (torch.tensor(IMAGENET_MEAN, device=device)[:, None, None],
            torch.tensor(IMAGENET_STD, device=device)[:, None, None])


def normalize_uint8(images: torch.Tensor) -> torch.Tensor:
    """(..., 3, H, W) uint8 -> float32 ImageNet-normalised, on the tensor's device. The same
    arithmetic as `to_normalized_tensor`, so moving it off the workers changes no value."""
    mean, std = _mean_std(images.device)
    return (images.float() / 255.0 - mean) / std


@dataclass(frozen=True)
class Crop:
    """A RandomResizedCrop draw in the original image's pixels: rows i..i+h, columns j..j+w."""
    i: int
    j: int
    h: int
    w: int
    flip: bool


def draft_for_crops(img: Image.Image, crops: list[Crop], size: int) -> float:
    """Ask libjpeg for the smallest power-of-2 reduction that leaves every crop >= `size` px per
    side; returns the reduction (1.0 = none). Must run before the image is loaded."""
    if img.format != "JPEG":
        return 1.0
    shortest = min(min(c.h, c.w) for c in crops)
    if shortest < 2 * size:  # no 1/2 reduction keeps the crop at full resolution
        return 1.0
    width, height = img.size
    reduction = shortest / size
    _, box = img.draft("RGB", (int(np.ceil(width / reduction)), int(np.ceil(height / reduction))))
    return width / box[2] if box is not None else 1.0  # box = the whole picture in reduced pixels


def decode_rgb(img: Image.Image, data: bytes | None = None) -> torch.Tensor:
    """(3, H, W) uint8 pixels of a lazily opened image (decoding it). RGB / grayscale JPEGs go
    to libjpeg-turbo through torchvision (no PIL image and copy in between: ~0.3 ms less per
    ImageNet-sized image); anything else, or a drafted image, through PIL. A JPEG libjpeg-turbo
    refuses (RuntimeError: truncated, damaged scan data) goes to PIL too, as data.write_shards
    judged it: PIL decodes it, or raises the OSError the readers count as an undecodable image."""
    if data is not None and img.format == "JPEG" and img.mode in ("RGB", "L") and decode_jpeg is not None:
        try:
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError:
            pass
    return TF.pil_to_tensor(to_rgb(img))


class PretrainTransform:
    takes_bytes = True  # ShardStream passes the encoded bytes as a third argument

    def __init__(self, size: int, scale: tuple[float, float] = (0.2, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                 decode: str = "cpu"):
        if decode not in ("cpu", "cpu_draft"):
            raise ValueError(f"PretrainTransform decodes with cpu or cpu_draft, got {decode!r} (nvjpeg: "
                             f"data.device_decode.EncodedCropTransform)")
        self.size, self.scale, self.ratio, self.draft = size, list(scale), list(ratio), decode == "cpu_draft"

    def crop_params(self, img: Image.Image, seed: int) -> Crop:
        """torchvision's RandomResizedCrop draw (10 tries, then the central crop of the allowed
        aspect ratio) from a private random.Random(seed): no global RNG is touched, ~15x cheaper
        than seeding torch per sample. Only the image's size is read (a lazy file stays undecoded)."""
        rng = random.Random(seed)
        width, height = img.size
        area, log_ratio = width * height, (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                return Crop(rng.randint(0, height - h), rng.randint(0, width - w), h, w, rng.random() < 0.5)
        if width / height < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif width / height > self.ratio[1]:
            w, h = round(height * self.ratio[1]), height
        else:
            w, h = width, height
        return Crop((height - h) // 2, (width - w) // 2, h, w, rng.random() < 0.5)

    def apply(self, pixels: torch.Tensor, crop: Crop, reduction: float = 1.0) -> torch.Tensor:
        """The crop (in original pixels) of (3, H, W) uint8 `pixels`, which libjpeg may have
        decoded `reduction` x smaller, as (3, S, S) uint8. The resize runs on the uint8 tensor
        (torchvision's antialiased bicubic, PIL's kernel: within 1 level of PIL's own resize,
        ~2.5x faster)."""
        i, j, h, w = crop.i, crop.j, crop.h, crop.w
        if reduction != 1.0:  # the same region in the reduced image's pixels (rounded)
            i, j = round(i / reduction), round(j / reduction)
            h, w = max(1, round(h / reduction)), max(1, round(w / reduction))
        out = F2.resize(pixels[:, i:i + h, j:j + w], [self.size, self.size],
                        interpolation=InterpolationMode.BICUBIC, antialias=True)
        return (out.flip(-1) if crop.flip else out).contiguous()

    def decode(self, img: Image.Image, crops: list[Crop], data: bytes | None) -> tuple[torch.Tensor, float]:
        """(pixels, reduction): decoded at the reduction every crop allows with cpu_draft."""
        reduction = draft_for_crops(img, crops, self.size) if self.draft else 1.0
        return decode_rgb(img, data if reduction == 1.0 else None), reduction

    def __call__(self, img: Image.Image, seed: int, data: bytes | None = None) -> torch.Tensor:
        crop = self.crop_params(img, seed)
        pixels, reduction = self.decode(img, [crop], data)
        return self.apply(pixels, crop, reduction)


class MultiCropTransform:
    """MAE+ multi-crop tokenization (AdPE, Wang et al. 2023, arXiv:2303.07598, section 3.2): `num_crops` independent
    RandomResizedCrop(size, scale (0.08, 1), bicubic) + flip views of one image -> (k, 3, size, size)
    uint8. Crop c of a sample uses its own seed derived from (sample seed, c); the image is decoded
    once (with cpu_draft, at the reduction the smallest crop allows)."""

    takes_bytes = True

    def __init__(self, size: int, num_crops: int = 4, scale: tuple[float, float] = (0.08, 1.0), decode: str = "cpu"):
        if num_crops < 1:
            raise ValueError(f"num_crops must be >= 1, got {num_crops}")
        self.num_crops = num_crops
        self.crop = PretrainTransform(size, scale, decode=decode)

    def __call__(self, img: Image.Image, seed: int, data: bytes | None = None) -> torch.Tensor:
        crops = [self.crop.crop_params(img, (seed * 1_000_003 + c) % 2**63) for c in range(self.num_crops)]
        pixels, reduction = self.crop.decode(img, crops, data)
        return torch.stack([self.crop.apply(pixels, c, reduction) for c in crops])


class EvalTransform:
    def __init__(self, size: int, crop_pct: float = 0.875):
        self.size, self.resize = size, int(round(size / crop_pct))

    def __call__(self, img: Image.Image, seed: int = 0) -> torch.Tensor:
        img = TF.resize(to_rgb(img), self.resize, InterpolationMode.BICUBIC, antialias=True)
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
                return self.transform(to_rgb(img))
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
