"""Reading shards: exact coverage across ranks x workers, corrupt samples, resumable stream."""
import io
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from data.loader import ShardLoader
from data.shard_index import ShardSet, check_split
from data.shards import ShardStream, shards_for
from data.transforms import EvalTransform, PretrainTransform
from data.write_shards import main as write_shards


@pytest.fixture
def shard_set(image_folder, tmp_path):
    write_shards(["imagefolder", str(image_folder), str(tmp_path / "s"), "--samples_per_shard", "3"])  # 8 shards
    return ShardSet.from_index(tmp_path / "s" / "train.json")


def _keys_of_epoch(stream: ShardStream, worker: int, epoch: int) -> list[str]:
    keys, errors = [], Counter()
    for e, _, raw in stream.worker_samples(worker, errors):
        if e > epoch:
            break
        if e == epoch:
            keys.append(raw["__key__"])
    return keys


def test_every_sample_once_per_epoch_across_2_ranks_x_2_workers(shard_set):
    all_keys = set()
    for epoch in (0, 1):
        seen = []
        for rank in range(2):
            stream = ShardStream(shard_set, PretrainTransform(16), seed=3, rank=rank, world=2, num_workers=2,
                                 shuffle_buffer=4)
            for worker in range(2):
                seen += _keys_of_epoch(stream, worker, epoch)
        assert len(seen) == 24 and len(set(seen)) == 24  # each sample exactly once
        all_keys |= set(seen)
    assert len(all_keys) == 24
    # epochs use different shard orders
    assert shards_for(8, 0, 3, 0, 4) != shards_for(8, 1, 3, 0, 4)


def test_too_few_shards_for_readers_is_an_error(shard_set):
    with pytest.raises(ValueError, match="8 shards cannot feed 2 ranks x 8 workers = 16 readers"):
        check_split(shard_set, world=2, num_workers=8)


def test_one_shard_per_reader_is_enough():
    def shards(n):
        return ShardSet(tuple(Path(f"s{i}.tar") for i in range(n)), (10,) * n, ("a",))

    check_split(shards(4), world=2, num_workers=2)  # 2 ranks x 2 workers: each reads one whole shard
    check_split(shards(2), world=2, num_workers=0)  # each rank's own process is its one reader
    with pytest.raises(ValueError, match="3 shards cannot feed 2 ranks x 2 workers = 4 readers"):
        check_split(shards(3), world=2, num_workers=2)


def _batches(loader, n):
    return [next(loader) for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_the_same_stream(shard_set, workers):
    make = lambda: ShardLoader(shard_set, 16, batch_size=4, seed=0, rank=0, world=1, num_workers=workers,  # noqa: E731
                               shuffle_buffer=5)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    straight = _batches(make(), 9)
    assert torch.equal(torch.get_rng_state(), before)  # the loader leaves the training RNG alone
    first = make()
    _batches(first, 5)
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    for a, b in zip(_batches(resumed, 4), straight[5:], strict=True):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
    assert straight[0]["image"].shape == (4, 3, 16, 16)


def test_a_position_recorded_before_per_sample_positions_replays_to_the_same_stream(shard_set):
    """An old-format position (no `last`) replays decoded samples: with 2 workers and 5 batches taken,
    worker 0 delivered batches 0, 2, 4 and worker 1 batches 1, 3, so each drops its own count."""
    make = lambda: ShardLoader(shard_set, 16, batch_size=4, seed=0, rank=0, world=1, num_workers=2,  # noqa: E731
                               shuffle_buffer=5)
    straight = _batches(make(), 8)
    first = make()
    _batches(first, 5)
    old = {k: v for k, v in first.state_dict().items() if k != "last"}
    resumed = make()
    resumed.load_state_dict(old)
    assert resumed.start.legacy_skip == [len(range(w, 5, 2)) * 4 for w in range(2)]  # [12, 8]
    for a, b in zip(_batches(resumed, 3), straight[5:], strict=True):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])


def test_resume_refuses_other_worker_count(shard_set):
    a = ShardLoader(shard_set, 16, 4, 0, 0, 1, 0, 5)
    b = ShardLoader(shard_set, 16, 4, 0, 0, 1, 2, 5)
    with pytest.raises(ValueError, match="num_workers=0"):
        b.load_state_dict(a.state_dict())


def _add_member(tar, name, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_corrupt_samples_are_skipped_and_counted(shard_set, tmp_path):
    bad = tmp_path / "s" / "train-000000.tar"
    with tarfile.open(bad, "a") as tar:
        _add_member(tar, "x1.png", b"\x89PNG garbage")  # undecodable
        _add_member(tar, "x1.cls", b"1")
        _add_member(tar, "x2.png", b"")  # zero-byte image
        _add_member(tar, "x2.cls", b"1")
        _add_member(tar, "x3.cls", b"2")  # no image
    truncated = tmp_path / "s" / "train-000002.tar"
    truncated.write_bytes(truncated.read_bytes()[:1500])  # cut inside the second member
    loader = ShardLoader(shard_set, 16, batch_size=2, seed=0, rank=0, world=1, num_workers=0, shuffle_buffer=3)
    labels = torch.cat([next(loader)["label"] for _ in range(11)])  # 22 samples: past one epoch, not two
    assert len(labels) == 22  # training goes on
    counts = loader.counters()
    # each fault is met once per epoch; the first epoch is complete, the second is not
    assert 1 <= counts["data_skipped_undecodable_image"] <= 2
    assert 1 <= counts["data_skipped_empty_image"] <= 2
    assert 1 <= counts["data_skipped_missing_image"] <= 2
    assert 1 <= counts["data_skipped_truncated_shard"] <= 2


def test_transforms_are_seeded_and_shaped():
    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (20, 30), dtype=np.uint8), mode="L")
    t = PretrainTransform(16)
    a, b, c = t(img, 1), t(img, 1), t(img, 2)
    assert a.shape == (3, 16, 16) and torch.equal(a, b) and not torch.equal(a, c)
    e = EvalTransform(16, crop_pct=1.0)(img)
    assert e.shape == (3, 16, 16)
    # grayscale replicated to 3 channels: channels differ only by the per-channel normalisation
    from data.transforms import IMAGENET_MEAN, IMAGENET_STD

    raw = [e[i] * IMAGENET_STD[i] + IMAGENET_MEAN[i] for i in range(3)]
    assert torch.allclose(raw[0], raw[1], atol=1e-5) and torch.allclose(raw[1], raw[2], atol=1e-5)


