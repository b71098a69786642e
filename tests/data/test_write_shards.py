import gzip
import struct
from collections import Counter

import numpy as np
import pytest

from data.shards import ShardSet, decode, raw_samples
from data.write_shards import main as write_shards
from data.write_shards import read_idx


def _read_back(index_path):
    shards = ShardSet.from_index(index_path)
    return [decode(s) for s in raw_samples(list(shards.files), Counter())], shards


def test_imagefolder_round_trip(image_folder, tmp_path):
    [index] = write_shards(["imagefolder", str(image_folder), str(tmp_path / "out"), "--name", "train",
                            "--samples_per_shard", "5"])
    assert index["num_samples"] == 24 and index["classes"] == ["cat", "dog", "eel"]
    assert [s["samples"] for s in index["shards"]] == [5, 5, 5, 5, 4]
    assert index["pattern"] == "train-{000000..000004}.tar"
    samples, shards = _read_back(tmp_path / "out" / "train.json")
    assert len(samples) == 24
    # labels intact: the pixel value identifies class and index (value = 50 c + 5 i)
    seen = sorted((label, int(np.asarray(img.convert("L"))[0, 0])) for img, label in samples)
    want = sorted((c, c * 50 + i * 5) for c in range(3) for i in range(8))
    assert [lab for lab, _ in seen] == [lab for lab, _ in want]
    assert all(abs(v - w) <= 2 for (_, v), (_, w) in zip(seen, want, strict=True))  # JPEG at q100
    # shards mix classes (shuffled before sharding)
    first = [label for img, label in samples[:5]]
    assert len(set(first)) > 1


def test_bad_inputs_are_reported_not_dropped(image_folder, tmp_path, capsys):
    (image_folder / "cat" / "notes.txt").write_text("not an image")
    (image_folder / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0garbage")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        write_shards(["imagefolder", str(image_folder), str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "2 of 26 files are unreadable or not images" in err and "--skip_bad" in err
    assert not (out / "train.json").exists()
    [index] = write_shards(["imagefolder", str(image_folder), str(out), "--skip_bad"])
    assert index["num_samples"] == 24 and index["rejected"]["count"] == 2
    assert any("broken.jpg" in x for x in index["rejected"]["examples"])


def test_missing_and_empty_folders(image_folder, tmp_path, capsys):
    with pytest.raises(SystemExit):
        write_shards(["imagefolder", str(tmp_path / "nope"), str(tmp_path / "out")])
    assert "does not exist" in capsys.readouterr().err
    (image_folder / "fox").mkdir()
    with pytest.raises(SystemExit):
        write_shards(["imagefolder", str(image_folder), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "empty class folder" in err and "fox" in err


def _write_idx(path, array):
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_converter(tmp_path):
    src = tmp_path / "fm"
    src.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 10)):
        _write_idx(src / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(src / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    train, test = write_shards(["fashion-mnist", str(tmp_path / "out"), "--src", str(src), "--samples_per_shard", "8"])
    assert (train["num_samples"], test["num_samples"], len(train["shards"])) == (30, 10, 4)
    samples, _ = _read_back(tmp_path / "out" / "test.json")
    images = read_idx(src / "t10k-images-idx3-ubyte.gz")
    got = {label: np.asarray(img) for img, label in samples}  # test labels 0..9 are unique
    for label, arr in got.items():
        assert np.array_equal(arr, images[label])  # PNG is lossless


def test_fashion_mnist_missing_files_say_what_to_install(tmp_path, capsys):
    with pytest.raises(SystemExit):
        write_shards(["fashion-mnist", str(tmp_path / "out"), "--src", str(tmp_path)])
    assert "apt-get install dataset-fashion-mnist" in capsys.readouterr().err


def test_truncated_idx_is_rejected(tmp_path):
    _write_idx(tmp_path / "x.gz", np.zeros((4, 28, 28)))
    raw = gzip.open(tmp_path / "x.gz").read()
    with gzip.open(tmp_path / "y.gz", "wb") as f:
        f.write(raw[:-10])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "y.gz")
