"""A real pretraining run on shards one of which is garbage: it stops with exit status 3 and a
message naming that shard, instead of training on (or hanging over) broken data."""
import io
import json
import tarfile

import numpy as np
from conftest import run_pretrain
from PIL import Image


def _tar(path, members: dict[str, bytes]):
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_garbage_shard_stops_the_run_naming_it(tmp_path):
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

    proc = run_pretrain(tmp_path / "run", "--data.source", "shards", "--data.train_index", str(index),
                        "--data.epoch_size", "0", "--data.num_workers", "1", "--data.shuffle_buffer", "4",
                        "--model.in_chans", "3", "--run.max_steps", "20", "--data.max_bad_fraction", "0.05",
                        check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "training stopped:" in proc.stderr and str(tmp_path / "bad.tar") in proc.stderr
    assert "undecodable_image" in proc.stderr and "data.max_bad_fraction" in proc.stderr
