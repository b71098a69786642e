"""model/constants.py: host values made into a device tensor once, usable by autograd."""
import torch

from model.constants import device_constant
from train.estimate.counting import counting_syncs


def test_a_constant_is_made_once_per_device_and_dtype_and_later_calls_copy_nothing():
    cpu = torch.device("cpu")
    first = device_constant((0.5, 0.25), cpu, torch.float32)
    with counting_syncs() as syncs:
        again = device_constant((0.5, 0.25), cpu, torch.float32)
    assert again is first and not syncs.records
    assert first.tolist() == [0.5, 0.25] and first.dtype == torch.float32
    half = device_constant((0.5, 0.25), cpu, torch.float16)
    assert half is not first and half.dtype == torch.float16


def test_a_constant_first_made_under_inference_mode_still_serves_autograd():
    with torch.inference_mode():
        scale = device_constant((3.0, 4.0), torch.device("cpu"), torch.float64)
    assert not scale.is_inference()
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    (x * scale).sum().backward()
    assert x.grad.tolist() == [3.0, 4.0]


def test_on_a_device_other_than_the_cpu_the_constant_lives_there():
    """The `meta` device stands in for an accelerator: the copy goes to the device asked for."""
    meta = device_constant((1.0, 2.0, 3.0), torch.device("meta"), torch.bfloat16)
    assert meta.device.type == "meta" and meta.shape == (3,) and meta.dtype == torch.bfloat16


def test_the_imagenet_statistics_are_timms_and_the_data_pipelines():
    """model/ writes them out (importing timm costs every command line seconds); the objectives
    un-normalise with the values the data was normalised with."""
    from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    from data import transforms
    from model.constants import IMAGENET_MEAN, IMAGENET_STD

    assert IMAGENET_MEAN == tuple(IMAGENET_DEFAULT_MEAN) == tuple(transforms.IMAGENET_MEAN)
    assert IMAGENET_STD == tuple(IMAGENET_DEFAULT_STD) == tuple(transforms.IMAGENET_STD)
