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


def _export(encoder, path):
    """`encoder` as train.export writes it: its weights and a .json with its timm kwargs."""
    import json

    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in encoder.state_dict().items()}, str(path))
    path.with_suffix(".json").write_text(json.dumps({"timm_kwargs": encoder.timm_kwargs(), "objective": "finetune",
                                                     "step": 4}))
    return path


def test_the_result_says_which_encoder_pooling_and_image_size_it_scored(indexes, tmp_path, capsys):
    """Two results compare only on the same features: the line and the JSON name the encoder, the
    pooling and the size used (the encoder's own for --img_size 0)."""
    import json

    from train.evaluate import main

    train_index, test_index = indexes
    source = ["--train_index", train_index, "--test_index", test_index, "--num_workers", "0"]
    path = _export(create_model("vit_debug_patch4"), tmp_path / "enc.safetensors")
    result = main([*source, "--encoder", str(path), "--pool", "avg", "--img_size", "32",
                   "--out", str(tmp_path / "e.json")])
    assert {k: result[k] for k in ("encoder", "pool", "img_size")} == {"encoder": str(path.resolve()), "pool": "avg",
                                                                      "img_size": 32}
    assert json.loads((tmp_path / "e.json").read_text()) == result
    line = capsys.readouterr().out.splitlines()[-2]
    assert line.startswith(f"{path}, avg features at 32 px: kNN top-1 {result['knn_top1']:.2f}%"), line
    result = main([*source, "--random_init", "vit_debug_patch4", "--seed", "3"])
    assert (result["encoder"], result["pool"], result["img_size"]) == \
        ("random init vit_debug_patch4 (seed 3)", "cls", 28)
    assert capsys.readouterr().out.splitlines()[-2].startswith("random init vit_debug_patch4 (seed 3), cls features at "
                                                               "28 px: kNN top-1")


def test_a_note_says_when_pool_is_not_what_a_fine_tuned_encoders_description_implies(indexes, tmp_path, capsys):
    """A fine-tuned export (global_pool avg: its classifier read fc_norm of the patch mean) scored
    on its cls token gets one line saying so; scored with --pool avg, or a pretrained export
    (global_pool token) with either pooling, none."""
    from train.evaluate import main

    train_index, test_index = indexes
    source = ["--train_index", train_index, "--test_index", test_index, "--num_workers", "0"]
    tuned = _export(create_model("vit_debug_patch4", global_pool="avg", num_classes=10), tmp_path / "tuned.safetensors")
    main([*source, "--encoder", str(tuned)])
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [f"note: --pool cls, but {tuned} was fine-tuned with global_pool avg (its classifier read fc_norm "
                     f"of the patch mean): docs/EVALUATION.md scores it with --pool avg"]
    pretrained = _export(create_model("vit_debug_patch4"), tmp_path / "pretrained.safetensors")
    for argv in (["--encoder", str(tuned), "--pool", "avg"], ["--encoder", str(pretrained)],
                 ["--encoder", str(pretrained), "--pool", "avg"]):
        main([*source, *argv])
        assert "note:" not in capsys.readouterr().out, argv


def test_a_note_says_when_pool_is_not_the_pooling_a_checkpoints_objective_trained_on(tmp_path, monkeypatch):
    """A checkpoint's complete.json holds the run's config: energy's energy.pool avg (its energy
    head read the patch mean) implies avg; an MAE run's config has no pool of its own, so no note."""
    import argparse

    from train.engine import checkpoint
    from train.evaluate import pool_note

    kwargs = create_model("vit_debug_patch4").timm_kwargs()
    metas = {"energy": {"objective": "energy", "encoder_timm_kwargs": kwargs, "config": {"energy": {"pool": "avg"}}},
             "mae": {"objective": "mae", "encoder_timm_kwargs": kwargs, "config": {"mae": {"mask_ratio": 0.75}}}}
    monkeypatch.setattr(checkpoint, "read_meta", lambda tag: metas[tag.parent.parent.name])

    def note(run, pool):
        tag = tmp_path / run / "checkpoints" / "step00000004"
        return pool_note(argparse.Namespace(encoder=None, checkpoint=str(tag), random_init=None, seed=0, pool=pool))

    assert note("energy", "cls") == (f"note: --pool cls, but checkpoint {tmp_path / 'energy' / 'checkpoints'}"
                                     f"/step00000004 trained energy on energy.pool avg features: docs/EVALUATION.md "
                                     f"scores it with --pool avg")
    assert note("energy", "avg") is None and note("mae", "cls") is None and note("mae", "avg") is None
