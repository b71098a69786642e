"""MLO-MAE's labeled split: D_tr and D_val partition the training shards, deterministically,
and no test sample is ever read."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from data.loader import ShardLoader
from data.shard_index import ShardSet
from data.split import LabeledSplit, SplitSource, shard_keys
from data.synthetic import SyntheticImages
from data.write_shards import main as write_shards


def pixel_id(img, seed):
    """The transform for these tests: a sample's identity is its (uniform) pixel value."""
    return torch.tensor(int(np.asarray(img.convert("L"))[0, 0]))


def folder(root, values):
    for i, v in enumerate(values):
        d = root / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((6, 6), v, dtype=np.uint8)).save(d / f"{i}.png")
    return root


@pytest.fixture
def train_and_test(tmp_path):
    train_values, test_values = list(range(0, 120)), list(range(130, 160))
    write_shards(["imagefolder", str(folder(tmp_path / "tr", train_values)), str(tmp_path / "s"), "--name", "train",
                  "--samples_per_shard", "20"])
    write_shards(["imagefolder", str(folder(tmp_path / "te", test_values)), str(tmp_path / "s"), "--name", "test",
                  "--samples_per_shard", "10"])
    return ShardSet.from_index(tmp_path / "s" / "train.json"), set(train_values), set(test_values)


def one_epoch(shards, keep, n, workers=0):
    loader = ShardLoader(shards, 6, batch_size=1, seed=3, rank=0, world=1, num_workers=workers, shuffle_buffer=7,
                         transform=pixel_id, keep=keep)
    return [int(next(loader)["image"]) for _ in range(n)]


def test_parts_are_disjoint_cover_the_train_split_and_never_read_test(train_and_test):
    shards, train_values, test_values = train_and_test
    split = LabeledSplit(0.2, seed=0)
    record = split.describe(shards, "train.json")
    assert record["num_train"] + record["num_val"] == 120 and 10 <= record["num_val"] <= 40
    tr = one_epoch(shards, split.keep_train, record["num_train"])
    val = one_epoch(shards, split.is_val, record["num_val"], workers=2)
    assert len(set(tr)) == len(tr) and len(set(val)) == len(val)  # one epoch: each sample once
    assert set(tr) | set(val) == train_values
    assert not set(tr) & set(val)
    assert not (set(tr) | set(val)) & test_values


def test_a_part_of_the_split_that_is_empty_is_said_not_waited_for(train_and_test):
    """val_fraction 0.0001 of 120 samples: D_val is empty, and its reader read every shard each
    epoch forever at full CPU (SIGTERM did not stop the run), its log last saying 0 D_val samples."""
    from data.faults import CorruptDataError

    shards, _, _ = train_and_test
    split = LabeledSplit(0.0001, seed=0)
    assert split.describe(shards, "train.json")["num_val"] == 0
    with pytest.raises(CorruptDataError, match=r"none of the samples of the 6 shard\(s\) belongs to its part of the "
                                               r"labeled split: that part is empty; give it a larger share \(e.g. "
                                               r"mlomae.val_fraction\)"):
        one_epoch(shards, split.is_val, 1)
    assert len(one_epoch(shards, split.keep_train, 120)) == 120  # the other part reads as before
    # a part with samples in one shard only: readers whose shards hold none this epoch wait for a later one
    lone = next(k for k in shard_keys(shards) if LabeledSplit(0.2, seed=0).is_val(k))
    only = one_epoch(shards, lambda key: key == lone, 1)[0]
    for workers in (0, 2):
        assert one_epoch(shards, lambda key: key == lone, 3, workers) == [only] * 3


def test_split_is_a_function_of_the_key_only(train_and_test):
    shards, _, _ = train_and_test
    keys = sorted(shard_keys(shards))
    assert len(keys) == 120
    a, b = LabeledSplit(0.2, seed=0), LabeledSplit(0.2, seed=0)
    assert [a.is_val(k) for k in keys] == [b.is_val(k) for k in keys]
    assert [a.is_val(k) for k in keys] != [LabeledSplit(0.2, seed=1).is_val(k) for k in keys]
    # the same key set in any order / shard layout gives the same D_val
    assert {k for k in reversed(keys) if a.is_val(k)} == {k for k in keys if a.is_val(k)}


def test_the_nominal_epoch_of_a_split_run_is_the_training_part(train_and_test, tmp_path):
    from data.source import nominal_epoch_size
    from train.config.options import DataConfig

    shards, _, _ = train_and_test
    cfg = DataConfig(train_index=str(tmp_path / "s" / "train.json"))
    assert nominal_epoch_size(cfg) == shards.num_samples
    # D_val's samples are held out of every epoch of D_tr
    assert nominal_epoch_size(cfg, LabeledSplit(0.2, seed=0)) == int(shards.num_samples * (1 - 0.2))


def test_build_source_reads_d_tr_and_d_val_as_disjoint_parts_of_the_shards(train_and_test, tmp_path, monkeypatch):
    import data.source as source_module
    from train.config.options import DataConfig

    shards, _, _ = train_and_test
    # each stream's loader, with the keep function that picks its samples, not the loader itself
    monkeypatch.setattr(source_module, "ShardLoader", lambda *a, keep=None, **k: SimpleNamespace(keep=keep))
    cfg = DataConfig(train_index=str(tmp_path / "s" / "train.json"), num_workers=0)
    source = source_module.build_source(cfg, 6, 3, 2, 0, 0, 1, torch.device("cpu"), split=LabeledSplit(0.2, seed=0))
    keys = set(shard_keys(shards))
    tr = {k for k in keys if source.train.keep(k)}
    val = {k for k in keys if source.val.keep(k)}
    assert not tr & val and tr | val == keys
    assert 0 < len(val) < len(tr)  # D_val is the 20%


