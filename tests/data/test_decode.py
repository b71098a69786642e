"""Decode paths for the pretraining crop: reduced-size JPEG decoding (cpu_draft) and decoding on
the training device (nvjpeg; run here with torchvision's CPU decoder) against the plain path."""
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from data.device_decode import DeviceDecoder, EncodedCropTransform
from data.transforms import PretrainTransform, draft_for_crops, normalize_uint8, to_normalized_tensor


def photo_like(w=320, h=240, seed=0) -> Image.Image:
    """Smooth colour gradients plus mild texture: JPEG-compressible like a photograph."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    img = np.stack([128 + 100 * np.sin(6 * x + c) * np.cos(4 * y - c) for c in range(3)], -1)
    img += rng.normal(0, 6, img.shape)
    return Image.fromarray(img.clip(0, 255).astype(np.uint8))


def jpeg(img: Image.Image, quality=92) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def opened(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))  # lazy, as the shard reader hands it over


def big_crop_seed(t: PretrainTransform, data: bytes, min_side: int) -> int:
    return next(s for s in range(1000) if min(t.crop_params(opened(data), s).h, t.crop_params(opened(data), s).w)
                >= min_side)


def test_normalising_uint8_on_the_device_equals_the_old_float_path():
    img = photo_like(40, 30)
    assert torch.equal(normalize_uint8(torch.from_numpy(np.array(img)).permute(2, 0, 1)), to_normalized_tensor(img))


def test_cpu_path_decodes_jpeg_bytes_with_libjpeg_like_pil():
    t = PretrainTransform(32)
    for k in range(3):
        data = jpeg(photo_like(seed=k))
        from_bytes, from_pil = t(opened(data), k, data), t(opened(data), k)  # torchvision's libjpeg / PIL
        assert (from_bytes.int() - from_pil.int()).abs().max() <= 1


def test_cpu_path_decodes_a_grayscale_jpeg_to_three_equal_channels():
    """An L-mode JPEG through libjpeg (the bytes passed) comes out RGB like every other image: three
    equal channels, within a level of PIL's RGB conversion cropped, resized and flipped by hand."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as F2

    t = PretrainTransform(32)
    for k in range(3):
        data = jpeg(photo_like(seed=k).convert("L"))
        assert opened(data).mode == "L"
        out = t(opened(data), k, data)
        c = t.crop_params(opened(data), k)
        rgb = torch.from_numpy(np.array(opened(data).convert("RGB"))).permute(2, 0, 1)
        want = F2.resize(rgb[:, c.i:c.i + c.h, c.j:c.j + c.w], [32, 32], interpolation=InterpolationMode.BICUBIC,
                         antialias=True)
        want = want.flip(-1) if c.flip else want
        assert out.shape == (3, 32, 32) and torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])
        assert (out.int() - want.int()).abs().max() <= 1


def test_draft_decodes_smaller_and_gives_nearly_the_same_crop():
    data = jpeg(photo_like())
    plain, draft = PretrainTransform(32, decode="cpu"), PretrainTransform(32, decode="cpu_draft")
    seed = big_crop_seed(plain, data, 150)  # a crop >= 4x the output: libjpeg may decode at 1/4
    img = opened(data)
    assert draft_for_crops(img, [plain.crop_params(img, seed)], 32) >= 4 and img.size[0] <= 80
    a, b = plain(opened(data), seed), draft(opened(data), seed)
    assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape == (3, 32, 32)
    diff = (a.float() - b.float()).abs()
    assert diff.mean() < 2.0 and not torch.equal(a, b)  # the same region, resampled differently


def test_draft_with_the_bytes_passed_crops_the_same_region_as_the_plain_path():
    """ShardStream passes the encoded bytes too: once libjpeg has been asked for a reduced decode,
    the crop is in reduced pixels, so the bytes must not be decoded again at full size (the crop
    divided by the reduction then cut the wrong, top-left part of the picture)."""
    data = jpeg(photo_like())
    plain, draft = PretrainTransform(32, decode="cpu"), PretrainTransform(32, decode="cpu_draft")
    seed = big_crop_seed(plain, data, 150)
    assert draft_for_crops(opened(data), [plain.crop_params(opened(data), seed)], 32) >= 2
    a, b = plain(opened(data), seed, data), draft(opened(data), seed, data)
    assert b.shape == (3, 32, 32)
    assert (a.float() - b.float()).abs().mean() < 2.0  # the same region, resampled slightly differently


