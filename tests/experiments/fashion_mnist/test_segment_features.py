"""segment_features.py reads a MixedAE encoder's frozen features with and without the segment
embedding it was pretrained with: without, they are the exported plain ViT's; with source s, every
block's patch-token input carries s's sin-cos code, as in pretraining."""
import pytest
import torch
from mixedae_runs import mixedae_objective, mixedae_run

from experiments.fashion_mnist.segment_features import cls_features
from experiments.fashion_mnist.segment_features import main as segment_features
from model.pos_embed import sincos_segments


def _by_hand(obj, images, source):
    """cls features with source s's code added to each patch token before every block, one block at a time."""
    enc = obj.encoder
    x = enc.add_cls_token(enc.embed_patches(images))  # (B, 1+N, D)
    code = sincos_segments(enc.embed_dim, obj.g)[source]  # (D,)
    add = torch.cat([torch.zeros(1, enc.embed_dim), code.expand(x.shape[1] - 1, -1)])  # (1+N, D): cls gets none
    for block in enc.blocks:
        x = block(x + add)
    return enc.norm(x)[:, 0]


def test_features_without_are_the_plain_vit_and_with_a_source_carry_its_code():
    obj, _ = mixedae_objective()
    images = torch.randn(6, 1, 32, 32)
    with torch.no_grad():
        without = cls_features(obj, images, None, batch_size=4)  # two batches
        assert torch.allclose(without, obj.encoder.pooled_features(images, "cls"), atol=1e-6)
        for source in (0, 3):
            assert torch.allclose(cls_features(obj, images, source, batch_size=4), _by_hand(obj, images, source),
                                  atol=1e-5)
        assert not torch.allclose(cls_features(obj, images, 0), without, atol=1e-3)
        assert not torch.allclose(cls_features(obj, images, 0), cls_features(obj, images, 3), atol=1e-3)
    with pytest.raises(ValueError, match=r"source 4 is not a segment index of this run: choose one in 0..3"):
        cls_features(obj, images, 4)


def test_the_last_tag_by_default_and_a_run_without_segments_refused(tmp_path, capsys):
    run, test = mixedae_run(tmp_path)
    index = ["--train_index", str(test.parent / "train.json"), "--test_index", str(test)]
    (last,) = segment_features([str(run), *index, "--sources", "0,2"])
    assert (last["tag"], last["step"]) == ("step00000003", 3)
    for way in ("without", "source0", "source2"):
        assert set(last[way]) == {"knn_top1", "linear_probe_top1"}
        assert all(0 <= v <= 100 for v in last[way].values())
    first, again = segment_features([str(run), *index, "--tags", "step00000001,step00000003"])
    assert again == {k: last[k] for k in ("tag", "step", "without", "source0")}  # the same numbers each call
    assert first["without"] != last["without"]  # another encoder at step 3
    with pytest.raises(SystemExit):
        segment_features([str(run), *index, "--sources", "0,x"])
    config = run / "config.json"
    config.write_text(config.read_text().replace('"segment_embed": true', '"segment_embed": false'))
    with pytest.raises(SystemExit):
        segment_features([str(run), *index])
    assert "pretrained without segment embeddings (mixedae.segment_embed false)" in capsys.readouterr().err
