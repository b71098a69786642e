"""train/config/backbones.py: a timm backbone's checks before start, each one line naming the option
and the fix, where each was a traceback or a silent loss."""
import pytest
from conftest import REPO

from train.config.errors import ConfigError
from train.config.objective_fits import check_objective_fits
from train.config.parsing import parse_args

ENERGY = ["--ds_config", str(REPO / "ds_configs/cpu_debug.json"), "--config",
          str(REPO / "train/configs/energy/debug.json"), "--data.source", "synthetic"]


def checked(*options: str) -> None:
    check_objective_fits(parse_args([*ENERGY, *options]), micro_batch=8)


@pytest.mark.parametrize("options, said", [
    (["--model.name", "timm/convnext_atto", "--optim.layer_decay", "0.65"],
     "optim.layer_decay 0.65 numbers the blocks of a ViT of this codebase; timm backbone timm/convnext_atto has none"),
    (["--model.name", "timm/vgg11", "--model.img_size", "32", "--energy.grid_cell", "8", "--model.drop_path_rate",
      "0.1"], "timm model 'vgg11' has no stochastic depth: set model.drop_path_rate 0"),
    # the patch embedding would floor the grid: the last 8 rows and columns never reach the encoder
    (["--model.name", "timm/vit_tiny_patch16_224", "--model.img_size", "40", "--energy.grid_cell", "8"],
     "model.img_size 40 is not divisible by the patch size 16 of timm/vit_tiny_patch16_224"),
    # hard-sigmoid has no double backward: energy's step failed in the engine's backward
    (["--model.name", "timm/mobilenetv3_small_100", "--model.img_size", "32", "--energy.grid_cell", "8"],
     "no double backward for one of its operations (derivative for aten::hardsigmoid_backward"),
])
def test_what_a_timm_backbone_cannot_take_is_refused_before_start(options, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(".", r"\.")):
        checked(*options)


@pytest.mark.parametrize("name, patch", [("timm/convnext_atto", 0), ("timm/vgg11", 0),
                                         ("timm/vit_tiny_patch16_224", 16)])
def test_backbones_that_fit_pass_and_the_probe_finds_their_double_backward(name, patch):
    """The refusals above are not the probe failing on everything: these pass every check, and on
    the meta device their double backward exists and their patch grid (if any) fits 32 px."""
    import torch

    from model.registry import create_model
    from train.config.backbones import missing_double_backward

    checked("--model.name", name, "--model.img_size", "32", "--energy.grid_cell", "8")
    with torch.device("meta"):
        encoder = create_model(name, img_size=32, in_chans=3, attn_backend="math")
    assert encoder.patch_size == patch and missing_double_backward(encoder, 3, 32) is None
