"""model/timm_backbone.py: timm models built as backbones, whatever their head; the width the
adapter reports is the width of what it returns."""
import pytest
import torch

from model.registry import create_model


@pytest.mark.parametrize("name, width", [("vgg11", 4096), ("mobilenetv3_small_100", 1024),
                                         ("convnext_atto", 320), ("vit_tiny_patch16_224", 192)])
def test_embed_dim_is_the_width_of_the_pooled_features(name, width):
    """VGG's and MobileNetV3's pre-logits layers widen num_features (512, 576): heads built on
    embed_dim (energy's, the probe's) must take what pooled_features gives."""
    backbone = create_model(f"timm/{name}", img_size=32, in_chans=3).eval()
    assert backbone.pooled_features(torch.randn(2, 3, 32, 32)).shape == (2, width) and backbone.embed_dim == width


def test_a_model_without_stochastic_depth_builds_unless_asked_for_it():
    """VGG takes no drop_path_rate: at 0 (the default) it is not passed; above 0 one line says so."""
    assert create_model("timm/vgg11", img_size=32, in_chans=1).in_chans == 1
    with pytest.raises(ValueError, match="'vgg11' has no stochastic depth: set model.drop_path_rate 0"):
        create_model("timm/vgg11", img_size=32, in_chans=1, drop_path_rate=0.1)
    # timm's stochastic depth rises linearly over the blocks, to the full rate at the last one (the
    # first block's is 0: an Identity)
    convnext = create_model("timm/convnext_atto", img_size=32, drop_path_rate=0.1).inner
    assert convnext.stages[-1].blocks[-1].drop_path.drop_prob == pytest.approx(0.1)


@pytest.mark.parametrize("name, patch", [("vit_tiny_patch16_224", 16), ("swin_tiny_patch4_window7_224", 4),
                                         ("convnext_atto", 0)])
def test_patch_size_is_the_patch_embeddings(name, patch):
    with torch.device("meta"):
        assert create_model(f"timm/{name}", img_size=224).patch_size == patch


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.to("meta")], ids=["half", "to meta"])
def test_conversions_keep_the_inner_models_top_level_parameters_ours(convert):
    """The ViT's cls_token / pos_embed are registered on the adapter too (what the optimiser and the
    checkpoint see); after .half() or .to() the inner model must still compute with those objects,
    not with stale copies that training would never update."""
    m = convert(create_model("timm/vit_tiny_patch16_224", img_size=32))
    for name in ("cls_token", "pos_embed"):
        assert getattr(m.inner, name) is getattr(m, name), name
        assert getattr(m.inner, name).dtype == next(m.inner.blocks.parameters()).dtype


def test_no_weight_decay_names_are_the_timm_models_own():
    """A timm ViT keeps its cls token and position table out of weight decay, as timm's own recipes
    do; a model without the method (ConvNeXt) names none."""
    assert {"cls_token", "pos_embed"} <= create_model("timm/vit_tiny_patch16_224", img_size=32).no_weight_decay()
    assert create_model("timm/convnext_atto", img_size=32).no_weight_decay() == set()
