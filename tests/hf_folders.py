"""transformers ViT / ViT-MAE folders at the debug preset's sizes (vit_debug_patch4: 28 px, 1
channel, patch 4, 32 wide, 2 blocks, 2 heads; MAE decoder 32 wide, 1 block, 2 heads), made from
config objects with random weights: nothing is downloaded."""
from __future__ import annotations

from pathlib import Path

import torch

from model.hf_interop import Split, from_transformers

DEBUG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=28,
             patch_size=4, num_channels=1, layer_norm_eps=1e-6)
DEBUG_DECODER = dict(decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
                     decoder_intermediate_size=128)


def perturbed(model: torch.nn.Module, scale: float = 0.05, seed: int = 1) -> torch.nn.Module:
    """Every tensor moved off its initial value, so no mapping error hides behind equal initialisations."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.state_dict().values():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model.eval()


def vit_mae_folder(path: Path, **config) -> tuple[Path, Split]:
    """A saved ViTMAEForPreTraining and its weights in our names."""
    import transformers

    model = perturbed(transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(**{**DEBUG, **DEBUG_DECODER,
                                                                                     **config})))
    model.save_pretrained(path)
    return path, from_transformers(model.state_dict())


def vit_folder(path: Path, architecture: str, **config) -> tuple[Path, Split]:
    """A saved ViTModel / ViTForImageClassification and its weights in our names."""
    import transformers

    model = perturbed(getattr(transformers, architecture)(transformers.ViTConfig(**{**DEBUG, **config})))
    model.save_pretrained(path)
    return path, from_transformers(model.state_dict())
