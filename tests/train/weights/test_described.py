"""train/weights/described.py: encoders rebuilt from an export's description, checked before anything
is built."""
import json
from pathlib import Path

import pytest
import torch

from data.cli import InputError
from model import create_model
from train.weights.described import (ARCH_SIZES, OUR_ARCH_KEYS, checked_timm_kwargs, checkpoint_description,
                                     described_encoder)


def _model(**kwargs):
    torch.manual_seed(0)
    return create_model("vit_debug_patch4", **kwargs).eval()


def _description(model) -> dict:
    """What an export's .json records (train/weights/export.py: the encoder's timm_kwargs)."""
    return model.timm_kwargs()


def _same_features(built, source) -> bool:
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return torch.equal(built.eval().forward_features(x), source.forward_features(x))


def test_a_fine_tuned_export_with_a_classifier_rebuilds_its_encoder():
    # evaluate --encoder on a fine-tuned export: its head.* is left out, the encoder loads strictly
    source = _model(num_classes=10)
    state = source.state_dict()
    assert "head.weight" in state
    built = described_encoder(_description(source), state, "enc.json", "fix")
    assert "head.weight" not in built.state_dict() and _same_features(built, source)


@pytest.mark.parametrize("classes", [0, 10])
def test_an_avg_pooled_export_keeps_its_pooling(classes):
    source = _model(num_classes=classes, global_pool="avg")
    built = described_encoder(_description(source), source.state_dict(), "enc.json", "fix")
    assert built.global_pool == "avg" and _same_features(built, source)
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the pooled feature: fc_norm of the patch tokens' mean (timm's avg pooling)
        feats = source.forward_features(x)
        want = torch.nn.functional.layer_norm(feats[:, 1:].mean(1), (32,), source.fc_norm.weight, source.fc_norm.bias,
                                              source.fc_norm.eps)
        assert torch.allclose(built.forward_head(built.forward_features(x)), want, atol=1e-6)


@pytest.mark.parametrize("key", ARCH_SIZES)
def test_a_size_of_zero_is_refused(key):
    kwargs = {k: _description(_model())[k] for k in OUR_ARCH_KEYS}
    with pytest.raises(InputError, match=rf"enc\.json: {key} is 0, not an integer >= 1: fix"):
        checked_timm_kwargs({**kwargs, key: 0}, "enc.json", "fix")
    assert checked_timm_kwargs({**kwargs, key: 1}, "enc.json", "fix")[key] == 1  # 1 is the smallest size


def test_an_unbounded_mlp_ratio_is_refused_before_anything_is_built():
    # json reads `Infinity` as a float: a width of infinitely many hidden units cannot be built
    kwargs = {**_description(_model()), **json.loads('{"mlp_ratio": Infinity}')}
    with pytest.raises(InputError, match=r"enc\.json: mlp_ratio is inf, not a finite number > 0: fix"):
        described_encoder(kwargs, _model().state_dict(), "enc.json", "fix")


def test_an_irpe_encoder_is_rebuilt_with_its_relative_position_tables():
    source = _model(rpe=True)
    state = source.state_dict()
    assert "blocks.0.attn.rpe.table" in state
    built = described_encoder(_description(source), state, "enc.json", "fix")
    assert built.rpe and _same_features(built, source)
    # a checkpoint's complete.json records the same description, and it fits the tag's weights
    assert checkpoint_description({"encoder_timm_kwargs": _description(source)}, Path("tag"), state)["rpe"] is True


def test_a_plain_encoder_described_as_irpe_is_refused():
    source = _model()
    kwargs = {**_description(source), "rpe": True}
    why = r"which hold no blocks\.0\.attn\.rpe\.table, which the model has"
    with pytest.raises(InputError, match=rf"enc\.json does not describe the weights beside it, {why}: fix"):
        described_encoder(kwargs, source.state_dict(), "enc.json", "fix")
    with pytest.raises(InputError, match=rf"tag/complete\.json: encoder_timm_kwargs does not describe .*{why}"):
        checkpoint_description({"encoder_timm_kwargs": kwargs}, Path("tag"), source.state_dict())