def test_crop_draws_follow_torchvisions_random_resized_crop():
    """MAE's RandomResizedCrop: area fraction uniform in scale (0.2, 1), log aspect uniform in
    log(3/4, 4/3), 10 tries, flip 50%. 2000 seeded draws on a 500x400 picture against 2000 draws of
    torchvision's own get_params (seeded too): the quantiles agree, the aspect spans the range."""
    from torchvision.transforms import RandomResizedCrop

    img = Image.new("RGB", (500, 400))
    t = PretrainTransform(32)  # scale (0.2, 1), ratio (3/4, 4/3): MAE's pretraining crop
    crops = [t.crop_params(img, s) for s in range(2000)]
    with torch.random.fork_rng(devices=[]):  # get_params draws from the global RNG: seeded, then restored
        torch.manual_seed(0)
        ref = [RandomResizedCrop.get_params(img, [0.2, 1.0], [3 / 4, 4 / 3]) for _ in range(2000)]  # (i, j, h, w)
    area = torch.tensor([c.h * c.w / 200_000 for c in crops])
    ref_area = torch.tensor([h * w / 200_000 for _, _, h, w in ref])
    log_aspect = torch.tensor([math.log(c.w / c.h) for c in crops])
    ref_log_aspect = torch.tensor([math.log(w / h) for _, _, h, w in ref])
    qs = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
    assert area.min() >= 0.2 - 0.01 and area.max() <= 1.0
    assert (area.quantile(qs) - ref_area.quantile(qs)).abs().max() < 0.04
    assert (log_aspect.quantile(qs) - ref_log_aspect.quantile(qs)).abs().max() < 0.04
    bound = math.log(4 / 3)  # 0.288
    assert log_aspect.min() < -0.9 * bound and log_aspect.max() > 0.9 * bound
    assert all(0 <= c.i <= 400 - c.h and 0 <= c.j <= 500 - c.w for c in crops)  # inside the picture
    assert 0.45 < sum(c.flip for c in crops) / 2000 < 0.55


def test_crop_position_is_uniform_over_the_picture_like_torchvisions():
    """The crop's offset is uniform over every position that keeps it inside the picture
    (torchvision: i ~ randint(0, H - h + 1)), not centred. 4000 seeded draws on a 500x400 picture
    against 4000 of torchvision's get_params: the quantiles of the offsets as a fraction of their
    room, i / (H - h) and j / (W - w) (uniform on [0, 1]), agree within 0.05. A quantile of 4000
    uniform draws has sd <= 0.008, the difference of two <= 0.012: 0.05 is > 4 sd at every quantile,
    while a centred crop puts all offsets near 0.5 (its 10% quantile is off by ~0.4)."""
    from torchvision.transforms import RandomResizedCrop

    img, n = Image.new("RGB", (500, 400)), 4000
    t = PretrainTransform(32)
    crops = [(c.i, c.j, c.h, c.w) for c in (t.crop_params(img, s) for s in range(n))]
    with torch.random.fork_rng(devices=[]):  # get_params draws from the global RNG: seeded, then restored
        torch.manual_seed(0)
        ref = [RandomResizedCrop.get_params(img, [0.2, 1.0], [3 / 4, 4 / 3]) for _ in range(n)]  # (i, j, h, w)

    def room_fractions(draws):  # (rows, cols) offsets / room, leaving out crops with no room to move
        rows = torch.tensor([i / (400 - h) for i, _, h, _ in draws if h < 400])
        cols = torch.tensor([j / (500 - w) for _, j, _, w in draws if w < 500])
        return rows, cols

    qs = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])
    for got, want in zip(room_fractions(crops), room_fractions(ref)):
        assert len(got) > 0.9 * n and len(want) > 0.9 * n
        assert (got.quantile(qs) - want.quantile(qs)).abs().max() < 0.05
        assert (got.quantile(qs) - qs).abs().max() < 0.05  # and both are uniform on [0, 1]


