"""Images of any PIL mode as 8-bit RGB, and which conversions are worth counting.

  RGB                kept
  L (grayscale)      replicated to 3 channels; not counted (Fashion-MNIST is all grayscale)
  CMYK               PIL's CMYK -> RGB (a CMYK JPEG's Adobe inversion is undone by PIL's decoder);
                     counted `cmyk`
  I;16*, I           16-bit grey (PNG): value >> 8 (PIL's convert("RGB") would clip every value
                     above 255 to white), replicated; counted `16bit`
  anything else      PIL's convert("RGB") (palette, alpha dropped, 1-bit, float, ...); counted `other_mode`

Formats: JPEG, PNG and WebP members are the standard ones; an image in any other format PIL
decodes (BMP, TIFF, GIF, PPM, TGA, ...; the members data/shards.py's IMAGE_KEYS name) is kept and
counted `other_format`, beside its mode's count.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

CONVERTED_KINDS = ("cmyk", "16bit", "other_mode", "other_format")  # metrics data_converted_<kind>; new kinds appended
STANDARD_FORMATS = ("JPEG", "PNG", "WEBP")  # PIL's Image.format of jpg / jpeg, png and webp members


def conversion_kind(mode: str) -> str | None:
    """The CONVERTED_KINDS entry for an image of this mode, None for RGB and grayscale."""
    if mode in ("RGB", "L"):
        return None
    if mode == "CMYK":
        return "cmyk"
    if mode == "I" or mode.startswith("I;16"):
        return "16bit"
    return "other_mode"


def format_kind(fmt: str | None) -> str | None:
    """The CONVERTED_KINDS entry for an image of this PIL format (`Image.format`), None for the standard ones."""
    return None if fmt in STANDARD_FORMATS else "other_format"


def to_rgb(img: Image.Image) -> Image.Image:
    """An RGB image (decoding a lazily opened one) following the table above."""
    if img.mode == "RGB":
        return img
    if conversion_kind(img.mode) == "16bit":
        grey = np.asarray(img)  # (H, W) uint16 (any byte order), or int32 for mode I
        high = (np.clip(grey, 0, 65535) >> 8).astype(np.uint8)  # (H, W): 32768 -> 128
        return Image.fromarray(high).convert("RGB")
    return img.convert("RGB")
