"""Supervised fine-tuning (MAE protocol: He et al. 2022, arXiv:2111.06377, appendix A.1): the whole
encoder trains with a fresh Linear head on the pooled feature (configure model.global_pool avg for
MAE's patch mean + fc_norm); mixup / cutmix with label smoothing through timm's Mixup and SoftTargetCrossEntropy,
plain label-smoothed cross-entropy when both are off.

`pos_embed` trains, as in the official recipe (its models_vit keeps timm's learnable table,
initialised from the pretrained one; util/lr_decay.py gives it layer id 0 and no weight decay):
the ViT creates the sin-cos table frozen for pretraining, so this objective unfreezes it. The
parameter groups (train/engine/optim.py) then give it lr scale layer_decay^(depth + 1) and no decay,
through the encoder's no_weight_decay()."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model.objectives.base import ClassifierConfig, Objective, register_objective
from model.vit import VisionTransformer


@dataclass
class FinetuneConfig(ClassifierConfig):
    mixup: float = field(default=0.8, metadata={"range": "[0, inf)"})  # mixup alpha (0 = off)
    cutmix: float = field(default=1.0, metadata={"range": "[0, inf)"})  # cutmix alpha (0 = off)
    smoothing: float = field(default=0.1, metadata={"range": "[0, 1)"})  # label smoothing

    def check_fits(self, img_size: int, patch_size: int, depth: int, micro_batch: int) -> None:
        if (self.mixup > 0 or self.cutmix > 0) and micro_batch % 2:  # timm's Mixup pairs each image with its mirror
            raise ValueError(f"finetune.mixup / finetune.cutmix need an even micro-batch, the ds_config gives "
                             f"{micro_batch}: give an even train_micro_batch_size_per_gpu, or --finetune.mixup 0 "
                             f"--finetune.cutmix 0")


@register_objective("finetune", FinetuneConfig)
class FinetuneObjective(Objective):
    def __init__(self, encoder: VisionTransformer, cfg: FinetuneConfig):
        cfg.validate()
        super().__init__(encoder, cfg)
        if isinstance(encoder, VisionTransformer):  # timm backbones' own tables already train
            encoder.pos_embed.requires_grad_(True)  # (1, 1+N, D), starts from the loaded / sin-cos table
        encoder.reset_head(cfg.num_classes)
        nn.init.trunc_normal_(encoder.head.weight, std=2e-5)  # MAE's head init for fine-tuning
        nn.init.zeros_(encoder.head.bias)
        # timm (with the torchvision it imports) loads here, where a fine-tuning run builds its
        # objective, not where every command line is parsed (model/objectives imports every method)
        from timm.data import Mixup
        from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

        self.mixup = None
        if cfg.mixup > 0 or cfg.cutmix > 0:  # timm draws lam / boxes from numpy's global RNG (checkpointed)
            self.mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.smoothing,
                               num_classes=cfg.num_classes)
        self.soft_ce = SoftTargetCrossEntropy()
        self.smooth_ce = LabelSmoothingCrossEntropy(cfg.smoothing) if cfg.smoothing > 0 else nn.CrossEntropyLoss()

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> logits (B, num_classes)."""
        return self.encoder(images)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, labels = batch["image"], batch["label"]
        if self.training and self.mixup is not None:
            if len(images) % 2:
                raise ValueError(f"mixup / cutmix need an even micro-batch, got {len(images)}")
            images, soft = self.mixup(images, labels)  # soft (B, num_classes), smoothing included
            return {"loss": self.soft_ce(self.predict(images).float(), soft)}
        return {"loss": self.smooth_ce(self.predict(images).float(), labels)}
