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
from data.shard_index import ShardSet

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


def test_the_writer_stores_16_bit_grey_of_any_byte_order_as_the_reader_reads_the_original(tmp_path):
    """A big-endian 16-bit TIFF (I;16B) was stored as convert("L"), which clips every value above
    255 to white: [0, 256, 32768, 65535] read back as [0, 255, 255, 255], not [0, 1, 128, 255]."""
    import numpy as np

    from data.image_modes import to_rgb
    from data.write_shards import encode_image_file

    values = np.array([[0, 256, 32768, 65535]] * 2, dtype=np.uint16)
    for name, image in (("big_endian", Image.fromarray(values.astype(">u2"))),
                        ("thirty_two_bit", Image.fromarray(values.astype(np.int32), mode="I"))):
        path = tmp_path / f"{name}.tif"
        image.save(path)
        original = np.asarray(to_rgb(Image.open(path)))
        data, ext = encode_image_file(path)
        stored = Image.open(io.BytesIO(data))
        assert ext == "png" and stored.mode == "I;16", name
        assert np.asarray(to_rgb(stored)).tolist() == original.tolist(), name
        assert original[0, :, 0].tolist() == [0, 1, 128, 255], name
