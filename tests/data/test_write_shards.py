import hashlib
import io
import json
import re
import struct
import tarfile
import zlib
from collections import Counter

import numpy as np
import pytest
from conftest import (
    WNIDS,
    fake_fashion_mnist,
    fake_imagenet,
    wnid_value,
    write_jpeg,
)

from data.image_datasets import read_idx
from data.shard_index import ShardSet
from data.shards import decode, raw_samples
from data.write_shards import main as write_shards


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


@pytest.mark.parametrize("mode", ["CMYK", "LAB", "F"])
def test_images_of_modes_a_png_cannot_hold_are_written_as_the_reader_converts_them(tmp_path, mode):
    """A TIFF in CMYK (or LAB, or float grey) decodes, so it is a sample: stored as the PNG of
    the RGB (or grey) image the reader would make of it, not rejected as unreadable."""
    from PIL import Image

    from data.write_shards import encode_image_file

    rgb = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3) * 5)
    img = rgb.convert(mode) if mode != "F" else rgb.convert("L").convert("F")
    (tmp_path / "src" / "c0").mkdir(parents=True)
    img.save(tmp_path / "src" / "c0" / "x.tif")
    data, ext = encode_image_file(tmp_path / "src" / "c0" / "x.tif")
    with Image.open(tmp_path / "src" / "c0" / "x.tif") as original:
        want = original.convert("RGB")  # what training would decode from the file itself
    got = Image.open(io.BytesIO(data))
    assert ext == "png" and np.array_equal(np.asarray(got.convert("RGB")), np.asarray(want))
    [index] = write_shards(["imagefolder", str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "1"])
    assert index["num_samples"] == 1 and index["rejected"]["count"] == 0


