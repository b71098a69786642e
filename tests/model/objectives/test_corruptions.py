"""Each corruption of energy-based pretraining changes what it should, with the stated statistics."""
import math

import pytest
import torch
import torch.nn.functional as F

from data.transforms import IMAGENET_MEAN, IMAGENET_STD
from model.objectives import corruptions as C


def images(b=64, c=3, s=32, seed=0):
    return torch.randn(b, c, s, s, generator=torch.Generator().manual_seed(seed)) + 3.0  # no exact zeros


def gen(seed=1):
    return torch.Generator().manual_seed(seed)


def test_grid_blanks_whole_cells_at_the_ratio():
    x = images()
    y = C.grid_mask(x, cell=8, ratio=0.75, generator=gen())
    cells = (y == 0).view(64, 3, 4, 8, 4, 8).permute(0, 2, 4, 1, 3, 5).reshape(64, 16, -1)  # (B, cells, pixels)
    blanked = cells.all(-1)
    assert bool((blanked | ~cells.any(-1)).all())  # each cell is blanked entirely or not at all
    assert bool((blanked.sum(1) == 12).all())  # round(0.75 * 16) per sample
    assert torch.equal(y[~(y == 0)], x[~(y == 0)])  # the rest is untouched
    assert not torch.equal(blanked[0], blanked[1])  # per-sample draws
    with pytest.raises(ValueError, match="do not tile"):
        C.grid_mask(x, cell=5, ratio=0.5)


@pytest.mark.parametrize("area", [(0.01, 0.025), (0.02, 0.08)])
def test_each_random_blank_covers_a_uniform_share_of_the_area(area):
    """One blank per sample: its area is U(area) of the image (up to pixel rounding)."""
    x = images(b=2000, s=64)
    share = (C.random_blanks(x, 1, area, generator=gen()) == 0).all(1).flatten(1).float().mean(1)
    # pixel rounding: an h x w rectangle covers between (h-1)(w-1) and (h+1)(w+1) pixels, and with
    # aspect ratios in (1/2, 2) h + w <= 2.13 sqrt(area); a blank clipped at the border covers less
    pixel = (2.13 * (area[1] * 64 * 64) ** 0.5 + 1) / 64 ** 2
    assert bool((share >= area[0] - pixel).all() and (share <= area[1] + pixel).all())
    assert abs(share.mean().item() - sum(area) / 2) < pixel / 2


def test_blank_aspect_ratios_are_symmetric_in_log():
    """Aspect ratios log-uniform in (1/2, 2): as many rectangles taller than wide as wider than
    tall, and some of each beyond 3:2 (counted in covered rows and columns of one blank)."""
    cov = (C.random_blanks(images(b=4000, c=1), 1, (0.05, 0.05), generator=gen()) == 0)[:, 0]
    rows, cols = cov.any(2).sum(1).float(), cov.any(1).sum(1).float()
    taller, wider = (rows > cols).float().mean().item(), (rows < cols).float().mean().item()
    assert 0.4 < taller / (taller + wider) < 0.6, (taller, wider)
    assert (rows > 1.5 * cols).float().mean() > 0.1 and (cols > 1.5 * rows).float().mean() > 0.1
    # and none beyond 2:1: an h x w blank (h, w <= 2 x the other) covers fewer than h + 1 rows and more
    # than w - 1 columns (the image holds it unclipped at 5% of its area), so rows < 2 (cols + 1) + 1
    long, short = torch.maximum(rows, cols), torch.minimum(rows, cols)
    assert bool((long <= 2 * short + 2).all()), (long / short).max()


def test_grid_blanks_the_rounded_share_of_cells():
    """7 x 7 cells at ratio 0.75: round(36.75) = 37 cells blanked per sample, not the floor 36."""
    y = C.grid_mask(images(b=4, c=1, s=28), cell=4, ratio=0.75, generator=gen())
    blanked = (y == 0)[:, 0].view(4, 7, 4, 7, 4).all(4).all(2)  # (B, 7, 7) cells
    assert blanked.flatten(1).sum(1).tolist() == [round(0.75 * 49)] * 4


def test_many_blanks_cover_most_of_the_image():
    """75 small / 25 large blanks (the paper's counts) blank roughly 60-75% of the pixels."""
    x = images(b=256, s=64)
    for count, area in ((75, (0.01, 0.025)), (25, (0.02, 0.08))):
        y = C.random_blanks(x, count, area, generator=gen())
        covered = (y == 0).all(1).float().mean().item()
        assert 0.55 < covered < 0.8, (count, covered)
        assert torch.equal(y[y != 0], x[y != 0])


def test_super_resolution_is_bicubic_down_nearest_up():
    x = images(b=2)
    y = C.super_resolution(x, 4)
    low = F.interpolate(x, size=(8, 8), mode="bicubic", align_corners=False)
    torch.testing.assert_close(y, low.repeat_interleave(4, 2).repeat_interleave(4, 3))
    assert bool((y.view(2, 3, 8, 4, 8, 4) == y.view(2, 3, 8, 4, 8, 4)[:, :, :, :1, :, :1]).all())  # 4x4 blocks


def test_denoise_noise_level_is_uniform_per_sample():
    """y = sqrt(g) x + sqrt(1-g) eps: with x = 0, per-sample std = sqrt(1 - g), g ~ U(0, 1)."""
    x = torch.zeros(4000, 1, 16, 16)
    y = C.denoise(x, generator=gen())
    g = 1 - y.flatten(1).var(1)  # the per-sample gamma, estimated
    assert abs(g.mean().item() - 0.5) < 0.03 and abs(g.var().item() - 1 / 12) < 0.01  # U(0, 1): mean 1/2, var 1/12
    ones = C.denoise(torch.ones(2000, 1, 8, 8), generator=gen(2))
    assert abs(ones.mean().item() - 2 / 3) < 0.03  # E[sqrt(g)] = 2/3


def test_colorize_gives_the_luminance_on_every_channel():
    x = images(b=2)
    y = C.colorize(x)
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    rgb = y * std + mean
    torch.testing.assert_close(rgb[:, 0], rgb[:, 1], atol=1e-5, rtol=0)
    torch.testing.assert_close(rgb[:, 1], rgb[:, 2], atol=1e-5, rtol=0)
    src = x * std + mean
    torch.testing.assert_close(rgb[:, 0], 0.299 * src[:, 0] + 0.587 * src[:, 1] + 0.114 * src[:, 2], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="RGB"):
        C.colorize(torch.zeros(1, 1, 4, 4))


def test_mixture_uses_each_part_uniformly_per_sample():
    x = images(b=3000, s=8)
    parts = {"zero": lambda t, generator=None: torch.zeros_like(t), "neg": lambda t, generator=None: -t,
             "same": lambda t, generator=None: t}
    y, choice = C.mixture(x, parts, generator=gen())
    counts = torch.bincount(choice, minlength=3).float() / 3000
    assert bool(((counts - 1 / 3).abs() < 0.04).all())
    for i, expect in enumerate([torch.zeros_like(x), -x, x]):
        assert torch.equal(y[choice == i], expect[choice == i])
    assert math.isclose(float(counts.sum()), 1.0)
