"""Faults in training shards: bad samples skipped and counted by kind, odd image modes converted,
empty or unsafe shard indexes (data/faults.py, data/shards.py, data/shard_index.py); the
corrupt-fraction limit that ends a run: test_corrupt_fraction.py."""
import io
import json
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from wds_shards import write_tar as write_members

from data.device_decode import DeviceDecoder, EncodedCropTransform
from data.faults import ERROR_KINDS, CorruptDataError, SampleError, ShardIndexError
from data.loader import ShardLoader
from data.shard_index import PipeShard, ShardSet
from data.shards import ShardStream, open_sample, raw_samples
from data.source import _shard_loader
from data.transforms import EvalTransform, MultiCropTransform, PretrainTransform, decode_rgb
from train.config.errors import ConfigError
from train.config.options import DataConfig, PretrainConfig

REPO = Path(__file__).resolve().parents[2]


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def rgb(value=(200, 50, 100), size=(8, 8)) -> Image.Image:
    return Image.new("RGB", size, value)


def write_tar(path: Path, samples: list[tuple[str, dict[str, bytes | int]]]) -> Path:
    """samples: (key, {extension: bytes, or a size: that many zero bytes, a hole of a sparse file}) in order."""
    return write_members(path, [(f"{key}.{ext}", data) for key, members in samples for ext, data in members.items()])


# The most read of a member (data/shards.py): an image member, an uncompressed image of max_image_pixels
# pixels at 8 bytes a pixel plus 16 MiB of metadata; any other member (a label, a JSON record) 1 MiB.
def image_member_limit(max_pixels: int) -> int:
    return 8 * max_pixels + (16 << 20)


OTHER_MEMBER_LIMIT = 1 << 20


def write_index(root: Path, shards: dict[str, int], name="train") -> Path:
    """shards: file entry -> sample count."""
    index = root / f"{name}.json"
    index.write_text(json.dumps({"shards": [{"file": f, "samples": n} for f, n in shards.items()],
                                 "classes": ["a", "b", "c"]}))
    return index


def good(key: str, label: int, value=(200, 50, 100)) -> tuple[str, dict[str, bytes]]:
    return key, {"png": encoded(rgb(value), "PNG"), "cls": str(label).encode()}


def image_shards(root: Path, n_shards: int, per_shard: int) -> dict[str, int]:
    """n_shards tars of good 8x8 PNGs (label = shard index)."""
    for s in range(n_shards):
        write_tar(root / f"ok-{s}.tar", [good(f"s{s}k{k}", s % 3, (10 * k, 20 * s, 99)) for k in range(per_shard)])
    return {f"ok-{s}.tar": per_shard for s in range(n_shards)}


@pytest.fixture
def zoo(tmp_path) -> Path:
    """Every kind of bad and convertible sample once per epoch; 10 usable samples per epoch.
    Usable samples have labels 0-2; a delivered label 9 would be a bad sample let through."""
    sixteen = Image.fromarray(np.full((8, 8), 32768, np.uint16))  # mode I;16
    write_tar(tmp_path / "zoo-0.tar", [
        ("gray", {"png": encoded(Image.new("L", (8, 8), 77), "PNG"), "cls": b"0"}),  # kept, not counted
        ("rgbjpg", {"jpg": encoded(rgb(), "JPEG"), "cls": b"0"}),
        ("cmyk", {"jpg": encoded(rgb().convert("CMYK"), "JPEG"), "cls": b"1"}),
        ("sixteen", {"png": encoded(sixteen, "PNG"), "cls": b"1"}),
        ("garbage", {"jpg": b"\xff\xd8 not a jpeg at all", "cls": b"9"}),
        ("empty", {"png": b"", "cls": b"9"}),
        ("nolabel", {"png": encoded(rgb(), "PNG")}),
        ("badlabel", {"png": encoded(rgb(), "PNG"), "cls": b"cat"}),
    ])
    write_tar(tmp_path / "zoo-1.tar", [
        ("palette", {"png": encoded(rgb().convert("P"), "PNG"), "cls": b"2"}),
        ("alpha", {"png": encoded(rgb().convert("RGBA"), "PNG"), "cls": b"2"}),
        ("noimage", {"cls": b"9"}),
        ("bomb", {"png": encoded(rgb(size=(40, 40)), "PNG"), "cls": b"9"}),  # 1600 px > the limit of 1000
        ("huge", {"png": image_member_limit(1000) + 1, "cls": b"9"}),  # too large to be read
        *[good(f"plain{k}", 0) for k in range(2)],
    ])
    cut = write_tar(tmp_path / "zoo-2.tar", [good(f"t{k}", 1) for k in range(4)])
    cut.write_bytes(cut.read_bytes()[:2 * 2048 + 512 + 10])  # 2 samples of 4 blocks, then inside t2's png
    return write_index(tmp_path, {"zoo-0.tar": 8, "zoo-1.tar": 7, "zoo-2.tar": 4})