def test_randaug_transform_is_seeded_and_leaves_global_rngs_alone():
    import random

    import numpy as np
    from PIL import Image

    from data.transforms import RandAugTransform

    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (20, 20), dtype=np.uint8), mode="L")
    t = RandAugTransform(16)
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    a, b, c = t(img, 11), t(img, 11), t(img, 12)
    assert a.shape == (3, 16, 16) and torch.equal(a, b) and not torch.equal(a, c)
    assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])


def test_randaug_top_magnitude_posterize_works_with_the_installed_pillow():
    # 'rand-m9-mstd0.5-inc1' clips sampled magnitudes at 10, where posterize keeps 0 bits.
    from PIL import Image
    from timm.data.auto_augment import posterize

    assert posterize(Image.new("RGB", (4, 4), (200, 100, 50)), 0).getpixel((0, 0)) == (0, 0, 0)


def test_multicrop_gives_k_distinct_seeded_crops():
    from PIL import Image

    from data.transforms import MultiCropTransform, PretrainTransform

    img = Image.fromarray(np.arange(64 * 48, dtype=np.uint8).reshape(48, 64) * 3 % 251)
    views = MultiCropTransform(16, num_crops=4)(img, seed=7)
    assert views.shape == (4, 3, 16, 16)
    assert torch.equal(views, MultiCropTransform(16, num_crops=4)(img, seed=7))  # seeded
    assert len({tuple(v.flatten()[:40].tolist()) for v in views}) == 4  # independent crops
    # crop c is the plain pretraining crop drawn with its derived seed, at scale (0.08, 1)
    assert torch.equal(views[2], PretrainTransform(16, (0.08, 1.0))(img, 7 * 1_000_003 + 2))


def test_eval_resizes_to_size_over_crop_pct_then_center_crops():
    """The evaluation transform: shorter side to size / crop_pct (bicubic, antialiased), then the
    central size x size crop, normalised. Resizing to size * crop_pct instead left the crop smaller
    than the image's shorter side: center_crop padded it with black."""
    import torchvision.transforms.functional as TF
    from PIL import Image
    from torchvision.transforms import InterpolationMode

    from data.transforms import IMAGENET_MEAN, IMAGENET_STD

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8))
    got = EvalTransform(16, crop_pct=0.5)(img)
    resized = TF.resize(img, 32, InterpolationMode.BICUBIC, antialias=True)  # 16 / 0.5
    assert resized.size == (42, 32)
    ref = TF.pil_to_tensor(TF.center_crop(resized, [16, 16])).float() / 255.0
    assert torch.allclose(got, TF.normalize(ref, IMAGENET_MEAN, IMAGENET_STD), atol=1e-6)
    black = TF.normalize(torch.zeros(3, 1, 1), IMAGENET_MEAN, IMAGENET_STD)
    assert not (got[:, 0] == black[:, 0]).all(0).any()  # no padded border row of black pixels


def test_the_shuffle_buffer_shuffles_an_epoch_smaller_than_itself():
    """An epoch that fits in the buffer never reaches the reservoir's swaps: the final pool must be
    shuffled too, or the samples come in read order."""
    import random

    from data.shards import shuffled

    runs = [list(shuffled(iter(range(20)), 100, random.Random(s))) for s in range(1000)]
    assert all(sorted(r) == list(range(20)) for r in runs)  # each sample once
    assert sum(r != list(range(20)) for r in runs) == 1000
    first = Counter(r[0] for r in runs)  # ~50 each if uniform
    assert len(first) == 20 and min(first.values()) > 20 and max(first.values()) < 90


def test_each_samples_crop_seed_is_derived_from_seed_epoch_rank_worker_and_position(shard_set):
    """The transform gets derive_seed(seed, epoch, rank, worker, pos): another epoch or another rank
    draws other crops for the same position (dropping either repeated every crop each epoch, or on
    every rank)."""
    from data.shards import derive_seed

    def seeds(rank):
        stream = iter(ShardStream(shard_set, lambda img, seed: seed, seed=3, rank=rank, world=2, num_workers=1,
                                  shuffle_buffer=4))
        out = {}
        for _ in range(24):  # 12 samples an epoch on each rank: two epochs
            s = next(stream)
            out[(s["epoch"], s["pos"])] = s["image"]
        return out

    by_rank = [seeds(0), seeds(1)]
    for rank, got in enumerate(by_rank):
        assert set(got) == {(e, p) for e in (0, 1) for p in range(12)}
        assert all(seed == derive_seed(3, e, rank, 0, p) for (e, p), seed in got.items())
        assert all(got[(0, p)] != got[(1, p)] for p in range(12))
    assert all(by_rank[0][key] != by_rank[1][key] for key in by_rank[0])
