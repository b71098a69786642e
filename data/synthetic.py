"""A synthetic image source for benchmarks and tests: no I/O, fully deterministic.

Batch b of rank r is generated from a generator seeded with (seed, b, r), so the stream is a
function of its position alone: `state_dict()` records the position and a resumed run continues
the same sample stream. Images are smooth (low-resolution noise upsampled), so reconstruction
losses can actually decrease, and are normalised with the ImageNet mean/std. They are made
directly on `device`, so throughput measurements see no host-side data cost.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from data.transforms import IMAGENET_MEAN, IMAGENET_STD


def mean_std(in_chans: int) -> tuple[list[float], list[float]]:
    """The input's per-channel normalisation: ImageNet's for RGB (every shard decodes to RGB,
    data/transforms.py), 0.5 / 0.25 for other channel counts (synthetic images only)."""
    if in_chans == 3:
        return list(IMAGENET_MEAN), list(IMAGENET_STD)
    return [0.5] * in_chans, [0.25] * in_chans


class SyntheticImages:
    """`crops` > 0: each sample is `crops` images (B, crops, C, s, s), the multi-crop transform's shape."""

    def __init__(self, batch_size: int, img_size: int, in_chans: int, num_classes: int, seed: int, rank: int,
                 device: torch.device | str = "cpu", crops: int = 0):
        self.batch_size, self.img_size, self.in_chans, self.crops = batch_size, img_size, in_chans, crops
        self.num_classes, self.seed, self.rank = num_classes, seed, rank
        self.device = torch.device(device)
        self.position = 0  # batches produced so far on this rank
        mean, std = map(torch.tensor, mean_std(in_chans))
        self.mean, self.std = mean[:, None, None].to(self.device), std[:, None, None].to(self.device)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        key = np.random.SeedSequence((self.seed, self.position, self.rank)).generate_state(1, dtype=np.uint64)[0]
        gen = torch.Generator(self.device).manual_seed(int(key) & (2**63 - 1))
        self.position += 1
        low = max(2, self.img_size // 4)
        n = self.batch_size * max(1, self.crops)
        coarse = torch.rand(n, self.in_chans, low, low, generator=gen, device=self.device)  # (n, C, s/4, s/4)
        images = (F.interpolate(coarse, size=self.img_size, mode="bilinear", align_corners=False) - self.mean) / self.std
        if self.crops:
            images = images.unflatten(0, (self.batch_size, self.crops))  # (B, crops, C, s, s)
        labels = torch.randint(self.num_classes, (self.batch_size,), generator=gen, device=self.device)
        return {"image": images, "label": labels}

    def state_dict(self) -> dict:
        return {"position": self.position, "rank": self.rank, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])

    def resume_from(self, states: list[dict]) -> None:
        """Every rank's position of a checkpointed run (rank order). A rank the old run did not have
        continues from the furthest position (there is no data set whose order could be kept)."""
        self.load_state_dict(states[self.rank] if self.rank < len(states) else max(states, key=lambda s: s["position"]))
