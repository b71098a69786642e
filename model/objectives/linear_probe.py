"""Linear probe (MAE protocol: He et al. 2022, arXiv:2111.06377, appendix A.1): frozen encoder, cls feature,
BatchNorm1d without affine (eps 1e-6) then a Linear head (trunc-normal std 0.01, zero bias),
cross-entropy. Only the head trains; the encoder runs without autograd."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.objectives.base import ClassifierConfig, Objective, register_objective
from model.vit import VisionTransformer


@dataclass
class LinearProbeConfig(ClassifierConfig):
    pool: str = "cls"  # cls | avg (mean of patch tokens)

    def validate(self) -> None:
        super().validate()
        if self.pool not in ("cls", "avg"):
            raise ValueError(f"linprobe.pool must be cls or avg, got {self.pool!r}")


@register_objective("linprobe", LinearProbeConfig)
class LinearProbeObjective(Objective):
    def __init__(self, encoder: VisionTransformer, cfg: LinearProbeConfig):
        cfg.validate()
        super().__init__(encoder.requires_grad_(False), cfg)
        self.head = nn.Sequential(nn.BatchNorm1d(encoder.embed_dim, affine=False, eps=1e-6),
                                  nn.Linear(encoder.embed_dim, cfg.num_classes))
        nn.init.trunc_normal_(self.head[1].weight, std=0.01)
        nn.init.zeros_(self.head[1].bias)

    def train(self, mode: bool = True):
        super().train(mode)
        self.encoder.eval()  # frozen features: no dropout / drop path in the encoder
        return self

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, D) in the head's dtype (the engine's compute dtype: fp32 or fp16): the
        cls token or the patch mean after the final norm; an avg-pooled encoder (model.global_pool
        avg: no final norm) normalises the mean with its fc_norm, as the official --global_pool probe."""
        with torch.no_grad():
            pooled = self.encoder.pooled_features(images, "avg" if self.cfg.pool == "avg" else "cls")  # (B, D)
        return pooled.to(self.head[1].weight.dtype)

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> logits (B, num_classes)."""
        return self.head(self.features(images))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = self.predict(batch["image"])
        loss = F.cross_entropy(logits.float(), batch["label"])  # fp32: fp16's loss scale (2**16) is inf in fp16
        acc = (logits.argmax(1) == batch["label"]).float().mean() * 100
        return {"loss": loss, "train_top1": acc.detach()}
