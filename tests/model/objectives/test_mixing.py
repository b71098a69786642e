import pytest
import torch
import torch.nn.functional as F

from model.objectives.mixing import cell_assignment, make_mixing, mix, mix_images, unmix


def _mixing(B=8, grid=(8, 8), cell=2, g=4, mode="compose", exact=True, seed=0):
    return make_mixing(B, grid, cell, g, mode, exact, torch.device("cpu"), torch.Generator().manual_seed(seed))


def test_full_mode_mix_then_unmix_recovers_every_source_patch():
    x = torch.randn(8, 64, 5)
    m = _mixing(mode="full")
    mixed = mix(x, m)
    assert mixed.shape == (8, 64, 5)
    back, covered = unmix(mixed, m, 8)
    assert covered.all() and torch.equal(back, x)
    # Every cell of every image appears exactly once across its group's g mixed images.
    counts = torch.zeros(8, 64, dtype=torch.long)
    counts.index_put_((m.source, torch.arange(64).expand(8, -1)), torch.ones_like(m.source), accumulate=True)
    assert torch.all(counts == 1)


def test_compose_mode_unmix_recovers_each_images_own_cells_in_equal_shares():
    x = torch.randn(8, 64, 3)
    m = _mixing(mode="compose")
    mixed = mix(x, m)
    assert mixed.shape == (2, 64, 3)
    back, covered = unmix(mixed, m, 8)
    assert torch.equal(back[covered], x[covered]) and torch.all(back[~covered] == 0)
    assert torch.all(covered.sum(1) == 16)  # r * N patches each: 4 of the 16 cells
    # Positions within a group are partitioned: exactly one source per position.
    assert torch.all(covered.view(2, 4, 64).sum(1) == 1)
    # Whole cells: the 2x2 patches of a cell share a source.
    seg = m.segment.view(2, 4, 2, 4, 2)  # (group, cell row, row in cell, cell col, col in cell)
    assert torch.all(seg == seg[:, :, :1, :, :1])


def test_uneven_cell_counts_differ_by_at_most_one_and_exact_mode_says_why_not():
    cells = cell_assignment(500, 10, 4, exact=False, device=torch.device("cpu"))  # 10 cells, 4 images
    counts = F.one_hot(cells, 4).sum(1)  # (500, 4)
    assert torch.all(counts.sum(1) == 10) and torch.all(counts.max(1).values - counts.min(1).values <= 1)
    # Which images get the 3rd cell is random: each image has it in some groups and not in others.
    assert torch.all((counts == 3).any(0)) and torch.all((counts == 2).any(0))
    with pytest.raises(ValueError, match="exact_counts false"):
        cell_assignment(1, 10, 4, exact=True, device=torch.device("cpu"))


def test_assignments_are_random_per_group_and_reproducible():
    a, b = _mixing(B=64, seed=0), _mixing(B=64, seed=0)
    assert torch.equal(a.segment, b.segment)
    assert len({tuple(row.tolist()) for row in a.segment}) == 16  # 16 groups, 16 different layouts
    # Over many groups every source owns every cell with frequency ~ 1/g.
    many = _mixing(B=4000, seed=1).segment
    freq = F.one_hot(many, 4).float().mean(0)  # (N, g)
    assert torch.allclose(freq, torch.full_like(freq, 0.25), atol=0.06)


def test_batch_must_split_into_groups():
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu in the ds_config to a multiple of 4"):
        _mixing(B=6)
    with pytest.raises(ValueError, match="does not tile"):
        _mixing(grid=(7, 7))


def test_mixed_pixels_are_the_sum_of_indicator_weighted_sources():
    # x_mix = sum_i 1(M = i) x_i with M upsampled from cells to pixels (patch 4, cells of 2x2 patches).
    images = torch.randn(8, 3, 32, 32)
    m = _mixing()
    mixed = mix_images(images, m, patch_size=4)
    for group in range(2):
        M = m.segment[group].view(1, 1, 8, 8).float()
        M = F.interpolate(M, scale_factor=4, mode="nearest")[0, 0]  # (32, 32)
        want = sum((M == i).float() * images[group * 4 + i] for i in range(4))
        assert torch.equal(mixed[group], want)


def test_full_mode_mixed_images_are_the_cyclic_shifts_of_one_assignment():
    # (M + j) mod g, j = 0..g-1: every mixed image of a group holds all g sources in equal shares
    m = _mixing(B=8, mode="full")
    seg = m.segment.view(2, 4, 64)  # (group, j, N)
    for j in range(4):
        assert torch.equal(seg[:, j], (seg[:, 0] + j) % 4)
    assert all(len(row.unique()) == 4 for row in m.segment)
    assert torch.all(F.one_hot(m.segment, 4).sum(1) == 16)
