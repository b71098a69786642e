"""tools/photos.py, the procedural stand-ins for photographs the loader phase decodes: texture added
to a bright or dark field saturates at 255 or 0, as a camera's does, rather than wrapping around
uint8 into salt noise (which makes JPEGs a third larger and slower to decode than camera pictures)."""
import numpy as np
import pytest

from tools.photos import photo

W, H = 64, 48


class ConstantTexture:
    """The generator photo() draws from, with each scale's texture a constant `offset`: the photo is
    then its colour field and shapes plus 2 x offset everywhere."""

    def __init__(self, seed: int, offset: float):
        self.rng, self.offset = np.random.default_rng(seed), offset

    def normal(self, loc, scale, size):
        return np.full(size, self.offset)

    def __getattr__(self, name):
        return getattr(self.rng, name)


@pytest.mark.parametrize("offset", [60.0, -60.0])
def test_texture_past_white_or_black_saturates_instead_of_wrapping(offset):
    field = np.asarray(photo(ConstantTexture(0, 0.0), W, H)).astype(np.int64)  # no texture: the field itself
    expected = (field + 2 * offset).clip(0, 255)
    assert ((field + 2 * offset < 0) | (field + 2 * offset > 255)).mean() > 0.05  # the case is exercised
    got = np.asarray(photo(ConstantTexture(0, offset), W, H))
    assert got.dtype == np.uint8 and got.shape == (H, W, 3)
    np.testing.assert_array_equal(got, expected)
