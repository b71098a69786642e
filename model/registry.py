"""Registry of encoder factories: `create_model(name, **overrides)`, `list_models()`.

Standard sizes follow the ViT / MAE papers; the `debug` and `mini` entries are tiny models for
tests and the Fashion-MNIST demo (patch 4).
"""
from __future__ import annotations

import difflib
import fnmatch
import inspect
from typing import Callable

from model.timm_backbone import TIMM_PREFIX, TimmBackbone, is_timm_name
from model.vit import VisionTransformer

_REGISTRY: dict[str, Callable[..., VisionTransformer]] = {}


def register_model(name: str, **arch) -> None:
    def factory(**overrides) -> VisionTransformer:
        return VisionTransformer(**{**arch, **overrides})

    factory.__name__ = name
    factory.arch = arch  # type: ignore[attr-defined]
    _REGISTRY[name] = factory


register_model("vit_tiny_patch16", patch_size=16, embed_dim=192, depth=12, num_heads=3)
register_model("vit_small_patch16", patch_size=16, embed_dim=384, depth=12, num_heads=6)
register_model("vit_base_patch16", patch_size=16, embed_dim=768, depth=12, num_heads=12)
register_model("vit_large_patch16", patch_size=16, embed_dim=1024, depth=24, num_heads=16)
register_model("vit_huge_patch14", patch_size=14, embed_dim=1280, depth=32, num_heads=16)
# Tiny sizes: tests (28x28, a 7x7 grid) and the CPU demo on Fashion-MNIST (32x32, an 8x8 grid).
register_model("vit_debug_patch4", img_size=28, patch_size=4, embed_dim=32, depth=2, num_heads=2)
register_model("vit_mini_patch4", img_size=32, patch_size=4, embed_dim=128, depth=4, num_heads=4)


def list_models(pattern: str = "*") -> list[str]:
    return sorted(n for n in _REGISTRY if fnmatch.fnmatch(n, pattern))


def create_model(name: str, **overrides) -> VisionTransformer | TimmBackbone:
    """A registered ViT, or any timm model as `timm/<timm name>` (model/timm_backbone.py)."""
    if is_timm_name(name):
        return TimmBackbone(name[len(TIMM_PREFIX):], **overrides)
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model {name!r}{hint} Registered: {', '.join(list_models())}")
    return _REGISTRY[name](**overrides)


def model_arch(name: str, **overrides) -> dict:
    """Constructor arguments of a registered model (defaults filled in) without building it.
    timm backbones report their img_size only (patch_size and depth 0: not a patch-token ViT)."""
    if is_timm_name(name):
        return {"img_size": overrides.get("img_size", 224), "patch_size": 0, "depth": 0}
    if name not in _REGISTRY:
        create_model(name)
    defaults = {k: p.default for k, p in inspect.signature(VisionTransformer.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {**defaults, **_REGISTRY[name].arch, **overrides}  # type: ignore[attr-defined]