def test_bad_inputs_are_reported_not_dropped(image_folder, tmp_path, capsys):
    (image_folder / "cat" / "notes.txt").write_text("not an image")  # not an image format's name: left out
    (image_folder / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0garbage")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        write_shards(["imagefolder", str(image_folder), str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "1 of 25 files are unreadable or not images" in err and "--skip_bad" in err
    assert not (out / "train.json").exists()
    [index] = write_shards(["imagefolder", str(image_folder), str(out), "--skip_bad"])
    assert index["num_samples"] == 24 and index["rejected"]["count"] == 1
    assert any("broken.jpg" in x for x in index["rejected"]["examples"])


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height grey pixels, and no pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grey, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def test_a_decompression_bomb_is_rejected_like_an_undecodable_file(image_folder, tmp_path, capsys):
    """A 60-byte PNG whose header says 50000 x 50000: PIL refuses to open it (DecompressionBombError,
    which is no OSError), and the writer ended in that traceback."""
    (image_folder / "dog" / "bomb.png").write_bytes(_png_header(50_000, 50_000))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        write_shards(["imagefolder", str(image_folder), str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert "1 of 25 files are unreadable or not images" in err and "--skip_bad" in err
    assert not (out / "train.json").exists()
    [index] = write_shards(["imagefolder", str(image_folder), str(out), "--skip_bad"])
    assert index["num_samples"] == 24 and index["rejected"]["count"] == 1
    [example] = index["rejected"]["examples"]
    assert "bomb.png" in example and "DecompressionBombError" in example and "2500000000 pixels" in example


def test_missing_and_empty_folders(image_folder, tmp_path, capsys):
    with pytest.raises(SystemExit):
        write_shards(["imagefolder", str(tmp_path / "nope"), str(tmp_path / "out")])
    assert "does not exist" in capsys.readouterr().err
    (image_folder / "fox").mkdir()
    with pytest.raises(SystemExit):
        write_shards(["imagefolder", str(image_folder), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "hold no image files" in err and "fox" in err


@pytest.mark.parametrize("argv, says", [
    (["imagefolder", "{file}", "{out}"], "source folder {file} is a file, not a folder: give the image folder"),
    (["imagenet", "{file}", "{out}"], "ImageNet root {file} is a file, not a folder: give the folder holding train/"),
    (["fashion-mnist", "{out}", "--src", "{file}"], "--src {file} is a file, not a folder: give the folder of the"),
])
def test_an_input_folder_that_is_a_file_is_called_a_file(tmp_path, capsys, argv, says):
    file, out = tmp_path / "images.zip", tmp_path / "out"
    file.write_bytes(b"PK")
    with pytest.raises(SystemExit) as e:
        write_shards([a.format(file=file, out=out) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and says.format(file=file) in err, err
    assert not out.exists() and file.read_bytes() == b"PK"


def test_fashion_mnist_converter(tmp_path):
    src = fake_fashion_mnist(tmp_path / "fm", train=30, test=10)
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


def _digests(out, name):
    """sha256 of the index and of every shard it names, in order."""
    index = out / f"{name}.json"
    shards = [out / s["file"] for s in json.loads(index.read_text())["shards"]]
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in [index, *shards]]


def test_output_is_byte_identical_whatever_the_number_of_workers(image_folder, tmp_path):
    (image_folder / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0garbage")  # rejected examples too
    runs = {}
    for workers in ("1", "2", "2"):
        out = tmp_path / f"w{workers}_{len(runs)}"
        [index] = write_shards(["imagefolder", str(image_folder), str(out), "--samples_per_shard", "4", "--skip_bad",
                                "--workers", workers])
        runs[out] = _digests(out, "train")
    assert index["num_samples"] == 24 and index["rejected"]["count"] == 1 and len(index["shards"]) == 7
    assert sum(s["samples"] for s in index["shards"]) == 24
    first, *others = runs.values()
    assert all(d == first for d in others) and len(first) == 8
    # why they match: tar members carry one fixed mtime, owner and mode (TarWriter stamps time.time() by default)
    with tarfile.open(out / "train-000000.tar") as tar:
        stamps = {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in tar.getmembers()}
    assert len(stamps) == 1 and next(iter(stamps))[0] == 0


def test_shards_left_empty_by_skipped_files_are_dropped(image_folder, tmp_path):
    (image_folder / "eel" / "notes.txt").write_text("not an image")
    out = tmp_path / "out"
    [index] = write_shards(["imagefolder", str(image_folder), str(out), "--samples_per_shard", "1", "--skip_bad",
                            "--workers", "2"])
    assert [s["file"] for s in index["shards"]] == [f"train-{k:06d}.tar" for k in range(24)]
    assert index["pattern"] == "train-{000000..000023}.tar"
    assert sorted(p.name for p in out.iterdir()) == sorted([s["file"] for s in index["shards"]] + ["train.json"])
    samples, shards = _read_back(out / "train.json")
    assert len(samples) == shards.num_samples == 24


def test_a_shard_whose_only_file_was_rejected_is_not_listed(image_folder, tmp_path):
    # an image name holding garbage is a sample until its shard is written; with one file a shard,
    # its shard ends empty, and an index listing "samples": 0 would not load
    (image_folder / "eel" / "broken.png").write_bytes(b"not a png at all")
    out = tmp_path / "out"
    [index] = write_shards(["imagefolder", str(image_folder), str(out), "--samples_per_shard", "1", "--skip_bad",
                            "--workers", "1"])
    assert index["rejected"]["count"] == 1
    assert all(s["samples"] > 0 for s in index["shards"]) and len(index["shards"]) == 24
    samples, shards = _read_back(out / "train.json")
    assert len(samples) == shards.num_samples == 24


SORTED = sorted(WNIDS)  # timm / torchvision's class order


def _labels_match_sorted_wnids(index_path):
    samples, _ = _read_back(index_path)
    for img, label in samples:
        value = int(np.asarray(img)[8, 8, 0])
        wnid = min(WNIDS, key=lambda w: abs(wnid_value(w) - value))
        assert label == SORTED.index(wnid)
    return samples


@pytest.mark.parametrize("val", ["folders", "flat"])
def test_imagenet_layouts_label_by_sorted_wnid(tmp_path, val, capsys):
    root = fake_imagenet(tmp_path / "kaggle" / "ILSVRC" / "Data" / "CLS-LOC", val=val)
    out = tmp_path / "out"
    train, valid = write_shards(["imagenet", str(root), str(out), "--samples_per_shard", "4"])
    assert (train["name"], train["num_samples"], [s["samples"] for s in train["shards"]]) == ("train", 9, [4, 4, 1])
    assert (valid["name"], valid["num_samples"], valid["rejected"]["count"]) == ("val", 6, 0)
    assert train["classes"] == valid["classes"] == SORTED
    assert len(_labels_match_sorted_wnids(out / "train.json")) == 9
    assert len(_labels_match_sorted_wnids(out / "val.json")) == 6
    err = capsys.readouterr().err
    assert "3 classes, not ImageNet-1k's 1000" in err  # a subset: indices are not timm's
    if val == "flat":
        assert "1 of the 7 images" in err and "are not in" in err


def test_imagenet_val_alone_takes_the_class_list_of_a_written_train_index(tmp_path):
    root = fake_imagenet(tmp_path / "a" / "b" / "c" / "in", val="flat")
    write_shards(["imagenet", str(root), str(tmp_path / "out"), "--split", "train", "--workers", "1"])
    assert not (tmp_path / "out" / "val.json").exists()
    (root / "train" / SORTED[0]).rename(tmp_path / "gone")  # val/ must not depend on the folders of train/ now
    [valid] = write_shards(["imagenet", str(root), str(tmp_path / "out2"), "--split", "val",
                            "--classes_from", str(tmp_path / "out" / "train.json")])
    assert valid["classes"] == SORTED and valid["num_samples"] == 6
    _labels_match_sorted_wnids(tmp_path / "out2" / "val.json")


def test_imagenet_val_with_a_wnid_not_in_train_is_refused(tmp_path, capsys):
    root = fake_imagenet(tmp_path / "a" / "b" / "c" / "in", val="flat")
    csv = root.parents[2] / "LOC_val_solution.csv"
    csv.write_text(csv.read_text().replace(f"ILSVRC2012_val_00000002,{WNIDS[0]}", "ILSVRC2012_val_00000002,n09999999"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        write_shards(["imagenet", str(root), str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "1 image(s)" in err and "ILSVRC2012_val_00000002.JPEG: n09999999" in err and "3 training classes" in err
    assert not out.exists()  # refused before anything is written, train included
    # the folder layout: a val/<wnid>/ folder that train has not
    root = fake_imagenet(tmp_path / "f", val="folders")
    write_jpeg(root / "val" / "n09999999" / "x.JPEG", 0)
    with pytest.raises(SystemExit):
        write_shards(["imagenet", str(root), str(out)])
    assert "n09999999" in capsys.readouterr().err and not out.exists()


def test_imagenet_refusals_say_what_to_do(tmp_path, capsys):
    root = fake_imagenet(tmp_path / "a" / "b" / "c" / "in", val="flat")
    (root.parents[2] / "LOC_val_solution.csv").rename(tmp_path / "elsewhere.csv")
    with pytest.raises(SystemExit):
        write_shards(["imagenet", str(root), str(tmp_path / "out")])
    assert "--val_labels" in capsys.readouterr().err
    # given explicitly, it is read from anywhere
    [_, valid] = write_shards(["imagenet", str(root), str(tmp_path / "out"), "--val_labels",
                               str(tmp_path / "elsewhere.csv")])
    assert valid["num_samples"] == 6
    write_jpeg(root / "val" / "stray.JPEG", 0)
    with pytest.raises(SystemExit):
        write_shards(["imagenet", str(root), str(tmp_path / "out2"), "--val_labels", str(tmp_path / "elsewhere.csv")])
    assert "1 file(s)" in (err := capsys.readouterr().err) and "stray.JPEG" in err and "have no row" in err
    (root / "train" / "cats").mkdir()
    with pytest.raises(SystemExit):
        write_shards(["imagenet", str(root), str(tmp_path / "out2"), "--split", "train"])
    assert "not WordNet ids" in (err := capsys.readouterr().err) and "imagefolder" in err


def _bad_input(tmp_path, case: str) -> list[str]:
    """write_shards / index_shards arguments naming one bad input file of `case`."""
    root = fake_imagenet(tmp_path / "in", val="flat")
    bad = tmp_path / "bad"
    bad.mkdir()
    if case in ("empty idx", "not gzip"):
        name = "train-images-idx3-ubyte" + (".gz" if case == "not gzip" else "")
        (bad / name).write_bytes(b"" if case == "empty idx" else b"not gzip data")
        return ["fashion-mnist", str(tmp_path / "out"), "--src", str(bad)]
    if case in ("malformed json", "json list"):
        (bad / "i.json").write_text("{classes: [" if case == "malformed json" else '["n00000001"]')
        return ["imagenet", str(root), str(tmp_path / "out"), "--classes_from", str(bad / "i.json")]
    if case in ("missing csv", "folder csv", "binary csv"):
        path = {"missing csv": bad / "none.csv", "folder csv": bad, "binary csv": bad / "b.csv"}[case]
        (bad / "b.csv").write_bytes(b"\xff\xfe\x00binary")
        return ["imagenet", str(root), str(tmp_path / "out"), "--split", "val", "--val_labels", str(path)]
    raise AssertionError(case)


@pytest.mark.parametrize("case, says", [
    ("empty idx", r"train-images-idx3-ubyte is not an idx file of unsigned bytes \(it holds 0 bytes\)"),
    ("not gzip", r"train-images-idx3-ubyte.gz cannot be read \(BadGzipFile"),
    ("malformed json", r"--classes_from .*i.json:1:2 is not valid JSON"),
    ("json list", r"--classes_from .*i.json: the index has no 'classes' list"),
    ("missing csv", r"the val labels .*none.csv does not exist: give Kaggle's LOC_val_solution.csv"),
    ("folder csv", r"the val labels .*bad is a folder"),
    ("binary csv", r"the val labels .*b.csv cannot be read as CSV \(UnicodeDecodeError"),
])
def test_a_bad_input_file_is_refused_in_one_line(tmp_path, capsys, case, says):
    """Each ended in a traceback (struct.error, BadGzipFile, JSONDecodeError, AttributeError,
    FileNotFoundError, IsADirectoryError, UnicodeDecodeError)."""
    with pytest.raises(SystemExit) as e:
        write_shards(_bad_input(tmp_path, case))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert re.search(says, [line for line in err.splitlines() if line.startswith("error: ")][0])
    assert not (tmp_path / "out").exists()


def test_a_class_list_that_is_not_text_is_refused_in_one_line(image_folder, tmp_path, capsys):
    from data.index_shards import main as index_shards

    write_shards(["imagefolder", str(image_folder), str(tmp_path / "s")])
    (tmp_path / "names.txt").write_bytes(b"\xff\xfe\x00binary")
    status = index_shards([str(tmp_path / "s"), "--out", str(tmp_path / "i.json"), "--classes",
                           str(tmp_path / "names.txt")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "names.txt cannot be read as text (UnicodeDecodeError" in err
    assert not (tmp_path / "i.json").exists()


def _copy_without(folder, tmp_path, missing: str):
    """`folder`'s class folders but `missing`: a held-out split lacking one class."""
    import shutil

    val = tmp_path / "val_folder"
    for c in (p for p in folder.iterdir() if p.name != missing):
        shutil.copytree(c, val / c.name)
    return val


def test_imagefolder_classes_from_the_training_index_keeps_its_labels(image_folder, tmp_path, capsys):
    """A val folder without `dog` (between cat and eel), written with the training index's class list:
    eel keeps label 2, as in training, instead of moving up to 1; the index names train's classes."""
    [train] = write_shards(["imagefolder", str(image_folder), str(tmp_path / "out")])
    val = _copy_without(image_folder, tmp_path, "dog")
    [index] = write_shards(["imagefolder", str(val), str(tmp_path / "out"), "--name", "val",
                            "--classes_from", str(tmp_path / "out" / "train.json")])
    assert index["classes"] == train["classes"] == ["cat", "dog", "eel"]
    samples, shards = _read_back(tmp_path / "out" / "val.json")
    # the pixel value says the class: 0..35 cat, 100..135 eel
    assert sorted({(label, int(np.asarray(img.convert("L"))[0, 0]) // 50) for img, label in samples}) == [(0, 0),
                                                                                                       (2, 2)]
    from data.shard_index import check_scored_against
    check_scored_against(shards, ShardSet.from_index(tmp_path / "out" / "train.json"), "--val", "--train")
    (val / "fox").mkdir()  # a class the list lacks has no label
    write_jpeg(val / "fox" / "f.jpg", 9)
    with pytest.raises(SystemExit) as e:
        write_shards(["imagefolder", str(val), str(tmp_path / "out2"), "--name", "val",
                      "--classes_from", str(tmp_path / "out" / "train.json")])
    assert e.value.code == 2 and "not among the 3 classes given" in capsys.readouterr().err


def test_the_refusal_of_a_class_list_that_does_not_fit_suggests_a_fix_that_exists(image_folder, tmp_path):
    """evaluate's refusal (check_scored_against) offers --classes_from, which both writers take."""
    from data.shard_index import ShardIndexError, check_scored_against

    write_shards(["imagefolder", str(image_folder), str(tmp_path / "out")])
    write_shards(["imagefolder", str(_copy_without(image_folder, tmp_path, "dog")), str(tmp_path / "out"), "--name",
                  "val"])
    with pytest.raises(ShardIndexError, match=r"label 1 is class 'eel' .* data.write_shards imagefolder\|imagenet "
                                              r"\.\.\. --classes_from TRAIN_INDEX.json"):
        check_scored_against(ShardSet.from_index(tmp_path / "out" / "val.json"),
                             ShardSet.from_index(tmp_path / "out" / "train.json"), "--val", "--train")


def test_files_in_linked_folders_are_written_and_files_left_out_counted_by_reason(image_folder, tmp_path, capsys):
    elsewhere = tmp_path / "more_dogs"
    write_jpeg(elsewhere / "m.jpg", 60)
    (image_folder / "dog" / "linked").symlink_to(elsewhere)
    (image_folder / "cat" / "gone.jpg").symlink_to(tmp_path / "nothing.jpg")
    (image_folder / "stray.jpg").write_bytes(b"")
    [index] = write_shards(["imagefolder", str(image_folder), str(tmp_path / "out")])
    assert index["num_samples"] == 25 and index["rejected"]["count"] == 0
    out = capsys.readouterr().out
    stray, gone = image_folder / "stray.jpg", image_folder / "cat" / "gone.jpg"
    assert f"1 file(s) left out, lying beside the class folders, in none of them, e.g. {stray}" in out
    assert f"1 file(s) left out, being symbolic links to nothing, e.g. {gone}" in out


def test_temporary_shards_carry_the_pid_and_orphans_of_dead_writers_are_removed(image_folder, tmp_path, capsys,
                                                                                 monkeypatch):
    import os
    import subprocess
    import sys

    import data.write_shards as ws

    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    orphans = [out / f".train-000003.tar.tmp{dead}", out / ".train-000001.tar.tmp", out / f".train.json.tmp{dead}"]
    kept = [out / f".train-000000.tar.tmp{os.getppid()}", out / f".val-000000.tar.tmp{dead}", out / "x.tar.tmp"]
    for p in orphans + kept:
        p.write_bytes(b"half a shard")
    paths = []
    real = ws.write_one_shard
    monkeypatch.setattr(ws, "write_one_shard", lambda job: paths.append(job.path.name) or real(job))
    write_shards(["imagefolder", str(image_folder), str(out), "--samples_per_shard", "10", "--workers", "1"])
    assert paths == [f".train-{s:06d}.tar.tmp{os.getpid()}" for s in range(3)]
    assert "removed 3 temporary file(s) of 'train'" in capsys.readouterr().err
    assert not any(p.exists() for p in orphans) and all(p.exists() for p in kept)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and p.name != "x.tar.tmp") == [
        "train-000000.tar", "train-000001.tar", "train-000002.tar", "train.json"]


def test_the_output_clash_offers_only_the_subcommands_own_options(image_folder, tmp_path, capsys):
    fake_imagenet(tmp_path / "in")
    write_shards(["imagenet", str(tmp_path / "in"), str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        write_shards(["imagenet", str(tmp_path / "in"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "pass --overwrite to replace them, or give another output folder" in err and "--name" not in err
    write_shards(["imagefolder", str(image_folder), str(tmp_path / "out2")])
    with pytest.raises(SystemExit):
        write_shards(["imagefolder", str(image_folder), str(tmp_path / "out2")])
    assert "give another output folder or --name" in capsys.readouterr().err


def test_an_image_over_pils_pixel_limit_is_named_with_the_limit_and_how_to_raise_it(image_folder, tmp_path, capsys):
    """Between Image.MAX_IMAGE_PIXELS and twice it PIL only warns, naming no file: the writer names it."""
    (image_folder / "dog" / "big.png").write_bytes(_png_header(10_000, 10_000))  # 1e8 pixels, no pixel data
    write_shards(["imagefolder", str(image_folder), str(tmp_path / "out"), "--skip_bad", "--workers", "1"])
    err = capsys.readouterr().err
    assert f"warning: {image_folder / 'dog' / 'big.png'} is 10000 x 10000 = 100000000 pixels, over the limit of " \
           f"89478485 pixels" in err and "--data.max_image_pixels 100000000" in err
    assert "DecompressionBombWarning" not in err
