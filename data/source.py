"""Build the training batch source named by the config (shards or synthetic)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from data.loader import ShardLoader
from data.shard_index import ShardSet, check_held_out, check_scored_against, check_split
from data.shards import open_sample, shard_samples
from data.split import LabeledSplit, SplitSource
from data.synthetic import SyntheticImages
from data.transforms import PretrainTransform

SYNTHETIC_EPOCH = 1_281_167  # ImageNet-1k train, the nominal epoch of the synthetic source


def train_shards(data_cfg) -> ShardSet:
    """The training shard set (pipe: entries only with data.allow_pipe_urls); a labeled one must
    hold its labels under data.label_key."""
    shards = ShardSet.from_index(data_cfg.train_index, data_cfg.allow_pipe_urls)
    shards.check_label_key(data_cfg.label_key)
    return shards


def eval_shards(data_cfg) -> ShardSet:
    """The evaluation shard set (data.eval_index): labeled, under data.label_key."""
    shards = ShardSet.from_index(data_cfg.eval_index, data_cfg.allow_pipe_urls)
    shards.require_labels("data.eval_index is scored against its labels (top-1 / top-5)")
    shards.check_label_key(data_cfg.label_key)
    return shards


def nominal_epoch_size(data_cfg, split: LabeledSplit | None = None) -> int:
    """Samples per nominal epoch, known before any process starts (with a labeled split: the
    expected size of its training part)."""
    if data_cfg.epoch_size:
        return data_cfg.epoch_size
    total = SYNTHETIC_EPOCH if data_cfg.source == "synthetic" else train_shards(data_cfg).num_samples
    return total if split is None else int(total * (1 - split.val_fraction))


DECODED_CHANNELS = 3  # every shard image is decoded to 8-bit RGB (grayscale replicated; data/shards.py)


def stored_image(shards: ShardSet, max_samples: int = 8) -> tuple[str, int] | None:
    """(PIL mode, channel count) of the first image of the first shard whose header reads, read
    without decoding its pixels; None when the shard is a pipe: command or no such image comes
    within `max_samples` samples (the loader's own checks deal with those)."""
    first = shards.files[0] if shards.files else None
    if not isinstance(first, Path) or not first.is_file():
        return None
    for i, raw in enumerate(shard_samples(first, Counter())):
        try:
            img = open_sample(raw, labels=shards.labels)[0]
            return img.mode, len(img.getbands())
        except ValueError:  # SampleError: this sample is unusable; try the next
            if i + 1 >= max_samples:
                return None
    return None


def check_channels(shards: ShardSet, index: str, in_chans: int) -> None:
    """ValueError when the model takes other than the DECODED_CHANNELS every shard decodes to."""
    if in_chans == DECODED_CHANNELS:
        return
    stored = stored_image(shards)
    held = f"hold PIL mode {stored[0]} images ({stored[1]} channel{'s' * (stored[1] > 1)}), which the " \
        f"loader decodes" if stored else "decode"
    raise ValueError(f"model.in_chans is {in_chans}, but the data has {DECODED_CHANNELS} channels: the shards "
                     f"of {index} {held} to {DECODED_CHANNELS}-channel RGB (grayscale is replicated); set "
                     f"--model.in_chans {DECODED_CHANNELS}")


def check_source(data_cfg, world: int, in_chans: int = 3) -> None:
    """Fail before any process starts when the shards cannot feed every rank and worker, or the
    model cannot take what they decode to; the evaluation index must be readable and labeled too,
    share no shard with the training index (check_held_out), and give the training shards' class
    names to the same labels (check_scored_against)."""
    shards = None
    if data_cfg.source == "shards":
        shards = train_shards(data_cfg)
        check_channels(shards, data_cfg.train_index, in_chans)
        check_split(shards, world, data_cfg.num_workers)
    if data_cfg.eval_index:
        try:
            scored = eval_shards(data_cfg)
        except (OSError, ValueError) as e:  # a missing file / ShardIndexError
            raise ValueError(f"data.eval_index: {e}") from None
        check_channels(scored, data_cfg.eval_index, in_chans)  # else the first evaluation fails, mid-run
        if shards is not None and shards.labeled:  # unlabeled: the objective's own check refuses it (train/config/options.py)
            check_scored_against(scored, shards, "data.eval_index", "data.train_index")
        if shards is not None:
            check_held_out(scored, shards, "data.eval_index", "data.train_index")


def build_source(data_cfg, img_size: int, in_chans: int, batch_size: int, seed: int, rank: int, world: int,
                 device: torch.device, split: LabeledSplit | None = None, val_every: int = 1):
    """The training stream; with a labeled split, D_tr batches carrying a D_val batch every
    `val_every` (data/split.py)."""
    crops = data_cfg.num_crops if data_cfg.train_transform == "multicrop" else 0  # synthetic: the same shape
    if split is not None:
        val_seed = seed + 1_000_003  # the D_val stream's own order and augmentation
        if data_cfg.source == "synthetic":
            return SplitSource(SyntheticImages(batch_size, img_size, in_chans, data_cfg.num_classes, seed, rank, device,
                                               crops),
                               SyntheticImages(batch_size, img_size, in_chans, data_cfg.num_classes, val_seed, rank,
                                               device, crops), val_every)
        return SplitSource(_shard_loader(data_cfg, img_size, in_chans, batch_size, seed, rank, world, device,
                                         split.keep_train),
                           _shard_loader(data_cfg, img_size, in_chans, batch_size, val_seed, rank, world, device,
                                         split.is_val), val_every)
    if data_cfg.source == "synthetic":
        return SyntheticImages(batch_size, img_size, in_chans, data_cfg.num_classes, seed, rank, device, crops)
    return _shard_loader(data_cfg, img_size, in_chans, batch_size, seed, rank, world, device)


def _shard_loader(data_cfg, img_size: int, in_chans: int, batch_size: int, seed: int, rank: int, world: int,
                  device: torch.device, keep=None) -> ShardLoader:
    if in_chans != 3:
        raise ValueError("shards decode to 3-channel RGB (grayscale is replicated); set model.in_chans 3")
    scale = (data_cfg.crop_scale_min, 1.0)
    if data_cfg.train_transform == "randaug":
        from data.transforms import RandAugTransform

        transform = RandAugTransform(img_size, scale, data_cfg.randaug, data_cfg.reprob)
    elif data_cfg.train_transform == "multicrop":  # MAE+: (k, 3, s, s) per image
        from data.transforms import MultiCropTransform

        transform = MultiCropTransform(img_size, data_cfg.num_crops, scale, decode=data_cfg.decode)
    elif data_cfg.decode == "nvjpeg":
        from data.device_decode import EncodedCropTransform

        transform = EncodedCropTransform(img_size, scale)
    else:
        transform = PretrainTransform(img_size, scale, decode=data_cfg.decode)
    return ShardLoader(train_shards(data_cfg), img_size, batch_size, seed, rank, world, data_cfg.num_workers,
                       data_cfg.shuffle_buffer, data_cfg.crop_scale_min, pin_memory=device.type == "cuda",
                       transform=transform, keep=keep, device=device, max_bad_fraction=data_cfg.max_bad_fraction,
                       max_image_pixels=data_cfg.max_image_pixels)


def fixed_images(data_cfg, img_size: int, in_chans: int, n: int = 8) -> torch.Tensor:
    """The same n images at every call (for figures): the first samples of the first shard with
    the evaluation transform, or a synthetic batch from a seed of its own. Reads nothing from the
    training stream, so taking them changes no batch of training."""
    if data_cfg.source == "synthetic":
        return next(SyntheticImages(n, img_size, in_chans, data_cfg.num_classes, seed=2**31 - 1, rank=0))["image"]
    from data.shards import decode, raw_samples
    from data.transforms import EvalTransform

    shards, transform = train_shards(data_cfg), EvalTransform(img_size, crop_pct=1.0)
    images = []
    for raw in raw_samples(list(shards.files), Counter()):
        try:
            images.append(transform(decode(raw, shards.labels)[0]))
        except (KeyError, OSError, ValueError, SyntaxError):
            continue
        if len(images) == n:
            break
    return torch.stack(images)
