"""Our encoder's state_dict loads strictly into timm's VisionTransformer and gives the same features."""
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer as TimmViT

from model import create_model
from model.vit import VisionTransformer


@pytest.mark.parametrize("name,overrides", [
    ("vit_debug_patch4", {}),
    ("vit_small_patch16", {"img_size": 64}),
    ("vit_debug_patch4", {"global_pool": "avg", "num_classes": 7}),
    ("vit_debug_patch4", {"in_chans": 1}),
])
def test_strict_load_and_same_features(name, overrides):
    torch.manual_seed(0)
    _assert_loads_strictly_with_same_features(create_model(name, **overrides).eval())


def test_encoder_without_qkv_bias_loads_strictly_into_timm():
    # no registered size turns the qkv bias off, so build the encoder directly
    torch.manual_seed(0)
    ours = VisionTransformer(img_size=28, patch_size=4, embed_dim=32, depth=2, num_heads=2, qkv_bias=False).eval()
    assert not any(k.endswith("attn.qkv.bias") for k in ours.state_dict())
    _assert_loads_strictly_with_same_features(ours)


def _assert_loads_strictly_with_same_features(ours):
    theirs = TimmViT(**ours.timm_kwargs()).eval()
    missing_unexpected = theirs.load_state_dict(ours.state_dict(), strict=True)
    assert not missing_unexpected.missing_keys and not missing_unexpected.unexpected_keys
    size = ours.patch_embed.img_size
    x = torch.randn(3, ours.patch_embed.proj.in_channels, size, size)
    with torch.no_grad():
        assert torch.allclose(ours.forward_features(x), theirs.forward_features(x), atol=1e-5, rtol=1e-4)
        assert torch.allclose(ours(x), theirs(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("ours_name,timm_name", [
    ("vit_base_patch16", "vit_base_patch16_224"), ("vit_large_patch16", "vit_large_patch16_224"),
    ("vit_huge_patch14", "vit_huge_patch14_224"), ("vit_tiny_patch16", "vit_tiny_patch16_224"),
])
def test_standard_sizes_match_timm_names_and_shapes(ours_name, timm_name):
    import timm

    with torch.device("meta"):
        ours = create_model(ours_name)
        theirs = timm.create_model(timm_name, pretrained=False, num_classes=0)
    a = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    b = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert a == b