def test_device_decode_draws_the_cpu_paths_crops_with_the_configured_scale():
    """EncodedCropTransform(size, scale) draws PretrainTransform(size, scale)'s crop and flip for the
    same seed; with scale (0.5, 1) no crop covers less than half the picture (up to rounding)."""
    img, data = photo_like(), jpeg(photo_like())
    encoded, plain = EncodedCropTransform(16, (0.5, 1.0)), PretrainTransform(16, (0.5, 1.0))
    for seed in range(50):
        got = encoded(opened(data), seed, data)["crop"].tolist()
        c = plain.crop_params(img, seed)
        assert got == [c.i, c.j, c.h, c.w, int(c.flip)]
        assert got[2] * got[3] >= 0.49 * 320 * 240


@pytest.mark.parametrize("transform, decode", [("crop_flip", "cpu"), ("crop_flip", "cpu_draft"), ("crop_flip", "nvjpeg"),
                                               ("multicrop", "cpu"), ("multicrop", "cpu_draft")])
def test_the_shard_loaders_crop_uses_the_configured_scale_and_decode(monkeypatch, transform, decode):
    """build_source hands data.crop_scale_min and data.decode to the transform it builds (a value
    dropped there fell back to the transform's default: scale 0.2 or 0.08, decode cpu)."""
    import data.source as source_module
    from train.config.options import DataConfig

    monkeypatch.setattr(source_module, "ShardLoader", lambda *a, transform=None, **k: transform)
    monkeypatch.setattr(source_module, "train_shards", lambda cfg: None)
    cfg = DataConfig(train_transform=transform, decode=decode, crop_scale_min=0.5, num_crops=2)
    built = source_module.build_source(cfg, 16, 3, 4, 0, 0, 1, torch.device("cpu"))
    crop = built if isinstance(built, PretrainTransform) else built.crop
    assert isinstance(crop, PretrainTransform) and crop.scale == [0.5, 1.0]
    assert crop.draft == (decode == "cpu_draft")
    assert isinstance(built, EncodedCropTransform) == (decode == "nvjpeg")


@pytest.mark.parametrize("reprob", [0.0, 0.6])
def test_the_randaug_transform_uses_the_configured_scale_and_erasing_probability(monkeypatch, reprob):
    """train_transform randaug: timm's RandomResizedCrop with scale (crop_scale_min, 1) and random
    erasing with probability data.reprob, none at 0 (it was always timm's default 0.25)."""
    import data.source as source_module
    from train.config.options import DataConfig

    monkeypatch.setattr(source_module, "ShardLoader", lambda *a, transform=None, **k: transform)
    monkeypatch.setattr(source_module, "train_shards", lambda cfg: None)
    cfg = DataConfig(train_transform="randaug", crop_scale_min=0.5, reprob=reprob)
    steps = source_module.build_source(cfg, 16, 3, 4, 0, 0, 1, torch.device("cpu")).transform.transforms
    crops = [s for s in steps if type(s).__name__.endswith("RandomResizedCropAndInterpolation")]
    assert len(crops) == 1 and tuple(crops[0].scale) == (0.5, 1.0)
    erasing = [s.probability for s in steps if type(s).__name__ == "RandomErasing"]
    assert erasing == ([reprob] if reprob else [])


def test_draft_changes_nothing_when_the_crop_is_too_small_or_not_a_jpeg():
    data = jpeg(photo_like())
    plain, draft = PretrainTransform(64, decode="cpu"), PretrainTransform(64, decode="cpu_draft")
    seed = next(s for s in range(1000) if min(plain.crop_params(opened(data), s).h,
                                               plain.crop_params(opened(data), s).w) < 128)
    assert torch.equal(plain(opened(data), seed), draft(opened(data), seed))
    buf = io.BytesIO()
    photo_like().save(buf, format="PNG")
    assert torch.equal(plain(opened(buf.getvalue()), 3), draft(opened(buf.getvalue()), 3))


