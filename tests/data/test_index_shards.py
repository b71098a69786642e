"""data/index_shards.py: an index for shards written elsewhere (webdataset's ShardWriter,
img2dataset), read by ShardSet.from_index."""
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image
from wds_shards import write_tar

from data.index_shards import main
from data.labels import LabelKey
from data.shard_index import ShardSet
from data.shards import open_sample, raw_samples

REPO = Path(__file__).resolve().parents[2]


def image(fmt: str, value: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (value, 255 - value, 7)).save(buf, format=fmt)
    return buf.getvalue()


def shardwriter(folder: Path, prefix: str, samples: list[dict], per_shard: int) -> list[Path]:
    """Shards as webdataset's own ShardWriter writes them: <prefix>-000000.tar, ..."""
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / f"{prefix}-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for s in samples:
            sink.write(s)
    return sorted(folder.glob(f"{prefix}-*.tar"))


def labeled(n: int) -> list[dict]:
    return [{"__key__": f"k{i:04d}", "jpg": image("JPEG", 20 * i), "cls": i % 3} for i in range(n)]


def index(*argv: str) -> tuple[int, dict | None]:
    out = Path(argv[argv.index("--out") + 1])
    rc = main(list(argv))
    return rc, json.loads(out.read_text()) if out.is_file() else None


def test_shardwriter_shards_with_labels_from_a_brace_pattern(tmp_path):
    shardwriter(tmp_path / "wds", "train", labeled(10), 4)
    rc, idx = index(str(tmp_path / "wds" / "train-{000000..000002}.tar"), "--out", str(tmp_path / "wds" / "train.json"))
    assert rc == 0
    assert idx["shards"] == [{"file": "train-000000.tar", "samples": 4}, {"file": "train-000001.tar", "samples": 4},
                             {"file": "train-000002.tar", "samples": 2}]  # under the index's folder: relative
    assert idx["num_samples"] == 10 and idx["labeled"] is True and idx["label_key"] == "cls"
    assert idx["classes"] == ["0", "1", "2"] and idx["labels_seen"] == [0, 1, 2]
    assert idx["members"] == {"cls": 10, "jpg": 10} and idx["rejected"]["count"] == 0 and idx["bad_shards"] == []
    shards = ShardSet.from_index(tmp_path / "wds" / "train.json")
    assert shards.counts == (4, 4, 2) and shards.num_samples == 10 and shards.classes == ("0", "1", "2")
    read = {s["__key__"]: open_sample(s)[1] for s in raw_samples(list(shards.files), errors={})}
    assert read == {f"k{i:04d}": i % 3 for i in range(10)}


def test_unlabeled_shardwriter_shards_from_a_folder_elsewhere(tmp_path):
    shardwriter(tmp_path / "wds", "u", [{"__key__": f"k{i}", "jpg": image("JPEG", i)} for i in range(6)], 4)
    out = tmp_path / "indexes" / "u.json"
    rc, idx = index(str(tmp_path / "wds"), "--out", str(out))
    assert rc == 0
    assert [e["file"] for e in idx["shards"]] == [str(tmp_path / "wds" / f"u-00000{s}.tar") for s in (0, 1)]
    assert idx["labeled"] is False and idx["classes"] == [] and idx["labels_seen"] == []
    assert idx["unlabeled"]["count"] == 6 and idx["unlabeled"]["examples"][0] == "u-000000.tar/k0: missing_cls: no cls member"
    assert idx["members"] == {"jpg": 6}
    shards = ShardSet.from_index(out)  # absolute entries are kept as they are
    assert shards.files == (tmp_path / "wds" / "u-000000.tar", tmp_path / "wds" / "u-000001.tar")
    assert shards.counts == (4, 2) and shards.classes == () and shards.labeled is False
    read = [open_sample(s, labels=shards.labels)[1] for s in raw_samples(list(shards.files), errors={})]
    assert read == [None] * 6  # the reader reads an unlabeled index without labels


