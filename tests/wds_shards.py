"""Shards as other tools write them, for the tests of bringing your own data (docs/DATA.md): webdataset's
own ShardWriter with img2dataset's layout (an image + txt caption + json metadata, no cls; some
images webp), and shard indexes in data/index_shards.py's format written by hand."""
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image


def image_bytes(seed: int, fmt: str = "JPEG", size: int = 20) -> bytes:
    """A size x size RGB noise image encoded as `fmt` (PIL's format name)."""
    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def write_img2dataset_shards(folder: Path, shards: int = 2, per_shard: int = 8, label_field: str = "") -> list[Path]:
    """`shards` tars of `per_shard` samples written by webdataset's ShardWriter: jpg (the first of
    each shard webp) + txt + json, no cls. With `label_field`, the json carries it (label k % 3)."""
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "part-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for k in range(shards * per_shard):
            meta = {"url": f"https://example.com/{k}.jpg", "width": 20, "height": 20, "caption": f"photo {k}"}
            if label_field:
                meta[label_field] = k % 3
            ext, fmt = ("webp", "WEBP") if k % per_shard == 0 else ("jpg", "JPEG")
            sink.write({"__key__": f"{k:09d}", ext: image_bytes(k, fmt), "txt": f"photo {k}", "json": meta})
    return sorted(folder.glob("part-*.tar"))


def write_index(path: Path, tars: list[Path], counts: list[int], labeled: bool = False, label_key: str = "cls",
                classes: list[str] = (), absolute: bool = False) -> Path:
    """An index in data/index_shards.py's format: shard entries relative to the index's folder, or
    absolute paths (as the indexer writes for shards outside that folder)."""
    entries = [{"file": str(t.resolve()) if absolute else str(t.relative_to(path.parent)), "samples": n}
               for t, n in zip(tars, counts, strict=True)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "name": path.stem, "pattern": "part-{000000..000001}.tar", "shards": entries, "num_samples": sum(counts),
        "classes": list(classes), "rejected": {"count": 0, "examples": []},
        "members": {"jpg": sum(counts) - len(tars), "json": sum(counts), "txt": sum(counts), "webp": len(tars)},
        "label_key": label_key, "labeled": labeled, "labels_seen": [], "unlabeled": {"count": 0, "examples": []},
        "bad_shards": []}))
    return path


def write_tar(path: Path, members: list[tuple[str, bytes | int]]) -> Path:
    """A tar of `members` in order: (name, its bytes, or a size: a member of that many bytes written
    as a hole of a sparse file, so gigabytes cost no disk)."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if isinstance(data, int):  # the header only; the data is skipped over
                info.size = data
                tar.addfile(info)
                padded = -(-data // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                tar.fileobj.seek(padded, io.SEEK_CUR)
                tar.offset += padded
                continue
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
