"""The transform settings a configuration names, checked without importing torchvision or timm:
parsing a command line (its --help, a bad value, --dry-run) stays a light start-up, and the
transforms themselves (data/transforms.py) load only where a run builds its data."""
from __future__ import annotations

DECODES = ("cpu", "cpu_draft", "nvjpeg")  # data.decode: data/transforms.py says what each does


def check_augment_policy(policy: str) -> None:
    """ValueError when timm cannot build `policy` (data.randaug), before any run starts ('' is none)."""
    from timm.data import create_transform

    try:
        create_transform(16, is_training=True, auto_augment=policy or None)
    except (AssertionError, KeyError, ValueError, IndexError) as e:
        raise ValueError(f"data.randaug {policy!r} is no timm augmentation policy ({e}): give one such as "
                         f"rand-m9-mstd0.5-inc1 (MAE's fine-tuning), augmix-m5, original, or '' for none") from None