def test_img2dataset_layout_jpg_and_webp_with_txt_and_json(tmp_path):
    """img2dataset: <shard>.tar beside <shard>.parquet and <shard>_stats.json; keys are 9 digits."""
    folder = tmp_path / "laion"
    folder.mkdir()
    for shard, fmt in (("00000", "jpg"), ("00001", "webp")):
        members = []
        for k in range(3):
            key = f"{shard}{k:04d}"
            members += [(f"{key}.{fmt}", image("JPEG" if fmt == "jpg" else "WEBP", k)),
                        (f"{key}.txt", b"a caption"), (f"{key}.json", json.dumps({"key": key, "status": "success",
                                                                                    "caption": "a caption"}).encode())]
        write_tar(folder / f"{shard}.tar", members)
        (folder / f"{shard}.parquet").write_bytes(b"PAR1")
        (folder / f"{shard}_stats.json").write_text("{}")
    write_tar(folder / "00002.tar", [("000020000.webp", image("WEBP", 1)), ("000020000.txt", b"x"),
                                     ("000020001.txt", b"no image"), ("000020001.json", b"{}"),
                                     ("000020002.jpg", b""), ("000020002.txt", b"an empty image")])
    rc, idx = index(str(folder), "--out", str(folder / "laion.json"))
    assert rc == 0
    assert idx["shards"] == [{"file": "00000.tar", "samples": 3}, {"file": "00001.tar", "samples": 3},
                             {"file": "00002.tar", "samples": 1}]
    assert idx["members"] == {"jpg": 3, "json": 6, "txt": 7, "webp": 4} and idx["labeled"] is False
    assert idx["rejected"] == {"count": 2, "examples": ["00002.tar/000020001: no image member (members: json, txt)",
                                                        "00002.tar/000020002: the jpg member is empty"]}
    assert ShardSet.from_index(folder / "laion.json").num_samples == 7


def test_keys_are_grouped_as_webdataset_groups_them(tmp_path):
    """The key ends at the first dot of the file name (webdataset's base_plus_ext); dots in folder
    names belong to the key; extensions are lower-cased."""
    write_tar(tmp_path / "keys.tar", [("v1.2/a.JPG", image("JPEG", 1)), ("v1.2/a.cls", b"1"),
                                      ("b.0.jpg", image("JPEG", 2)), ("b.0.cls", b"0"),
                                      ("c.png", image("PNG", 3)), ("c.cls", b"0")])
    rc, idx = index(str(tmp_path / "keys.tar"), "--out", str(tmp_path / "keys.json"))
    assert rc == 0 and idx["num_samples"] == 2 and idx["members"] == {"cls": 2, "jpg": 1, "png": 1}
    assert idx["rejected"]["examples"] == ["keys.tar/b: no image member (members: 0.cls, 0.jpg)"]
    assert idx["labeled"] is True and idx["classes"] == ["0", "1"]


def test_the_same_index_whatever_the_number_of_workers(tmp_path):
    shardwriter(tmp_path, "w", labeled(9), 2)
    write_tar(tmp_path / "w-000099.tar", [("x.txt", b"no image"), ("y.jpg", image("JPEG", 5)), ("y.cls", b"2")])
    texts = []
    for workers in ("1", "2"):
        out = tmp_path / workers / "w.json"
        assert main([str(tmp_path), "--out", str(out), "--workers", workers]) == 0
        texts.append(out.read_text())
    assert texts[0] == texts[1]
    idx = json.loads(texts[0])
    assert [e["samples"] for e in idx["shards"]] == [2, 2, 2, 2, 1, 1] and idx["rejected"]["count"] == 1