def test_d_val_draws_its_own_order_and_augmentation_not_d_trs(monkeypatch):
    """build_source seeds the D_val stream apart from D_tr's: with D_tr's seed, each synthetic D_val
    batch was a copy of the D_tr batch it came with, and D_val's shard loader repeated D_tr's
    shuffle and crop draws."""
    import inspect

    import data.source as source_module
    from train.config.options import DataConfig

    split, cpu = LabeledSplit(0.2, seed=0), torch.device("cpu")
    batch = next(source_module.build_source(DataConfig(source="synthetic", num_classes=10), 8, 3, 4, 5, 0, 1, cpu,
                                            split=split))
    assert not torch.equal(batch["image"], batch["val_image"])
    # shards: the seed each stream's loader is given
    seed_of = lambda *a, **k: SimpleNamespace(seed=inspect.signature(ShardLoader).bind(*a, **k).arguments["seed"])
    monkeypatch.setattr(source_module, "ShardLoader", seed_of)
    monkeypatch.setattr(source_module, "train_shards", lambda cfg: None)
    source = source_module.build_source(DataConfig(num_workers=0), 8, 3, 4, 5, 0, 1, cpu, split=split)
    assert source.train.seed == 5 and source.val.seed != 5


def test_fraction_is_as_configured():
    split = LabeledSplit(0.2, seed=0)
    share = np.mean([split.is_val(f"sample_{i:06d}") for i in range(20000)])
    assert abs(share - 0.2) < 0.01


def test_the_give_up_rule_at_a_runs_end_counts_both_parts(train_and_test):
    """data.max_bad_fraction's last check: the unusable samples of D_tr and D_val (summed counters)
    against the samples both delivered; a split run had no such check, so a short run on mostly
    corrupt shards ended without a word."""
    from data.faults import CorruptDataError

    shards, _, _ = train_and_test
    split = LabeledSplit(0.2, seed=0)

    def part(keep):
        return ShardLoader(shards, 6, batch_size=1, seed=3, rank=0, world=1, num_workers=0, shuffle_buffer=7,
                           transform=pixel_id, keep=keep, max_bad_fraction=0.1)

    source = SplitSource(part(split.keep_train), part(split.is_val), val_every=2)
    for _ in range(8):
        next(source)
    assert (source.train.delivered(), source.val.delivered()) == (8, 4)
    source.check_unusable({"data_skipped_undecodable_image": 1})  # 1 of 13: under 10%
    with pytest.raises(CorruptDataError, match=r"2 of 14 samples read were unusable \(14.3%\), above "
                                               r"data.max_bad_fraction 0.1 \(by kind: undecodable_image 2\)"):
        source.check_unusable({"data_skipped_undecodable_image": 2})
    synthetic = SplitSource(SyntheticImages(2, 8, 1, 3, 0, 0), SyntheticImages(2, 8, 1, 3, 9, 0), val_every=2)
    synthetic.check_unusable({"data_skipped_undecodable_image": 2})  # nothing is read: nothing to check


def test_split_source_attaches_val_batches_and_resumes():
    def make():  # 1000 classes: D_tr's labels cannot pass for D_val's by chance (with 3 they did here)
        return SplitSource(SyntheticImages(2, 8, 1, 1000, seed=0, rank=0),
                           SyntheticImages(2, 8, 1, 1000, seed=9, rank=0), val_every=3)

    src = make()
    batches = [next(src) for _ in range(6)]
    assert [("val_image" in b) for b in batches] == [False, False, True, False, False, True]
    # each D_val batch, images and labels, is the D_val stream's next one (not D_tr's labels)
    val_stream = SyntheticImages(2, 8, 1, 1000, seed=9, rank=0)
    for b in (batches[2], batches[5]):
        want = next(val_stream)
        assert torch.equal(b["val_image"], want["image"]) and torch.equal(b["val_label"], want["label"])
    state = src.state_dict()
    nxt = [next(src) for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(state)
    again = [next(resumed) for _ in range(3)]
    assert torch.equal(nxt[2]["val_image"], again[2]["val_image"]) and torch.equal(nxt[0]["image"], again[0]["image"])
    other = SplitSource(SyntheticImages(2, 8, 1, 3, 0, 0), SyntheticImages(2, 8, 1, 3, 9, 0), val_every=2)
    with pytest.raises(ValueError, match="every 3 micro-batches"):
        other.load_state_dict(state)


def test_resuming_on_another_val_every_keeps_the_number_of_mask_cycles():
    """8 micro-batches at a D_val batch every 4 are 2 finished cycles; continued with one every 3,
    the position is 2 cycles of 3 = 6 batches, so the next D_val batch closes the third cycle."""
    def make(val_every):
        return SplitSource(SyntheticImages(2, 8, 1, 3, seed=0, rank=0), SyntheticImages(2, 8, 1, 3, seed=9, rank=0),
                           val_every=val_every)

    src = make(4)
    for _ in range(8):
        next(src)
    resumed = make(3)
    resumed.resume_from([src.state_dict()])
    assert resumed.batches == 8 // 4 * 3
    assert [("val_image" in next(resumed)) for _ in range(3)] == [False, False, True]


def test_split_counters_sum_both_parts():
    from types import SimpleNamespace

    train = SimpleNamespace(counters=lambda: {"data_skipped_empty_image": 1, "data_converted_cmyk": 0})
    val = SimpleNamespace(counters=lambda: {"data_skipped_empty_image": 2, "data_converted_cmyk": 5})
    assert SplitSource(train, val, 2).counters() == {"data_skipped_empty_image": 3, "data_converted_cmyk": 5}
