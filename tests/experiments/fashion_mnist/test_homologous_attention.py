"""homologous_attention.py reads MixedAE's TopK selection back from a run's checkpoints: the same
accuracy the training step logs, the same again without segment embeddings, and chance K/(N+1)."""
import json

import pytest
import torch
from mixedae_runs import mixedae_objective, mixedae_run

from experiments.fashion_mnist.homologous_attention import main as homologous_attention
from experiments.fashion_mnist.homologous_attention import topk_report, topk_shares
from experiments.fashion_mnist.report import collect, topk_lines


def test_shares_are_the_ones_training_logs_and_segments_come_back_on():
    obj, _ = mixedae_objective()
    images = torch.randn(16, 1, 32, 32)
    shares = topk_shares(obj, images, segments=True, batch_size=8)  # two batches of 8 images: 2 mixed each
    logged = []
    with torch.no_grad():
        for i, chunk in enumerate(images.split(8)):
            logged.append(obj.forward_mixed(chunk, obj.draw_mixing(8, chunk.device, torch.Generator().manual_seed(i))))
    for key in ("topk_acc", "topk_acc_block0", "topk_acc_block1"):
        assert shares[key] == pytest.approx(sum(out[key].item() for out in logged) / 2, abs=1e-4)
    without = topk_shares(obj, images, segments=False, batch_size=8)
    assert obj.cfg.segment_embed is True  # switched back on after the probe
    obj.cfg.segment_embed = False
    with torch.no_grad():
        off = [obj.forward_mixed(c, obj.draw_mixing(8, c.device, torch.Generator().manual_seed(i)))["topk_acc"].item()
               for i, c in enumerate(images.split(8))]
    assert without["topk_acc"] == pytest.approx(sum(off) / 2, abs=1e-4) and without != shares


def test_a_smaller_last_batch_weighs_by_its_number_of_mixed_images():
    # 12 images in batches of 8 and 4: 2 mixed images (g = 4) in the first, 1 in the second, so the
    # share over all 3 mixed images is (2 a0 + a1) / 3, not the mean of the two batches' shares
    obj, _ = mixedae_objective()
    torch.manual_seed(0)
    images = torch.randn(12, 1, 32, 32)
    shares = topk_shares(obj, images, segments=True, batch_size=8)
    with torch.no_grad():
        a0, a1 = (obj.forward_mixed(c, obj.draw_mixing(len(c), c.device, torch.Generator().manual_seed(i)))["topk_acc"]
                  .item() for i, c in enumerate(images.split(8)))
    assert abs(a0 - a1) / 6 > 1e-3  # the two weightings differ by (a0 - a1) / 6: well beyond the tolerance
    assert shares["topk_acc"] == pytest.approx((2 * a0 + 1 * a1) / 3, abs=1e-4)


def test_chance_and_refusals():
    obj, _ = mixedae_objective()
    report = topk_report(obj, torch.randn(8, 1, 32, 32))
    assert report["chance"] == round(16 / 65, 4)  # 8x8 patches, r = 0.25: K = 16 own keys among 64 + cls
    assert {"topk_acc", "without_segments_topk_acc"} <= set(report) and report["images"] == 8
    with pytest.raises(ValueError, match="do not split into groups of g = 4"):
        topk_report(obj, torch.randn(6, 1, 32, 32))
    masked, _ = mixedae_objective("--mixedae.attention", "masked")
    with pytest.raises(ValueError, match="no homologous TopK selection on mixed images"):
        topk_report(masked, torch.randn(8, 1, 32, 32))
    no_segments, _ = mixedae_objective("--mixedae.segment_embed", "false")
    assert not any(k.startswith("without_segments") for k in topk_report(no_segments, torch.randn(8, 1, 32, 32)))


def test_every_tag_of_a_run_on_the_same_images(tmp_path):
    run, test = mixedae_run(tmp_path)
    index = ["--index", str(test)]
    first, second, third = homologous_attention([str(run), *index, "--images", "32"])
    assert [first["tag"], third["tag"]] == ["step00000001", "step00000003"] and first == {**second, "tag": first["tag"],
                                                                                           "step": 1}
    assert first["images"] == third["images"] == 32 and first["topk_acc"] != third["topk_acc"]
    again = homologous_attention([str(run), *index, "--images", "32", "--tags", "step00000001"])
    assert again == [first]  # the same images and mixings each call
    with pytest.raises(SystemExit):
        homologous_attention([str(run), *index, "--images", "30"])  # not a multiple of g = 4


def test_the_report_collects_the_kept_checkpoints_and_tables_them(tmp_path):
    run, _ = mixedae_run(tmp_path)
    seed = tmp_path / "study" / "mixedae" / "seed0"
    seed.mkdir(parents=True)
    run.rename(seed / "pretrain")
    (seed / "pretrain" / "meta.json").write_text(json.dumps({"total_steps": 8}))  # 4 epochs: 2 steps each
    (seed / "result.json").write_text(json.dumps({"entry": "mixedae", "label": "MixedAE", "seed": 0}))
    collect(tmp_path / "study", tmp_path / "summaries", tmp_path / "figures")
    summary = json.loads((tmp_path / "summaries" / "mixedae_seed0.json").read_text())
    kept = summary["homologous_attention"]  # step 1 (pinned) and step 3 (the last); step 2 is neither
    assert [(m["step"], m["epoch"]) for m in kept] == [(1, 0.5), (3, 1.5)]
    assert kept[0]["images"] == 40  # the whole (fake) test split: fewer than 512 images
    lines = topk_lines([summary])
    assert lines[1] == "## MixedAE's homologous attention"
    assert lines[-1] == (f"| MixedAE seed 0 | 1.5 | 0.246 | {kept[1]['topk_acc']:.3f} | "
                         f"{kept[1]['without_segments_topk_acc']:.3f} | {kept[1]['topk_acc_block0']:.3f} | "
                         f"{kept[1]['topk_acc_block1']:.3f} |")
    assert topk_lines([{"label": "MAE", "seed": 0}]) == []