def zoo_loader(index: Path, **kw) -> ShardLoader:
    return ShardLoader(ShardSet.from_index(index), 16, batch_size=2, seed=0, rank=0, world=1, num_workers=0,
                       shuffle_buffer=4, max_image_pixels=1000, **kw)


def test_every_bad_sample_is_skipped_and_every_odd_mode_converted_counted_by_kind(zoo):
    loader = zoo_loader(zoo)
    labels = torch.cat([next(loader)["label"] for _ in range(6)])  # 12 samples: epoch 0 done, epoch 1 not
    assert set(labels.tolist()) <= {0, 1, 2}  # training goes on with usable samples only
    counts = loader.counters()
    for kind in ERROR_KINDS:  # each fault once per epoch
        assert 1 <= counts[f"data_skipped_{kind}"] <= 2, kind
    assert 1 <= counts["data_converted_cmyk"] <= 2 and 1 <= counts["data_converted_16bit"] <= 2
    assert 2 <= counts["data_converted_other_mode"] <= 4  # palette + RGBA
    assert {k for k in counts if k.startswith("data_converted_")} == \
        {"data_converted_cmyk", "data_converted_16bit", "data_converted_other_mode",
         "data_converted_other_format"}  # grayscale is not counted (other_format: BMP / TIFF / ... are)


def test_resume_keeps_the_counts_without_counting_twice(zoo):
    straight = zoo_loader(zoo)
    for _ in range(9):
        next(straight)
    first = zoo_loader(zoo)
    for _ in range(4):
        next(first)
    resumed = zoo_loader(zoo)
    resumed.load_state_dict(first.state_dict())
    assert resumed.counters() == first.counters()
    for _ in range(5):
        next(resumed)
    assert resumed.counters() == straight.counters()
    assert straight.counters()["data_converted_other_mode"] > 0 and straight.counters()["data_skipped_empty_image"] > 0


def test_positions_saved_before_the_new_kinds_still_load(zoo):
    loader = zoo_loader(zoo)
    next(loader)
    old = {k: v for k, v in loader.state_dict().items() if k != "converted"}
    old["errors"] = [1, 2, 3, 4, 5]  # the five kinds of the earlier format
    again = zoo_loader(zoo)
    again.load_state_dict(old)
    counts = again.counters()
    assert counts["data_skipped_truncated_shard"] == 5 and counts["data_skipped_empty_image"] == 0
    assert counts["data_converted_cmyk"] == 0


def test_cmyk_jpeg_becomes_the_rgb_pil_makes():
    data = encoded(rgb((200, 50, 100), (16, 16)).convert("CMYK"), "JPEG", quality=95)
    img = Image.open(io.BytesIO(data))
    assert img.mode == "CMYK"
    ours = decode_rgb(img, data)
    pil = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)
    assert ours.shape == (3, 16, 16) and (ours.int() - pil.int()).abs().max() <= 2
    assert (ours.float().mean((1, 2)) - torch.tensor([200.0, 50.0, 100.0])).abs().max() < 4  # not inverted


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])  # PNG 16-bit grey opens as I;16; mode I as well
def test_16bit_grey_is_scaled_to_8_bits_not_clipped(dtype):
    values = np.array([[0, 256, 32768, 65535]], dtype=dtype).repeat(4, 0)
    img = Image.fromarray(values) if dtype == np.uint16 else Image.fromarray(values).convert("I")
    assert img.convert("RGB").getpixel((2, 0)) == (255, 255, 255)  # PIL's own conversion saturates
    out = decode_rgb(img)
    assert out.shape == (3, 4, 4) and out[:, 0].tolist() == [[0, 1, 128, 255]] * 3
    png = Image.open(io.BytesIO(encoded(Image.fromarray(values.astype(np.uint16)), "PNG")))
    e = EvalTransform(4, crop_pct=1.0)(png)  # the same conversion on the evaluation path
    assert e.shape == (3, 4, 4) and abs(float(e[0, 0, 2]) * 0.229 + 0.485 - 128 / 255) < 0.02


