import torch

from data.synthetic import SyntheticImages


def _source(rank=0, seed=0):
    return SyntheticImages(batch_size=4, img_size=28, in_chans=1, num_classes=10, seed=seed, rank=rank)


def test_stream_is_a_function_of_position():
    a = _source()
    batches = [next(a) for _ in range(3)]
    assert batches[0]["image"].shape == (4, 1, 28, 28) and batches[0]["label"].shape == (4,)
    assert not torch.equal(batches[0]["image"], batches[1]["image"])
    b = _source()
    b.load_state_dict(a.state_dict() | {"position": 2})
    assert torch.equal(next(b)["image"], batches[2]["image"])  # resumed stream continues exactly
    assert a.state_dict()["position"] == 3


def test_ranks_and_seeds_differ():
    x = next(_source())["image"]
    assert not torch.equal(x, next(_source(rank=1))["image"])
    assert not torch.equal(x, next(_source(seed=1))["image"])


def test_images_are_smooth_and_normalised():
    x = next(SyntheticImages(64, 32, 3, 10, 0, 0))["image"]
    # neighbouring pixels are far more alike than independent noise would be
    diff = (x[..., 1:] - x[..., :-1]).abs().mean()
    assert diff < 0.3 * x.std()
    assert abs(x.mean().item()) < 0.5 and 0.5 < x.std().item() < 2.0


def test_a_rank_the_old_run_lacked_continues_from_the_furthest_position():
    new = _source(rank=2)
    new.resume_from([{"position": 5}, {"position": 3}])  # a 2-rank checkpoint, resumed on 3 ranks
    assert new.position == max(5, 3)
    mine = _source(rank=1)
    mine.resume_from([{"position": 5}, {"position": 3}])  # an old rank continues its own position
    assert mine.position == 3


def test_images_of_other_channel_counts_are_normalised_with_half_and_a_quarter():
    """Not RGB: mean 0.5, std 0.25 (data/synthetic.py mean_std). The raw pixels (coarse noise in
    [0, 1) upsampled bilinearly) come back in [0, 1) with both ends nearly reached."""
    x = next(_source())["image"]
    raw = x * 0.25 + 0.5
    assert raw.min() >= 0 and raw.max() < 1
    assert raw.min() < 0.1 and raw.max() > 0.9


def test_labels_are_drawn_from_every_class():
    """Labels uniform over range(num_classes), the top class included: 3 classes, 600 labels,
    each class's share near 1/3 (binomial sd 0.019; the margin is 5 sd)."""
    labels = next(SyntheticImages(batch_size=600, img_size=8, in_chans=3, num_classes=3, seed=0, rank=0))["label"]
    assert set(labels.tolist()) == set(range(3))
    shares = torch.bincount(labels, minlength=3).float() / 600
    assert (shares - 1 / 3).abs().max() < 0.1
