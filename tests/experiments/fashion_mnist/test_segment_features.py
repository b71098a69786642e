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


def test_the_probes_fit_on_the_train_subset_and_score_on_the_test_subset(tmp_path, monkeypatch):
    from experiments.fashion_mnist import segment_features as tool

    run, test = mixedae_run(tmp_path)  # 20 train and 40 test images
    sizes = []  # (train features, train labels, test features, test labels) of each kNN / probe fit

    def record(train_f, train_y, test_f, test_y, classes):
        sizes.append((len(train_f), len(train_y), len(test_f), len(test_y)))
        return 50.0

    monkeypatch.setattr(tool, "knn_top1", record)
    monkeypatch.setattr(tool, "linear_probe_top1", record)
    index = ["--train_index", str(test.parent / "train.json"), "--test_index", str(test)]
    segment_features([str(run), *index, "--max_train", "12", "--max_test", "7"])
    assert sizes == [(12, 12, 7, 7)] * 4  # kNN and probe, without and with source 0
    sizes.clear()
    segment_features([str(run), *index, "--max_test", "30"])  # --max_train 0: the whole train split
    assert sizes == [(20, 20, 30, 30)] * 4


def test_a_tag_missing_encoder_weights_is_refused_and_one_without_decoder_is_read(tmp_path):
    from conftest import save_module_state

    from experiments.fashion_mnist.run_checkpoints import load_tag

    obj, _ = mixedae_objective()
    state = obj.state_dict()
    no_block = tmp_path / "no_block"
    no_block.mkdir()
    save_module_state(no_block, {k: v for k, v in state.items() if not k.startswith("encoder.blocks.1.")})
    with pytest.raises(ValueError, match="does not match the run's config: missing"):
        load_tag(obj, no_block)  # block 1 would keep whatever weights obj had
    no_decoder = tmp_path / "no_decoder"
    no_decoder.mkdir()
    save_module_state(no_decoder, {k: v for k, v in state.items() if not k.startswith("decoder.")})
    obj.train()
    assert load_tag(obj, no_decoder) is obj and not obj.training  # in eval mode, as the probes read it


def test_named_tags_must_all_be_complete(tmp_path):
    import argparse

    from experiments.fashion_mnist.run_checkpoints import chosen_tags

    for step, complete in ((1, True), (2, False)):  # step 2: written, never marked complete (a crash)
        tag = tmp_path / "checkpoints" / f"step{step:08d}"
        tag.mkdir(parents=True)
        if complete:
            (tag / "complete.json").write_text('{"step": 1}')
    p = argparse.ArgumentParser()
    assert chosen_tags(p, tmp_path, "") == [tmp_path / "checkpoints" / "step00000001"]
    assert chosen_tags(p, tmp_path, "step00000001") == [tmp_path / "checkpoints" / "step00000001"]
    with pytest.raises(SystemExit):
        chosen_tags(p, tmp_path, "step00000001,step00000002")


def test_the_probe_subset_follows_its_seed(tmp_path):
    from experiments.fashion_mnist.run_checkpoints import probe_set

    _, test = mixedae_run(tmp_path)  # 40 test images
    one, again, seven = (probe_set(test, 10, 32, seed).images for seed in (1, 1, 7))
    assert one.shape == (10, 3, 32, 32) and torch.equal(one, again)
    assert not torch.equal(one, seven)  # another seed, another 10 of the 40
    assert len(probe_set(test, 0, 32, 7).images) == 40
