"""Labels only where they are used: unlabeled shard sets (img2dataset-style shards written
by webdataset's ShardWriter) are read without labels and their batches carry none; a labeled set
reads its labels under its label key (cls, or a json field); index fields (data/labels.py,
data/shards.py, data/verify.py)."""
import json

import pytest
import torch
from wds_shards import image_bytes, write_img2dataset_shards, write_index

from data.faults import ERROR_KINDS, CorruptDataError, SampleError, ShardIndexError
from data.labels import LabelKey
from data.loader import ShardLoader
from data.shard_index import ShardSet
from data.shards import open_sample
from data.verify import verify_shards


def loader(index, batch_size=4) -> ShardLoader:
    return ShardLoader(ShardSet.from_index(index), 16, batch_size=batch_size, seed=0, rank=0, world=1, num_workers=0,
                       shuffle_buffer=4)


@pytest.fixture
def unlabeled(tmp_path):
    tars = write_img2dataset_shards(tmp_path / "shards")
    return tars, write_index(tmp_path / "shards" / "train.json", tars, [8, 8])


def test_an_unlabeled_set_feeds_every_sample_and_its_batches_carry_no_label(unlabeled):
    shards = ShardSet.from_index(unlabeled[1])
    assert not shards.labeled and shards.classes == () and shards.labels is None
    stream = loader(unlabeled[1])
    batches = [next(stream) for _ in range(4)]  # one epoch: 16 samples, 2 of them webp
    assert all(set(b) == {"image"} for b in batches)  # no stand-in label anything could train on
    assert all(b["image"].shape == (4, 3, 16, 16) for b in batches)
    counts = stream.counters()
    assert all(counts[f"data_skipped_{k}"] == 0 for k in ERROR_KINDS), counts
    assert counts["data_converted_other_format"] == 0  # jpg and webp are standard formats


def test_the_same_shards_under_a_labeled_index_are_skipped_as_missing_cls_as_before(unlabeled, tmp_path):
    legacy = tmp_path / "legacy.json"  # data/write_shards.py's format: no "labeled", cls labels implied
    legacy.write_text(json.dumps({"shards": [{"file": str(t), "samples": 8} for t in unlabeled[0]],
                                  "classes": ["a", "b"]}))
    shards = ShardSet.from_index(legacy)
    assert shards.labeled and shards.label_key == "cls"
    stream = ShardLoader(shards, 16, batch_size=4, seed=0, rank=0, world=1, num_workers=0, shuffle_buffer=4,
                         max_bad_fraction=0.5)
    with pytest.raises(CorruptDataError, match=r"7 of 8 samples unusable") as e:  # the limit applies to labeled sets
        next(stream)
    assert "(missing_cls 6)" in str(e.value) and "(missing_cls 1)" in str(e.value)


def test_labels_from_a_json_field(tmp_path):
    tars = write_img2dataset_shards(tmp_path / "shards", label_field="label")
    index = write_index(tmp_path / "shards" / "train.json", tars, [8, 8], labeled=True, label_key="json:label",
                        classes=["0", "1", "2"])
    stream = loader(index)
    got = {}
    for _ in range(4):
        batch = next(stream)
        assert batch["label"].dtype == torch.int64
        for label in batch["label"].tolist():
            got[label] = got.get(label, 0) + 1
    assert got == {0: 6, 1: 5, 2: 5}  # labels k % 3 of k = 0..15
    assert all(v == 0 for k, v in stream.counters().items() if k.startswith("data_skipped_"))


@pytest.mark.parametrize("meta, kind", [
    (b'{"caption": "no label"}', "missing_cls"),
    (b'{"label": "cat"}', "bad_label"),
    (b'{"label": 1.5}', "bad_label"),
    (b'{"label": true}', "bad_label"),
    (b"not json", "bad_label"),
    (b"[" * 100_000 + b"]" * 100_000, "bad_label"),  # nested past the recursion limit
    (b'{"label": -1}', "bad_label"),  # a class index; -1 would pick the last logit
])
def test_a_json_label_that_is_missing_or_not_an_integer_is_a_bad_sample(meta, kind):
    with pytest.raises(SampleError) as e:
        open_sample({"jpg": image_bytes(0), "json": meta}, labels=LabelKey.parse("json:label"))
    assert e.value.kind == kind
    with pytest.raises(SampleError, match="missing_cls"):  # no json member at all
        open_sample({"jpg": image_bytes(0)}, labels=LabelKey.parse("json:label"))
    assert open_sample({"jpg": image_bytes(0), "json": b'{"label": "7"}'}, labels=LabelKey.parse("json:label"))[1] == 7
    with pytest.raises(SampleError, match="negative"):
        open_sample({"jpg": image_bytes(0), "cls": b"-3"}, labels=LabelKey.parse("cls"))


