"""A real pretraining run on shards one of which is garbage: it ends with exit status 3 and a
message naming that shard (and how to list every bad one), instead of training on (or hanging
over) broken data, with no loader worker's traceback around the message and its checkpoints kept."""
import io
import json
import re
import tarfile

import numpy as np
import pytest
from conftest import run_pretrain
from PIL import Image

from data.shards import shards_for
from train.engine import checkpoint
from train.run.folder import read_metrics


def _tar(path, members: dict[str, bytes]):
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _garbage_shard_index(tmp_path):
    """4 shards of 8 good PNGs and one of 8 garbage JPEGs, labeled."""
    rng = np.random.default_rng(0)
    shards = {}
    for s in range(4):
        members = {}
        for k in range(8):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(buf, format="PNG")
            members |= {f"s{s}k{k}.png": buf.getvalue(), f"s{s}k{k}.cls": b"0"}
        _tar(tmp_path / f"good-{s}.tar", members)
        shards[f"good-{s}.tar"] = 8
    _tar(tmp_path / "bad.tar", {n: v for k in range(8) for n, v in ((f"b{k}.jpg", b"\xff\xd8 garbage"),
                                                                      (f"b{k}.cls", b"0"))})
    shards["bad.tar"] = 8
    index = tmp_path / "train.json"
    index.write_text(json.dumps({"shards": [{"file": f, "samples": n} for f, n in shards.items()], "classes": ["a"]}))
    return index


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_garbage_shard_ends_the_run_naming_it(tmp_path, ranks):
    """On 2 ranks one reads the garbage shard and stops the run; the other, cut off inside a
    collective, says so in one line instead of the backend's traceback."""
    index = _garbage_shard_index(tmp_path)
    proc = run_pretrain(tmp_path / "run", "--data.source", "shards", "--data.train_index", str(index),
                        "--data.epoch_size", "0", "--data.num_workers", "1", "--data.shuffle_buffer", "4",
                        "--model.in_chans", "3", "--run.max_steps", "20", "--data.max_bad_fraction", "0.05",
                        ranks=ranks, check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.count("training stopped:") == 1 and str(tmp_path / "bad.tar") in proc.stderr
    assert "undecodable_image" in proc.stderr and "data.max_bad_fraction" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def _rgb_shards(root, n_shards: int, per_shard: int) -> dict[str, int]:
    rng = np.random.default_rng(1)
    for s in range(n_shards):
        members = {}
        for k in range(per_shard):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(buf, format="PNG")
            members |= {f"s{s}k{k}.png": buf.getvalue(), f"s{s}k{k}.cls": b"0"}
        _tar(root / f"shard-{s:02d}.tar", members)
    return {f"shard-{s:02d}.tar": per_shard for s in range(n_shards)}


@pytest.mark.parametrize("fault,workers", [("truncated", 2), ("random_bytes", 1)])
def test_a_bad_shard_met_mid_run_ends_it_with_one_message_no_worker_traceback_and_its_checkpoints_kept(
        tmp_path, fault, workers):
    """A tar cut short mid-member, or a file of random bytes, met by a loader worker after some
    checkpoints: exit 3 with the message naming the shard and `python -m data.verify INDEX`, and
    no DataLoader worker traceback around it; the checkpoints written before stay complete."""
    shards = _rgb_shards(tmp_path, 12, 16)
    # the last shard worker 0 reads in the first epoch (seed 0): met after about 20 steps of 8 samples
    bad = tmp_path / sorted(shards)[shards_for(len(shards), 0, 0, 0, workers)[-1]]
    if fault == "truncated":
        data = bad.read_bytes()
        bad.write_bytes(data[:len(data) // 2 + 100])  # inside a member: its data runs past the end
    else:
        bad.write_bytes(np.random.default_rng(2).integers(0, 256, 20_000, dtype=np.uint8).tobytes())
    index = tmp_path / "train.json"
    index.write_text(json.dumps({"shards": [{"file": f, "samples": n} for f, n in shards.items()], "classes": ["a"]}))
    run_dir = tmp_path / "run"

    proc = run_pretrain(run_dir, "--data.source", "shards", "--data.train_index", str(index), "--data.epoch_size", "0",
                        "--model.in_chans", "3", "--data.num_workers", str(workers), "--data.shuffle_buffer", "4",
                        "--run.ckpt_every", "2", check=False)
    err = proc.stderr
    assert proc.returncode == 3, err[-3000:]
    assert "Traceback" not in err and "DataLoader worker" not in err, err[-3000:]
    message = err[err.index("training stopped: "):]
    assert re.search(rf"^  {re.escape(str(bad))}: \d+ samples lost \(the tar ends early", message, re.M), message
    assert f"python -m data.verify {index}" in message and "--data.verify_shards true" in message
    assert "--resume auto" in message

    latest = checkpoint.latest_complete(run_dir / "checkpoints")
    assert latest is not None and checkpoint.check_files(latest) is None  # complete, every file there
    step = checkpoint.read_meta(latest)["step"]
    assert step >= 2 and (run_dir / "checkpoints" / "latest").read_text().strip() == latest.name
    assert step <= max(r["step"] for r in read_metrics(run_dir))
