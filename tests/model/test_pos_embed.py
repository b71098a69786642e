import math

import pytest
import torch

from model.pos_embed import sincos_1d, sincos_2d, sincos_2d_at


def test_1d_hand_computed():
    # dim 4 -> frequencies 1 and 1/100; pos 2 -> [sin 2, sin .02, cos 2, cos .02]
    got = sincos_1d(4, torch.tensor([2.0]))[0]
    want = torch.tensor([math.sin(2), math.sin(0.02), math.cos(2), math.cos(0.02)], dtype=torch.float64)
    assert torch.allclose(got, want)


def test_2d_layout_column_then_row_and_cls_zero():
    dim, gh, gw = 8, 2, 3
    table = sincos_2d(dim, (gh, gw), cls_token=True)
    assert table.shape == (1 + gh * gw, dim)
    assert torch.all(table[0] == 0)
    for r in range(gh):
        for c in range(gw):
            row = table[1 + r * gw + c].double()
            assert torch.allclose(row[: dim // 2], sincos_1d(dim // 2, torch.tensor([float(c)]))[0], atol=1e-7)
            assert torch.allclose(row[dim // 2 :], sincos_1d(dim // 2, torch.tensor([float(r)]))[0], atol=1e-7)


def test_rejects_bad_dims():
    with pytest.raises(ValueError, match="divisible by 4"):
        sincos_2d(6, (2, 2))
    # the continuous form splits dim into four sin/cos quarters as well
    for dim in (6, 2, 10):
        with pytest.raises(ValueError, match="divisible by 4"):
            sincos_2d_at(dim, torch.zeros(3, 2))


def test_continuous_sincos_at_integer_coordinates_is_the_fixed_table():
    from model.irpe import grid_coords
    from model.pos_embed import sincos_2d, sincos_2d_at

    coords = grid_coords((7, 5)).double()
    assert torch.allclose(sincos_2d_at(64, coords + 0.0).float(), sincos_2d(64, (7, 5)), atol=1e-6)
    delta = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(sincos_2d_at(64, coords + delta).sum(), delta)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