def test_bad_shards_are_named_and_nothing_is_written_unless_skipped(tmp_path, capsys):
    files = shardwriter(tmp_path, "s", labeled(12), 4)
    raw = files[0].read_bytes()
    with tarfile.open(files[0]) as tar:
        second = tar.getmembers()[1]  # k0000's image (k0000.cls comes first)
    (tmp_path / "cut.tar").write_bytes(raw[:second.offset_data + 100])  # inside the image's data
    (tmp_path / "header.tar").write_bytes(raw[:second.offset + 200])  # inside its header
    (tmp_path / "boundary.tar").write_bytes(raw[:second.offset])  # after one whole member: no end-of-archive marker
    (tmp_path / "garbage.tar").write_bytes(b"not a tar file" * 200)
    out = tmp_path / "idx" / "s.json"
    args = [str(tmp_path), "--out", str(out), "--workers", "2"]
    assert main(args) == 1 and not out.exists()
    err = capsys.readouterr().err
    for name, why in (("cut.tar", "member k0000.jpg is cut short"), ("header.tar", "cut short or damaged"),
                      ("boundary.tar", "no end-of-archive marker"), ("garbage.tar", "not a tar")):
        line = next(line for line in err.splitlines() if line.startswith("BAD") and name in line)
        assert why in line, line
    assert "4 of 7 shards are bad" in err and "--skip_bad" in err
    rc, idx = index(*args, "--skip_bad")
    assert rc == 0 and [Path(e["file"]).name for e in idx["shards"]] == [f.name for f in files]
    assert sorted(Path(b["file"]).name for b in idx["bad_shards"]) == ["boundary.tar", "cut.tar", "garbage.tar",
                                                                                "header.tar"]
    assert idx["num_samples"] == 12 and idx["labeled"] is True


def test_label_from_a_json_field_with_class_names(tmp_path, capsys):
    samples = [{"__key__": f"k{i}", "jpg": image("JPEG", i), "json": {"label": i % 4, "url": "x"}} for i in range(8)]
    shardwriter(tmp_path, "j", samples, 8)
    (tmp_path / "names.txt").write_text("cat\ndog\nbird\nfish\n\n")
    rc, idx = index(str(tmp_path / "j-000000.tar"), "--out", str(tmp_path / "j.json"), "--label_key", "json:label",
                    "--classes", str(tmp_path / "names.txt"))
    assert rc == 0 and idx["labeled"] is True and idx["label_key"] == "json:label"
    assert idx["classes"] == ["cat", "dog", "bird", "fish"] and idx["labels_seen"] == [0, 1, 2, 3]
    shards = ShardSet.from_index(tmp_path / "j.json")
    assert shards.classes == ("cat", "dog", "bird", "fish") and shards.labels == LabelKey("json", "label")
    assert [open_sample(s, labels=shards.labels)[1] for s in raw_samples(list(shards.files), {})] == [0, 1, 2, 3] * 2
    (tmp_path / "names.txt").write_text("cat\ndog\n")  # labels 2 and 3 have no name
    assert main([str(tmp_path / "j-000000.tar"), "--out", str(tmp_path / "k.json"), "--label_key", "json:label",
                 "--classes", str(tmp_path / "names.txt")]) == 2
    assert "label 3 does not fit the 2 names" in capsys.readouterr().err and not (tmp_path / "k.json").exists()
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "j-000000.tar"), "--out", str(tmp_path / "k.json"), "--label_key", "json:"])
    assert e.value.code == 2 and "--label_key" in capsys.readouterr().err
    rc, idx = index(str(tmp_path / "j-000000.tar"), "--out", str(tmp_path / "m.json"), "--label_key", "json:class")
    assert rc == 0 and idx["labeled"] is False and idx["classes"] == []
    assert idx["unlabeled"]["examples"][0] == "j-000000.tar/k0: missing_cls: the json member has no field 'class'"