def test_label_keys_parse_and_refuse_malformed_ones():
    assert LabelKey.parse("cls") == LabelKey() and str(LabelKey.parse("JSON:label")) == "json:label"
    for bad in ("", "json:", ":label", "a b"):
        with pytest.raises(ValueError, match="expected MEMBER"):
            LabelKey.parse(bad)


def test_index_fields_labeled_label_key_classes_and_absolute_paths(unlabeled, tmp_path):
    tars, _ = unlabeled
    elsewhere = write_index(tmp_path / "indexes" / "abs.json", tars, [8, 8], absolute=True)  # shards not under it
    shards = ShardSet.from_index(elsewhere)
    assert shards.files == tuple(t.resolve() for t in tars) and not shards.labeled
    no_classes = tmp_path / "no_classes.json"  # unlabeled: the classes list may be left out
    no_classes.write_text(json.dumps({"shards": [{"file": str(tars[0]), "samples": 8}], "labeled": False}))
    assert ShardSet.from_index(no_classes).classes == ()
    labeled_no_classes = tmp_path / "labeled_no_classes.json"
    labeled_no_classes.write_text(json.dumps({"shards": [{"file": str(tars[0]), "samples": 8}]}))
    with pytest.raises(ShardIndexError, match="no 'shards' or 'classes' list"):
        ShardSet.from_index(labeled_no_classes)
    for fields, says in [({"labeled": "no"}, "'labeled' must be true or false"),
                         ({"label_key": "json:"}, "expected MEMBER")]:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"shards": [{"file": str(tars[0]), "samples": 8}], "classes": [], **fields}))
        with pytest.raises(ShardIndexError, match=says):
            ShardSet.from_index(bad)


def test_readers_of_labels_are_refused_an_unlabeled_set_with_the_index_and_the_fix(unlabeled):
    shards = ShardSet.from_index(unlabeled[1])
    with pytest.raises(ShardIndexError) as e:
        shards.require_labels("the probe fits on labels")
    assert str(e.value).startswith(f"the probe fits on labels, but the shard index {unlabeled[1]} is unlabeled")
    assert "python -m data.index_shards SHARDS... --out INDEX.json --label_key KEY" in str(e.value)
    shards.check_label_key("json:label")  # an unlabeled set reads no label: any key
    labeled = ShardSet(shards.files, shards.counts, ("a",), unlabeled[1], labeled=True, label_key="json:label")
    labeled.require_labels("anything")
    labeled.check_label_key("json:label")
    with pytest.raises(ShardIndexError, match="data.label_key is 'cls', but the labels of the shard index .* are "
                                              "under 'json:label'.*pass --data.label_key json:label"):
        labeled.check_label_key("cls")


def test_verify_checks_no_label_in_an_unlabeled_set(unlabeled):
    reports = verify_shards(ShardSet.from_index(unlabeled[1]), workers=1)
    assert [r.ok for r in reports] == [True, True] and sum(r.samples for r in reports) == 16


def test_an_index_written_by_data_index_shards_reads_as_unlabeled(unlabeled, tmp_path):
    from data.index_shards import main as index_shards

    out = tmp_path / "elsewhere" / "laion.json"  # shards outside the index's folder: absolute entries
    assert index_shards([str(unlabeled[0][0].parent), "--out", str(out), "--workers", "1"]) == 0
    shards = ShardSet.from_index(out)
    assert not shards.labeled and shards.classes == () and shards.num_samples == 16
    assert all(f.is_absolute() for f in shards.files)
    assert [set(b) for b in (next(loader(out)),)] == [{"image"}]
