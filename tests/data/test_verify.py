"""data/verify.py: shards checked from their headers before training; the pre-start option."""
import subprocess
import sys
from pathlib import Path

import pytest
from test_data_faults import image_shards, write_index, write_tar

from data.shard_index import ShardSet
from data.verify import main, verify_before_start, verify_shard, verify_shards

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def shard_dir(tmp_path) -> Path:
    """4 good shards of 4 samples, one cut inside its third sample, one garbage file, one with
    undecodable images; index 'good.json' lists the good ones, 'train.json' all."""
    good = image_shards(tmp_path, 4, 4)
    raw = (tmp_path / "ok-0.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(raw[:2 * 2048 + 700])  # 2 samples of 4 blocks, then inside the third
    (tmp_path / "garbage.tar").write_bytes(b"this is not a tar file" * 100)
    write_tar(tmp_path / "badimg.tar", [(f"b{k}", {"jpg": b"\xff\xd8garbage", "cls": b"0"}) for k in range(4)])
    write_index(tmp_path, good, name="good")
    write_index(tmp_path, {**good, "cut.tar": 4, "garbage.tar": 4, "badimg.tar": 4})
    return tmp_path


def test_each_bad_shard_is_found_with_its_reason(shard_dir):
    reports = {Path(r.file).name: r for r in verify_shards(ShardSet.from_index(shard_dir / "train.json"), workers=1)}
    assert all(reports[f"ok-{s}.tar"].ok and reports[f"ok-{s}.tar"].samples == 4 for s in range(4))
    assert set(reports["cut.tar"].problems) == {"truncated_shard", "count_mismatch"}
    assert "cut short" in reports["cut.tar"].reason() and reports["cut.tar"].samples == 2
    assert set(reports["garbage.tar"].problems) == {"not_a_tar"}
    assert reports["badimg.tar"].problems == {"undecodable_image": 4}


def test_a_shard_cut_at_a_member_boundary_is_found(tmp_path):
    image_shards(tmp_path, 1, 4)
    path = tmp_path / "ok-0.tar"
    path.write_bytes(path.read_bytes()[:2048])  # exactly one whole sample: tarfile itself ends without a word
    report = verify_shard(path, 1)  # even when the index agrees with what is left
    assert "truncated_shard" in report.problems and "end-of-archive" in report.reason()


def test_a_shard_cut_at_a_member_boundary_with_garbage_after_it_is_found(tmp_path):
    # the end-of-archive marker is two zero blocks: two blocks of anything else are no end
    image_shards(tmp_path, 1, 4)
    path = tmp_path / "ok-0.tar"
    path.write_bytes(path.read_bytes()[:2048] + b"\xff" * 2048)
    report = verify_shard(path, 1)
    assert "truncated_shard" in report.problems and "end-of-archive" in report.reason()


def test_only_headers_are_read(shard_dir, monkeypatch):
    from PIL import Image

    def no_pixels(self, *a, **k):
        raise AssertionError("pixels decoded")

    monkeypatch.setattr(Image.Image, "load", no_pixels)
    monkeypatch.setattr(Image.Image, "convert", no_pixels)
    assert all(r.ok for r in verify_shards(ShardSet.from_index(shard_dir / "good.json"), workers=1))


def test_the_command_lists_bad_shards_in_parallel_and_exits_nonzero(shard_dir):
    proc = subprocess.run([sys.executable, "-m", "data.verify", str(shard_dir / "train.json"), "--workers", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    bad = [line for line in proc.stdout.splitlines() if line.startswith("BAD")]
    assert sorted(Path(line.split()[1].rstrip(":")).name for line in bad) == ["badimg.tar", "cut.tar", "garbage.tar"]
    assert "4 of 7 shards good, 3 bad" in proc.stdout
    assert main([str(shard_dir / "good.json"), "--workers", "2"]) == 0
    assert main([str(shard_dir / "nowhere.json")]) == 2


def test_verify_shards_checks_the_evaluation_index_too(tmp_path):
    from train.config.options import DataConfig

    write_index(tmp_path, image_shards(tmp_path, 2, 4), name="train")
    (tmp_path / "garbage.tar").write_bytes(b"this is not a tar file" * 100)
    write_index(tmp_path, {"garbage.tar": 4}, name="val")
    cfg = DataConfig(train_index=str(tmp_path / "train.json"), verify_shards=True)
    verify_before_start(cfg)  # the training shards are good
    cfg = DataConfig(train_index=str(tmp_path / "train.json"), eval_index=str(tmp_path / "val.json"),
                     verify_shards=True)
    with pytest.raises(ValueError, match="garbage.tar") as e:
        verify_before_start(cfg)
    assert "ok-0.tar" not in str(e.value)


def test_verify_shards_refuses_the_run_before_start(shard_dir, tmp_path):
    from conftest import run_pretrain

    args = ["--data.source", "shards", "--data.train_index", str(shard_dir / "train.json"), "--model.in_chans", "3",
            "--data.num_workers", "0", "--run.max_steps", "1", "--data.verify_shards", "true"]
    proc = run_pretrain(tmp_path / "run", *args, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stdout + proc.stderr
    assert "cut.tar" in err and "garbage.tar" in err and "badimg.tar" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before the run folder is written