@pytest.mark.parametrize("size", [(2000, 3), (3, 2000)])
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_extreme_aspect_ratios_crop_to_the_requested_shape(size, fmt):
    data = encoded(rgb((10, 200, 30), size), fmt)
    opened = lambda: Image.open(io.BytesIO(data))  # noqa: E731
    # no crop of scale >= 0.2 fits: torchvision's fallback, the central crop of the nearest allowed aspect
    from torchvision.transforms import RandomResizedCrop

    crop = PretrainTransform(16).crop_params(opened(), 1)
    with torch.random.fork_rng(devices=[]):  # get_params draws from the global RNG
        want = RandomResizedCrop.get_params(opened(), [0.2, 1.0], [3 / 4, 4 / 3])
    assert (crop.i, crop.j, crop.h, crop.w) == want
    width, height = size
    side = round(min(size) * 4 / 3)  # the long side of a 4:3 (or 3:4) crop across the whole short side
    if width > height:
        assert (crop.i, crop.j, crop.h, crop.w) == (0, (width - side) // 2, height, side)
    else:
        assert (crop.i, crop.j, crop.h, crop.w) == ((height - side) // 2, 0, side, width)
    for t in (PretrainTransform(16), PretrainTransform(16, decode="cpu_draft")):
        out = t(opened(), 1, data)
        assert out.shape == (3, 16, 16) and (out.float().mean((1, 2)) - torch.tensor([10.0, 200, 30])).abs().max() < 8
    assert MultiCropTransform(16, 3)(opened(), 1, data).shape == (3, 3, 16, 16)
    assert EvalTransform(16)(opened()).shape == (3, 16, 16)
    decoder = DeviceDecoder(16, "cpu")  # the nvjpeg path, with torchvision's CPU decoder
    batch = decoder(decoder.collate([{"image": EncodedCropTransform(16)(opened(), 1, data), "label": 0}])["image"])
    assert batch.shape == (1, 3, 16, 16) and decoder.failed == 0


def test_an_image_above_the_pixel_limit_is_refused_from_its_header():
    data = encoded(Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8)), "PNG")
    header_only = data[:data.index(b"IDAT") + 24]  # pixels cut off: decoding would fail as undecodable
    with pytest.raises(SampleError) as e:
        open_sample({"png": header_only, "cls": b"1"}, max_pixels=1000)
    assert e.value.kind == "decompression_bomb"
    assert open_sample({"png": data, "cls": b"1"}, max_pixels=1600)[0].size == (40, 40)


def test_pils_own_bomb_check_is_a_kind_and_its_warning_stays_quiet(monkeypatch):
    data = encoded(rgb(size=(40, 40)), "PNG")  # 1600 px
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # PIL warns above 1000 and raises above 2000
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert open_sample({"png": data, "cls": b"1"}, max_pixels=5000)[0].size == (40, 40)
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)
    with pytest.raises(SampleError) as e:
        open_sample({"png": data, "cls": b"1"}, max_pixels=5000)
    assert e.value.kind == "decompression_bomb"


def test_a_configured_limit_above_pils_is_honoured(tmp_path, monkeypatch):
    write_tar(tmp_path / "big.tar", [(f"k{k}", {"png": encoded(rgb(size=(40, 40)), "PNG"), "cls": b"0"})
                                     for k in range(2)])
    shards = ShardSet.from_index(write_index(tmp_path, {"big.tar": 2}))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # PIL alone would refuse every image
    stream = ShardStream(shards, PretrainTransform(8), 0, 0, 1, 1, 2, max_bad_fraction=0.5, max_image_pixels=5000)
    sample = next(iter(stream))
    assert sample["image"].shape == (3, 8, 8) and sample["errors"].sum() == 0


def kinds_of(files: list, max_pixels: int) -> dict[str, str]:
    """key -> the kind of fault of each sample ('ok' for a usable one), as the training reader reads them."""
    kinds = {}
    for raw in raw_samples(files, Counter(), max_pixels=max_pixels):
        try:
            open_sample(raw, max_pixels)
            kinds[raw["__key__"]] = "ok"
        except SampleError as e:
            kinds[raw["__key__"]] = e.kind
    return kinds