def test_device_decode_matches_the_cpu_path_and_keeps_the_batch_when_a_jpeg_is_corrupt():
    plain, encoded = PretrainTransform(32), EncodedCropTransform(32)
    files = [jpeg(photo_like(seed=i)) for i in range(3)]
    png = io.BytesIO()
    photo_like(seed=5).save(png, format="PNG")
    files.append(png.getvalue())
    items = [{"image": encoded(opened(d), 10 + k, d), "label": k} for k, d in enumerate(files)]
    assert isinstance(items[0]["image"], dict) and torch.is_tensor(items[3]["image"])  # the PNG is cropped on CPU
    decoder = DeviceDecoder(32, torch.device("cpu"))
    batch = decoder(DeviceDecoder.collate(items)["image"])
    want = torch.stack([plain(opened(d), 10 + k) for k, d in enumerate(files)])
    assert batch.shape == (4, 3, 32, 32) and batch.dtype == torch.uint8
    assert torch.equal(batch[3], want[3])
    # the same crop and resize; the decoders (torchvision's libjpeg vs PIL's) agree to a level
    assert (batch[:3].int() - want[:3].int()).abs().max() <= 1

    broken = files[1][:200] + b"\x00" * 50  # header intact, entropy data destroyed
    items[1] = {"image": encoded(opened(files[1]), 11, broken), "label": 1}
    batch = decoder(DeviceDecoder.collate(items)["image"])
    assert decoder.failed == 1 and batch.shape == (4, 3, 32, 32)
    assert any(torch.equal(batch[1], batch[k]) for k in (0, 2, 3))  # a stand-in from the same batch



def test_device_decode_stacks_and_flips_the_batch_in_a_few_launches():
    """The decode of a batch of 16 JPEGs: one decode call and one resize per image (crop sizes
    differ), then one stack and, for the flipped crops, one flip and one select for the whole batch
    (it issued a copy per image and a flip per flipped one: 230 launches at micro-batch 64). Each
    image equals its crop resized and, where drawn, flipped."""
    from torchvision.io import decode_jpeg
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as F2

    from train.estimate.counting import Tally, counting

    encoded = EncodedCropTransform(32)
    files = [jpeg(photo_like(96, 72, seed=i)) for i in range(16)]
    items = [{"image": encoded(opened(d), 40 + k, d), "label": k} for k, d in enumerate(files)]
    flips = [bool(it["image"]["crop"][4]) for it in items]
    assert 0 < sum(flips) < 16  # both kinds in the batch
    decoder = DeviceDecoder(32, torch.device("cpu"))
    images = DeviceDecoder.collate(items)["image"]
    decoder(images)  # the first call: nothing cached is counted below
    tally = Tally()
    with counting(tally), tally("data"):
        batch = decoder(images)
    launches = tally.per_step(tally.step)["data"]["launches"]
    ops = dict(tally.top_ops(tally.step, "data", 40))
    assert ops.get("aten::flip", 0) == 1 and ops.get("aten::copy_", 0) <= 1, ops
    # 16 decodes (torchvision's CPU decoder takes a list one by one; nvJPEG in one call), 16 resizes,
    # then stack, flip, select (and on CUDA the flags' copy)
    assert launches <= 2 * 16 + 4, (launches, ops)
    for k, item in enumerate(items):
        i, j, h, w, flip = item["image"]["crop"].tolist()
        want = F2.resize(decode_jpeg(item["image"]["jpeg"])[:, i:i + h, j:j + w], [32, 32],
                         interpolation=InterpolationMode.BICUBIC, antialias=True)
        assert torch.equal(batch[k], want.flip(-1) if flip else want), k


@pytest.mark.parametrize("decode", ["cpu", "cpu_draft", "nvjpeg"])
def test_loader_with_each_decode_yields_normalised_batches(tmp_path, decode):
    from data.source import build_source
    from data.write_shards import main as write_shards
    from train.config.options import DataConfig

    src = tmp_path / "src" / "c0"
    src.mkdir(parents=True)
    for i in range(8):
        (src / f"{i}.jpg").write_bytes(jpeg(photo_like(96, 80, seed=i)))
    write_shards(["imagefolder", str(tmp_path / "src"), str(tmp_path / "s"), "--samples_per_shard", "4"])
    cfg = DataConfig(train_index=str(tmp_path / "s" / "train.json"), num_workers=0, decode=decode)
    source = build_source(cfg, 32, 3, 4, seed=0, rank=0, world=1, device=torch.device("cpu"))
    batch = next(source)
    assert batch["image"].shape == (4, 3, 32, 32) and batch["image"].dtype == torch.float32
    assert -2.2 < batch["image"].min() and batch["image"].max() < 2.7  # ImageNet-normalised range
