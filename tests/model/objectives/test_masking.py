import pytest
import torch

from model.objectives.masking import (
    gather_tokens,
    masking_from_mask,
    masking_from_noise,
    num_kept,
    random_masking,
)


def test_keep_count_is_floor():
    assert num_kept(196, 0.75) == 49
    assert num_kept(49, 0.75) == 12  # floor(12.25)
    # fractional parts above one half still round down, as official MAE's int(L * (1 - ratio))
    assert num_kept(196, 0.9) == int(196 * (1 - 0.9)) == 19  # 19.6
    assert num_kept(49, 0.45) == int(49 * (1 - 0.45)) == 26  # 26.95
    m = random_masking(4, 49, 0.75, torch.device("cpu"))
    assert m.ids_keep.shape == (4, 12)
    assert torch.all(m.mask.sum(1) == 37)  # 1 = removed


def test_ids_restore_round_trip():
    torch.manual_seed(0)
    B, N, D = 3, 10, 4
    tokens = torch.randn(B, N, D)
    m = random_masking(B, N, 0.6, torch.device("cpu"))
    kept = gather_tokens(tokens, m.ids_keep)
    # Put kept tokens first, placeholders after, then unshuffle with ids_restore.
    filler = torch.full((B, N - kept.shape[1], D), float("nan"))
    restored = gather_tokens(torch.cat([kept, filler], 1), m.ids_restore)
    visible = m.mask == 0
    assert torch.equal(restored[visible], tokens[visible])
    assert torch.isnan(restored[~visible]).all()
    # ids_keep are exactly the positions the mask marks as kept
    marked = torch.zeros(B, N).scatter_(1, m.ids_keep, 1.0)
    assert torch.equal(marked, 1 - m.mask)


def test_noise_is_reproducible_and_smallest_kept():
    noise = torch.tensor([[0.9, 0.1, 0.5, 0.3]])
    m = masking_from_noise(noise, keep=2)
    assert m.ids_keep.tolist() == [[1, 3]]
    assert m.mask.tolist() == [[1.0, 0.0, 1.0, 0.0]]
    assert torch.equal(masking_from_noise(noise, 2).mask, m.mask)


def test_caller_mask_is_honoured():
    mask = torch.tensor([[1, 0, 1, 0, 1], [0, 1, 1, 1, 0]])
    m = masking_from_mask(mask)
    assert torch.equal(m.mask, mask.float())
    assert m.ids_keep.tolist() == [[1, 3], [0, 4]]


def test_a_caller_mask_keeps_its_patches_in_ascending_order():
    # A mask is tied noise: the kept patches go to the encoder in image order, at ViT-B's 196 patches
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 196)
    for row in mask:
        row[torch.randperm(196, generator=gen)[:49]] = 0  # 49 kept per row, at random positions
    m = masking_from_mask(mask)
    want = torch.stack([torch.nonzero(row == 0)[:, 0] for row in mask])  # (4, 49), ascending
    assert torch.equal(m.ids_keep, want)
    assert torch.equal(m.mask, mask)


def test_caller_mask_errors():
    with pytest.raises(ValueError, match="same number"):
        masking_from_mask(torch.tensor([[1, 0, 0], [1, 1, 0]]))
    with pytest.raises(ValueError, match="binary"):
        masking_from_mask(torch.tensor([[2, 0, 0]]))
    with pytest.raises(ValueError, match="mask_ratio"):
        num_kept(10, 1.0)
