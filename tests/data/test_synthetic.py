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