def test_a_label_equal_to_the_number_of_class_names_is_refused(tmp_path, capsys):
    # labels 0..2 need 3 names: with 2, label 2 would index past the list
    shardwriter(tmp_path, "c", labeled(6), 6)
    (tmp_path / "names.txt").write_text("cat\ndog\n")
    assert main([str(tmp_path / "c-000000.tar"), "--out", str(tmp_path / "c.json"),
                 "--classes", str(tmp_path / "names.txt")]) == 2
    assert "label 2 does not fit the 2 names" in capsys.readouterr().err and not (tmp_path / "c.json").exists()
    (tmp_path / "names.txt").write_text("cat\ndog\nbird\n")
    rc, idx = index(str(tmp_path / "c-000000.tar"), "--out", str(tmp_path / "c.json"),
                    "--classes", str(tmp_path / "names.txt"))
    assert rc == 0 and idx["classes"] == ["cat", "dog", "bird"] and idx["labels_seen"] == [0, 1, 2]


def test_labels_that_are_not_integers_leave_the_index_unlabeled(tmp_path, capsys):
    write_tar(tmp_path / "l.tar", [("a.jpg", image("JPEG", 1)), ("a.cls", b"3"), ("b.jpg", image("JPEG", 2)),
                                   ("b.cls", b"dog"), ("c.jpg", image("JPEG", 3)), ("c.cls", b"-1")])
    rc, idx = index(str(tmp_path / "l.tar"), "--out", str(tmp_path / "l.json"))
    assert rc == 0 and idx["labeled"] is False and idx["classes"] == [] and idx["labels_seen"] == [3]
    assert idx["unlabeled"]["examples"] == ["l.tar/b: bad_label: b'dog' is not an integer",
                                             "l.tar/c: bad_label: -1 is negative"]
    (tmp_path / "names.txt").write_text("\n".join("abcd"))
    assert main([str(tmp_path / "l.tar"), "--out", str(tmp_path / "n.json"), "--classes",
                 str(tmp_path / "names.txt")]) == 2
    assert "--classes given, but 2 samples have no cls label" in capsys.readouterr().err


def test_a_label_member_too_large_to_read_leaves_its_sample_unlabeled_unread(tmp_path):
    """A label member over 1 MiB (data/shards.py member_limit) is judged from its header: never read."""
    shard = write_tar(tmp_path / "big.tar", [("a.jpg", image("JPEG", 1)), ("a.cls", b"3"),
                                             ("b.jpg", image("JPEG", 2)), ("b.cls", (1 << 20) + 1),
                                             ("c.jpg", image("JPEG", 3)), ("c.cls", 5 << 30)])
    expected = ["big.tar/b: oversized_member: the cls member is 1,048,577 bytes, over the 1,048,576 read of a label",
                "big.tar/c: oversized_member: the cls member is 5,368,709,120 bytes, over the 1,048,576 read of a "
                "label"]
    rc, idx = index(str(shard), "--out", str(tmp_path / "big.json"))
    assert rc == 0 and idx["num_samples"] == 3 and idx["labeled"] is False and idx["labels_seen"] == [3]
    assert idx["unlabeled"]["examples"] == expected
    # from a command's output the same (the stream is read through, not held): only the 1 MiB one here
    small = write_tar(tmp_path / "small.tar", [("a.jpg", image("JPEG", 1)), ("a.cls", b"3"),
                                               ("b.jpg", image("JPEG", 2)), ("b.cls", (1 << 20) + 1)])
    rc, idx = index(f"pipe:cat {small}", "--out", str(tmp_path / "pipe.json"), "--allow_pipe_urls")
    assert rc == 0 and idx["num_samples"] == 2 and idx["labels_seen"] == [3]
    assert idx["unlabeled"]["examples"] == [expected[0].replace("big.tar", "small.tar")]


