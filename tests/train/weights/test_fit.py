"""train/weights/fit.py: whether --model.init_from's weights fit the configured encoder, judged from
tensor shapes before start."""
from model import create_model
from train.weights.fit import mismatch


def _shapes(**kwargs) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in create_model("vit_debug_patch4", **kwargs).state_dict().items()}


def test_a_classifier_of_another_class_count_fits():
    # fine-tuning a 1000-class checkpoint on 10 classes: the head is trained anew, not compared
    theirs, ours = _shapes(num_classes=1000), _shapes(num_classes=10)
    assert theirs["head.weight"] != ours["head.weight"]
    assert mismatch(theirs, ours) == ""
    avg_theirs, avg_ours = _shapes(num_classes=1000, global_pool="avg"), _shapes(num_classes=10, global_pool="avg")
    assert "fc_norm.weight" in avg_theirs and mismatch(avg_theirs, avg_ours) == ""


def test_an_encoder_tensor_of_another_shape_is_named():
    # the same sizes describe() reads (channels, width, patch, depth), another MLP width
    theirs, ours = _shapes(mlp_ratio=2.0), _shapes()
    assert mismatch(theirs, ours) == (f"blocks.0.mlp.fc1.weight of shape {list(theirs['blocks.0.mlp.fc1.weight'])} "
                                      f"(the model's: {list(ours['blocks.0.mlp.fc1.weight'])})")
