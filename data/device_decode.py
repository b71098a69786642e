"""JPEG decoding on the training device (`data.decode nvjpeg`).

The workers read only each JPEG's header, draw the RandomResizedCrop + flip (the same seeded draw
as the CPU path) and ship the encoded bytes; the main process decodes the whole batch with one
`torchvision.io.decode_jpeg(list, device=...)` call (nvJPEG on CUDA; libjpeg on CPU, which the
tests use), then crops and resizes (bicubic, antialiased) each image on the device and flips the
batch's flipped crops in one select. Images that are not plain RGB / grayscale JPEGs (PNG, CMYK JPEG) are decoded and cropped by the
worker on the CPU and travel as uint8 crops. A JPEG the device cannot decode is retried alone,
then decoded on the CPU; if that fails too it is counted as undecodable and replaced by another
image of the batch, so the batch keeps its size.
"""
from __future__ import annotations

import io

import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F2

from data.transforms import Crop, PretrainTransform, decode_rgb


class EncodedCropTransform:
    """Worker side: {"jpeg": (n,) uint8 bytes, "crop": (5,) i, j, h, w, flip} for a JPEG the device
    decodes, else the uint8 (3, S, S) crop made here."""

    takes_bytes = True  # ShardStream passes the encoded bytes as a third argument
    device_decode = True  # ShardLoader decodes the batch on the device (DeviceDecoder)

    def __init__(self, size: int, scale: tuple[float, float] = (0.2, 1.0)):
        self.crop = PretrainTransform(size, scale)

    def __call__(self, img: Image.Image, seed: int, data: bytes):
        crop = self.crop.crop_params(img, seed)
        if img.format == "JPEG" and img.mode in ("RGB", "L"):
            c = torch.tensor([crop.i, crop.j, crop.h, crop.w, int(crop.flip)])
            return {"jpeg": torch.frombuffer(bytearray(data), dtype=torch.uint8), "crop": c}
        return self.crop.apply(decode_rgb(img, data), crop)


class DeviceDecoder:
    """Main-process side: a collate that keeps the variable-length JPEGs as a list, and the batch
    decode + crop on `device`. `failed` counts images no decoder could read."""

    def __init__(self, size: int, device: torch.device):
        self.size, self.device = size, torch.device(device)
        self.failed = 0

    @staticmethod
    def collate(samples: list[dict]) -> dict:
        images = [s["image"] for s in samples]
        rest = default_collate([{k: v for k, v in s.items() if k != "image"} for s in samples])
        return {**rest, "image": images}

    def _decode(self, jpegs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """(3, H, W) uint8 per JPEG on the device; None where neither the device nor PIL can decode it."""
        try:
            return list(decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=self.device))
        except RuntimeError:  # one bad file fails the batch call: find it
            out: list[torch.Tensor | None] = []
            for data in jpegs:
                try:
                    out.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device))
                except RuntimeError:
                    try:
                        out.append(decode_rgb(Image.open(io.BytesIO(data.numpy().tobytes()))).to(self.device))
                    except (OSError, ValueError, SyntaxError):
                        out.append(None)
            return out

    def resized(self, img: torch.Tensor, crop: Crop) -> torch.Tensor:
        """(3, H, W) uint8 -> (3, S, S) uint8, not flipped: the same resize as the CPU path
        (antialiased bicubic). One launch per image: crop sizes differ."""
        return F2.resize(img[:, crop.i:crop.i + crop.h, crop.j:crop.j + crop.w], [self.size, self.size],
                         interpolation=InterpolationMode.BICUBIC, antialias=True)

    def __call__(self, images: list) -> torch.Tensor:
        """The collated list -> (B, 3, S, S) uint8 on the device. The crops are stacked in one
        launch and flipped in two for the whole batch (a flip and a select on a flag vector
        copied from pinned memory), not one copy and one flip per image."""
        encoded = [k for k, x in enumerate(images) if isinstance(x, dict)]
        decoded = dict(zip(encoded, self._decode([images[k]["jpeg"] for k in encoded]) if encoded else []))
        crops: list[torch.Tensor | None] = []
        flips = [False] * len(images)
        for k, x in enumerate(images):
            if not isinstance(x, dict):  # cropped (and flipped) by the worker
                crops.append(x.to(self.device, non_blocking=True))
            elif decoded[k] is None:
                crops.append(None)
            else:
                i, j, h, w, flip = x["crop"].tolist()  # a CPU tensor: no device sync
                crops.append(self.resized(decoded[k], Crop(i, j, h, w, False)))
                flips[k] = bool(flip)
        good = [k for k, c in enumerate(crops) if c is not None]
        bad = [k for k, c in enumerate(crops) if c is None]
        if not good:
            raise RuntimeError(f"no image of a batch of {len(images)} could be decoded")
        for n, k in enumerate(bad):  # keep the batch size: stand in another image of the batch
            crops[k], flips[k] = crops[good[n % len(good)]], flips[good[n % len(good)]]
        self.failed += len(bad)
        out = torch.stack(crops)
        if not any(flips):
            return out
        flag = torch.tensor(flips)
        if self.device.type == "cuda":  # a copy from pageable memory would wait for the device
            flag = flag.pin_memory()
        flag = flag.to(self.device, non_blocking=True)
        return torch.where(flag[:, None, None, None], out.flip(-1), out)