def test_pipe_shards_need_the_opt_in_and_urls_are_refused(tmp_path, capsys):
    shard = shardwriter(tmp_path, "p", labeled(3), 3)[0]
    out = tmp_path / "p.json"
    assert main([f"pipe:cat {shard}", "--out", str(out)]) == 2 and "--allow_pipe_urls" in capsys.readouterr().err
    assert main(["https://host/p-000000.tar", "--out", str(out)]) == 2 and "pipe:" in capsys.readouterr().err
    rc, idx = index(f"pipe:cat {shard}", "--out", str(out), "--allow_pipe_urls")
    assert rc == 0 and idx["shards"] == [{"file": f"pipe:cat {shard}", "samples": 3}] and idx["labeled"] is True
    assert ShardSet.from_index(out, allow_pipe_urls=True).counts == (3,)


def test_repeated_shard_names_are_refused(tmp_path, capsys):
    for sub in ("a", "b"):
        shardwriter(tmp_path / sub, "x", labeled(2), 2)
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "x.json")]) == 2
    assert "shard names repeat (['x-000000.tar'])" in capsys.readouterr().err


def test_the_command_runs_from_the_root_in_parallel_and_has_help(tmp_path):
    shardwriter(tmp_path, "c", labeled(6), 2)
    proc = subprocess.run([sys.executable, "-m", "data.index_shards", str(tmp_path / "c-{000000..000002}.tar"),
                           "--out", str(tmp_path / "c.json"), "--workers", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "6 samples in 3 shards, labeled (3 classes, label key cls)" in proc.stdout
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0


def test_an_out_file_of_json_nested_too_deep_is_not_taken_for_an_index_of_ours(tmp_path, capsys):
    """--out is replaced without --overwrite only when it holds an index this command wrote; a file
    of JSON nested past the recursion limit ended that check in a RecursionError traceback."""
    shardwriter(tmp_path / "wds", "train", labeled(4), 4)
    out = tmp_path / "deep.json"
    out.write_text("[" * 100_000 + "]" * 100_000)
    rc = main([str(tmp_path / "wds"), "--out", str(out)])
    assert rc == 2 and "exists already: pass --overwrite to replace it" in capsys.readouterr().err
    assert out.read_text().startswith("[[[")


def test_class_names_that_do_not_fit_the_writers_class_list_are_refused(image_folder, tmp_path, capsys):
    """Shards data.write_shards wrote from a val folder without `dog` hold eel as label 1 (its own
    class list cat, eel): train's names (cat, dog, eel) would call every eel a dog. Refused, naming the
    fix; without --classes the writer's names are taken; shards written with train's list index with it."""
    import shutil

    from data.write_shards import main as write_shards

    val = tmp_path / "val_folder"
    for c in ("cat", "eel"):
        shutil.copytree(image_folder / c, val / c)
    shards = tmp_path / "val_shards"
    write_shards(["imagefolder", str(val), str(shards), "--name", "val", "--samples_per_shard", "4"])
    (tmp_path / "names.txt").write_text("cat\ndog\neel\n")
    assert main([str(shards), "--out", str(tmp_path / "val2.json"), "--classes", str(tmp_path / "names.txt")]) == 2
    err = capsys.readouterr().err
    assert "wrote its label 1 as class 'eel'" in err and "--classes line 2 names 'dog'" in err
    assert f"(the classes of {shards / 'val.json'})" in err and "--classes_from TRAIN_INDEX.json" in err
    assert not (tmp_path / "val2.json").exists()
    rc, idx = index(str(shards), "--out", str(tmp_path / "val3.json"))
    assert rc == 0 and idx["classes"] == ["cat", "eel"] and idx["labels_seen"] == [0, 1]
    write_shards(["imagefolder", str(image_folder), str(tmp_path / "train_shards")])
    write_shards(["imagefolder", str(val), str(shards), "--name", "val", "--overwrite",
                  "--classes_from", str(tmp_path / "train_shards" / "train.json")])
    rc, idx = index(str(shards), "--out", str(tmp_path / "val4.json"), "--classes", str(tmp_path / "names.txt"))
    assert rc == 0 and idx["classes"] == ["cat", "dog", "eel"] and idx["labels_seen"] == [0, 2]