def test_a_member_over_its_size_limit_is_skipped_from_its_header_alike_in_every_pass(tmp_path):
    png = encoded(rgb(), "PNG")
    shard = write_tar(tmp_path / "big.tar", [
        ("first", {"png": png, "cls": b"0"}),
        ("huge", {"png": image_member_limit(1000) + 1, "cls": b"0"}),
        ("edge", {"png": image_member_limit(1000), "cls": b"0"}),  # at the limit: read (zeros: undecodable)
        ("biglabel", {"png": png, "cls": OTHER_MEMBER_LIMIT + 1}),
        ("caption", {"png": png, "cls": b"1", "txt": OTHER_MEMBER_LIMIT + 1}),  # not read, and not needed
        ("last", {"png": png, "cls": b"2"}),
    ])
    expected = {"first": "ok", "huge": "oversized_member", "edge": "undecodable_image",
                "biglabel": "oversized_member", "caption": "ok", "last": "ok"}
    assert kinds_of([shard], 1000) == expected
    assert kinds_of([PipeShard(f"pipe:cat {shard}")], 1000) == expected  # a stream: drained, never held
    keys = [s["__key__"] for s in raw_samples([shard], Counter(), with_data=False)]
    assert keys == list(expected)  # key-only replays see the same samples: positions stay the same
    errors = Counter()
    assert [s["__key__"] for s in raw_samples([PipeShard(f"pipe:head -c 4096 {shard}")], errors)] == []
    assert errors["truncated_shard"] == 1  # a stream cut inside a member left unread ends as a cut one does
    # a larger data.max_image_pixels reads larger members
    assert kinds_of([shard], 2000)["huge"] == "undecodable_image"


