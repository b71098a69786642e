"""train.evaluate's options reach the evaluation: --img_size for a --checkpoint, --pool, and the
test subset drawn apart from the training subset."""
import pytest
import torch

from data.shard_index import ShardSet
from data.write_shards import main as write_shards
from model import create_model
from train.run.evaluation import decode_all, load_encoder


@pytest.fixture
def indexes(image_folder, tmp_path):
    """(s/train.json, s/test.json): the same 24 images in the same order, in shards of their own."""
    for name in ("train", "test"):
        write_shards(["imagefolder", str(image_folder), str(tmp_path / "s"), "--samples_per_shard", "5",
                      "--name", name])
    return str(tmp_path / "s" / "train.json"), str(tmp_path / "s" / "test.json")


@pytest.fixture
def extracted(monkeypatch):
    """The features train.evaluate extracts, training set first."""
    import train.evaluate

    features, extract = [], train.evaluate.extract_features

    def recorded(*args, **kwargs):
        features.append(extract(*args, **kwargs))
        return features[-1]

    monkeypatch.setattr(train.evaluate, "extract_features", recorded)
    return features


def test_a_checkpoint_is_evaluated_at_the_size_asked(tmp_path, monkeypatch):
    """--img_size holds for a run's checkpoint as for an export: the 28 px, patch-4 encoder at 56 px
    has a 14 x 14 grid, 196 patch tokens and the cls token, its position table resized."""
    from model.interop import resize_pos_embed
    from train.engine import checkpoint
    from train.weights import export

    torch.manual_seed(0)
    encoder = create_model("vit_debug_patch4")
    monkeypatch.setattr(checkpoint, "find_resume", lambda given, path: tmp_path / "run" / "checkpoints" / "step4")
    monkeypatch.setattr(export, "encoder_state", lambda found: (encoder.state_dict(),
                                                                {"encoder_timm_kwargs": encoder.timm_kwargs()}))
    assert load_encoder(checkpoint=str(tmp_path / "run")).img_size == 28
    larger = load_encoder(checkpoint=str(tmp_path / "run"), img_size=56)
    assert larger.img_size == 56 and larger.pos_embed.shape == (1, (56 // 4) ** 2 + 1, encoder.embed_dim)
    assert torch.equal(larger.pos_embed, resize_pos_embed(encoder.pos_embed, (14, 14)))


@pytest.mark.parametrize("pool", ["cls", "avg"])
def test_evaluate_pools_the_features_as_asked(indexes, extracted, pool):
    """--pool cls is the cls token, --pool avg the mean of the patch tokens: each is the encoder's
    own pooling of the images, and the two differ."""
    from train.evaluate import main

    train_index, test_index = indexes
    main(["--train_index", train_index, "--test_index", test_index, "--random_init", "vit_debug_patch4",
          "--num_workers", "0", "--pool", pool])
    model = load_encoder(random_init="vit_debug_patch4", seed=0).eval()  # --seed's default
    images = decode_all(ShardSet.from_index(train_index), model.img_size, num_workers=0).images
    with torch.no_grad():
        tokens = model.forward_features(images)
        own = {"cls": tokens[:, 0], "avg": model.fc_norm(tokens[:, 1:].mean(1))}
    assert not torch.allclose(own["cls"], own["avg"], atol=1e-3)
    assert torch.allclose(extracted[0].features, own[pool], atol=1e-5)


def test_evaluate_draws_the_test_subset_apart_from_the_training_subset(indexes, extracted):
    """Two indexes of the same images in the same order, 6 samples of each: the same seed for both
    subsets would score the very samples the kNN and the probe were fitted on."""
    from train.evaluate import main

    train_index, test_index = indexes
    result = main(["--train_index", train_index, "--test_index", test_index, "--random_init", "vit_debug_patch4",
                   "--num_workers", "0", "--max_train", "6", "--max_test", "6"])
    assert result["train_samples"] == result["test_samples"] == 6
    train, test = extracted
    nearest = torch.cdist(test.features, train.features).min(1).values  # 0 for a training sample
    assert (nearest > 1e-4).any()
