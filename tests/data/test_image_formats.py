"""Image members beyond jpg / png: webp (img2dataset's default) is read as a standard
format; other formats PIL decodes (bmp, tif, gif, ...) are read and counted as converted
(`data_converted_other_format`); the count survives a resume (data/shards.py IMAGE_KEYS,
data/image_modes.py)."""
import io
import json
import tarfile

from PIL import Image, features
from wds_shards import image_bytes

from data.loader import ShardLoader
from data.shards import ShardSet

SAMPLES = [("webp", "WEBP"), ("bmp", "BMP"), ("tif", "TIFF"), ("gif", "GIF"), ("jpg", "JPEG"), ("png", "PNG"),
           ("tga", "TGA"), ("ppm", "PPM")]  # 3 standard formats, 5 others


def write_shard(root):
    with tarfile.open(root / "formats.tar", "w") as tar:
        for k, (ext, fmt) in enumerate(SAMPLES):
            for member, data in ((ext, image_bytes(k, fmt)), ("cls", str(k % 2).encode())):
                info = tarfile.TarInfo(f"s{k}.{member}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    index = root / "formats.json"
    index.write_text(json.dumps({"shards": [{"file": "formats.tar", "samples": len(SAMPLES)}], "classes": ["a", "b"]}))
    return index


def loader(index):
    return ShardLoader(ShardSet.from_index(index), 16, batch_size=4, seed=0, rank=0, world=1, num_workers=0,
                       shuffle_buffer=1)


def test_the_installed_pil_decodes_webp():
    assert features.check("webp")
    assert Image.open(io.BytesIO(image_bytes(0, "WEBP"))).format == "WEBP"


def test_webp_and_formats_only_pil_decodes_are_read_and_the_others_counted(tmp_path):
    stream = loader(write_shard(tmp_path))
    labels = next(stream)["label"].tolist() + next(stream)["label"].tolist()  # the epoch: 8 samples
    assert sorted(labels) == [0] * 4 + [1] * 4  # every sample delivered, none skipped
    counts = stream.counters()
    assert all(v == 0 for k, v in counts.items() if k.startswith("data_skipped_")), counts
    assert counts["data_converted_other_format"] == 5  # bmp, tif, gif, tga, ppm
    assert counts["data_converted_other_mode"] == 1  # the GIF's palette, counted beside its format


def test_the_format_count_survives_a_resume(tmp_path):
    index = write_shard(tmp_path)
    first = loader(index)
    next(first)
    resumed = loader(index)
    resumed.load_state_dict(first.state_dict())
    assert resumed.counters()["data_converted_other_format"] == first.counters()["data_converted_other_format"] > 0
    next(resumed)
    assert resumed.counters()["data_converted_other_format"] == 5