def test_a_member_claiming_gigabytes_is_never_read(tmp_path):
    shard = write_tar(tmp_path / "giant.tar", [("giant", {"png": 5 << 30, "cls": b"0"}),
                                                ("after", {"png": encoded(rgb(), "PNG"), "cls": b"1"})])
    script = ("import resource, sys; from collections import Counter; from pathlib import Path\n"
              "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
              "from data.shards import open_sample, raw_samples\n"
              "from data.faults import SampleError\n"
              "for raw in raw_samples([Path(sys.argv[1])], Counter()):\n"
              "    try:\n"
              "        print(raw['__key__'], open_sample(raw)[1])\n"
              "    except SampleError as e:\n"
              "        print(raw['__key__'], e.kind)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(shard)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["giant oversized_member", "after 1"]



def test_verify_never_reads_a_member_claiming_gigabytes_either(tmp_path):
    """data.verify reads image members to their header, but the whole member when that does not
    parse, and labels in full: a 5 GiB member ran it out of memory."""
    shard = write_tar(tmp_path / "giant.tar", [("giant", {"png": 5 << 30, "cls": b"0"}),
                                                ("after", {"png": encoded(rgb(), "PNG"), "cls": b"1"})])
    script = ("import resource, sys; from pathlib import Path\n"
              "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
              "from data.verify import verify_shard\n"
              "r = verify_shard(Path(sys.argv[1]), 2)\n"
              "print(r.samples, sorted(r.problems))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(shard)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "2 ['oversized_member']", proc.stdout

def test_shards_that_deliver_nothing_stop_the_stream_instead_of_waiting(tmp_path):
    (tmp_path / "bad.tar").write_bytes(b"not a tar" * 100)
    stream = ShardStream(ShardSet.from_index(write_index(tmp_path, {"bad.tar": 4})), PretrainTransform(8), 0, 0, 1, 1,
                         2, max_bad_fraction=1.0)
    with pytest.raises(CorruptDataError, match="none of its 1 shard"):
        next(iter(stream))


@pytest.mark.parametrize("index,message", [
    ({"shards": [], "classes": []}, "lists no shards"),
    ({"classes": ["a"]}, "no 'shards'"),
    ({"shards": [{"file": "ok-0.tar"}], "classes": ["a"]}, "lack a 'file' name or an integer 'samples'"),
    ({"shards": [{"file": "ok-0.tar", "samples": 0}], "classes": ["a"]}, "hold no samples"),
    ({"shards": [{"file": "zero.tar", "samples": 3}], "classes": ["a"]}, "hold no samples"),
    ({"shards": [{"file": "pipe:cat ok-0.tar", "samples": 2}], "classes": ["a"]},
     r"'pipe:cat ok-0.tar' is a pipe: URL.*data.allow_pipe_urls"),
    ({"shards": [{"file": "s3://bucket/ok-0.tar", "samples": 2}], "classes": ["a"]},
     r"'s3://bucket/ok-0.tar' is a URL.*pipe:aws s3 cp s3://bucket/ok-0.tar -"),
    ({"shards": [{"file": "https://host/ok-0.tar", "samples": 2}], "classes": ["a"]}, r"pipe:curl -sfL https://"),
])
def test_unusable_indexes_are_refused_with_a_reason(tmp_path, index, message):
    image_shards(tmp_path, 1, 2)
    (tmp_path / "zero.tar").write_bytes(b"")
    (tmp_path / "bad.json").write_text(json.dumps(index))
    with pytest.raises(ShardIndexError, match=message):
        ShardSet.from_index(tmp_path / "bad.json")


def test_a_missing_shard_file_is_still_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        ShardSet.from_index(write_index(tmp_path, {"nowhere.tar": 3}))


def test_pipe_shards_read_like_local_files_when_allowed(tmp_path):
    shards = image_shards(tmp_path, 2, 3)
    local = ShardSet.from_index(write_index(tmp_path, shards))
    piped_index = write_index(tmp_path, {f"pipe:cat {tmp_path / f}": n for f, n in shards.items()}, "piped")
    piped = ShardSet.from_index(piped_index, allow_pipe_urls=True)
    assert isinstance(piped.files[0], PipeShard) and [f.name for f in piped.files] == [f.name for f in local.files]
    def samples(shard_set: ShardSet, with_data: bool = True) -> list:
        return [(s["__key__"], s.get("png"), s.get("cls")) if with_data else s["__key__"]
                for s in raw_samples(list(shard_set.files), Counter(), with_data)]

    assert samples(piped) == samples(local) and len(samples(local)) == 6
    assert samples(piped, False) == samples(local, False)  # key-only replays: the same samples
    # through the training source: data.allow_pipe_urls and the limits reach the loader
    cfg = DataConfig(train_index=str(piped_index), num_workers=0, shuffle_buffer=2, allow_pipe_urls=True,
                     max_bad_fraction=0.5, max_image_pixels=1000)
    from_pipe = _shard_loader(cfg, 8, 3, 2, 0, 0, 1, torch.device("cpu"))
    from_files = ShardLoader(local, 8, batch_size=2, seed=0, rank=0, world=1, num_workers=0, shuffle_buffer=2)
    assert (from_pipe.max_bad_fraction, from_pipe.max_image_pixels) == (0.5, 1000)
    for _ in range(4):
        assert torch.equal(next(from_pipe)["image"], next(from_files)["image"])


def test_a_pipe_that_fails_or_ends_early_counts_as_truncated(tmp_path):
    write_tar(tmp_path / "t.tar", [good(f"k{k}", 0) for k in range(4)])
    cut = f"pipe:head -c {2 * 2048 + 512 + 10} {tmp_path / 't.tar'}"  # inside the third sample's image
    for entry in (cut, f"pipe:cat {tmp_path / 't.tar'}; exit 3"):  # cut short; whole, but the command fails
        errors = Counter()
        with_data = [s["__key__"] for s in raw_samples([PipeShard(entry)], errors)]
        assert errors["truncated_shard"] == 1, entry
        assert with_data == [s["__key__"] for s in raw_samples([PipeShard(entry)], Counter(), with_data=False)]
        assert len(with_data) < 4


@pytest.mark.parametrize("key,value,message", [
    ("max_bad_fraction", 1.5, "data.max_bad_fraction"),
    ("max_bad_fraction", -0.1, "data.max_bad_fraction"),
    ("max_image_pixels", 0, "data.max_image_pixels"),
])
def test_config_ranges(key, value, message):
    cfg = PretrainConfig(ds_config="ds_configs/cpu_debug.json", data=DataConfig(source="synthetic", **{key: value}))
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_a_jpeg_libjpeg_turbo_refuses_is_decoded_by_pil_or_counted_never_a_traceback(tmp_path):
    """torchvision's decode_jpeg raises RuntimeError, which no reader caught: a JPEG cut short, or
    one whose scan data is zeroed (PIL decodes it fully, so data.write_shards accepted it), ended
    the run. Now PIL decodes what it can (the writer's judgement) and the rest is counted."""
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    jpeg = encoded(noise, "JPEG")
    zeroed = jpeg[:620] + b"\0" * (len(jpeg) - 620)
    Image.open(io.BytesIO(zeroed)).load()  # PIL's full decode passes it
    cut = jpeg[:len(jpeg) // 2]
    write_tar(tmp_path / "j-0.tar", [("ok0", {"jpg": jpeg, "cls": b"0"}), ("cut", {"jpg": cut, "cls": b"9"}),
                                     ("zeroed", {"jpg": zeroed, "cls": b"1"}), ("ok1", {"jpg": jpeg, "cls": b"2"})])
    index = write_index(tmp_path, {"j-0.tar": 4})
    loader = ShardLoader(ShardSet.from_index(index), 16, batch_size=3, seed=0, rank=0, world=1, num_workers=0,
                         shuffle_buffer=1)
    batch = next(loader)
    assert sorted(batch["label"].tolist()) == [0, 1, 2] and batch["image"].shape == (3, 3, 16, 16)
    assert loader.counters()["data_skipped_undecodable_image"] == 1
