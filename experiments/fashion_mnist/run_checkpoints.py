"""A pretraining run's objective rebuilt from its own config and loaded from any of its checkpoint
tags, for the tools that probe what a run learned (learned_masks.py: MLO-MAE's masking network;
homologous_attention.py: MixedAE's TopK attention; segment_features.py: MixedAE's frozen
features), and the test images they probe it on.

Reads a tag's whole module state (fp32 weights and any objective state kept outside them, e.g.
MLO-MAE's T: train/engine/state_files.py), whatever the ZeRO stage and world size that wrote it."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from data.shard_index import ShardSet
from model.objectives import build_objective
from model.objectives.base import Objective
from train.config.options import section
from train.config.parsing import parse_args
from train.config.plan import build_encoder
from train.engine.checkpoint import is_complete, read_meta
from train.engine.state_files import read_module_state
from train.run.evaluation import DecodedSet, decode_all, subsample


def build_run_objective(run: Path, objective: str) -> Objective:
    """The run's objective (its config.json), at init; refused when the run trained another one."""
    cfg = parse_args(["--config", str(run / "config.json"), "--ds_config", str(run / "ds_config.json")])
    if cfg.objective != objective:
        raise ValueError(f"{run} trained objective {cfg.objective!r}; this tool reads {objective!r} runs")
    return build_objective(cfg.objective, build_encoder(cfg), section(cfg))


def load_tag(obj: Objective, tag_dir: Path) -> Objective:
    """`obj` with the weights (and extra state) of one checkpoint tag of its run, in eval mode."""
    state = read_module_state(tag_dir)
    missing, unexpected = obj.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("decoder.") for k in missing):  # a decoder-less file is still read
        raise ValueError(f"{tag_dir} does not match the run's config: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    return obj.eval()


def complete_tags(run: Path) -> list[Path]:
    """The run's complete checkpoint tags, oldest first."""
    return sorted(t for t in (run / "checkpoints").glob("step*") if is_complete(t))


def probe_set(index: str | Path, images: int, img_size: int, subset_seed: int = 1) -> DecodedSet:
    """A seeded subset of `images` samples of a labeled shard index (0 = all), decoded as the
    evaluations do: images and labels."""
    return decode_all(subsample(ShardSet.from_index(index), images, subset_seed), img_size)


def probe_images(index: str | Path, images: int, img_size: int, subset_seed: int = 1) -> torch.Tensor:
    """(images, C, H, W): probe_set's images."""
    return probe_set(index, images, img_size, subset_seed).images


def probe_tags(run: Path, objective: str, tags: list[Path], index: str | Path, images: int, subset_seed: int,
               probe: Callable[[Objective, torch.Tensor], dict]) -> list[dict]:
    """`probe(objective, images)` at each tag, with the tag's name and step: the objective is built
    once and each tag loaded into it, all on the same images."""
    obj = build_run_objective(run, objective)
    decoded = probe_images(index, images, obj.encoder.patch_embed.img_size, subset_seed)
    return [{"tag": tag.name, "step": read_meta(tag)["step"], **probe(load_tag(obj, tag), decoded)} for tag in tags]


def add_probe_options(p: argparse.ArgumentParser, objective: str, images: int, images_help: str = "") -> None:
    """The options both probe tools take: the run folder, --tags, --images, --subset_seed (each
    tool adds its own --index)."""
    p.add_argument("run", type=Path, help=f"a {objective} run folder (config.json, ds_config.json, checkpoints/)")
    p.add_argument("--tags", default="", help="comma-separated checkpoint tags; empty = every complete tag "
                                               "(default: empty)")
    p.add_argument("--images", type=int, default=images,
                   help=f"images drawn from the index{images_help} (default %(default)s)")
    p.add_argument("--subset_seed", type=int, default=1, help="seed of the image subset (default %(default)s)")


def chosen_tags(p: argparse.ArgumentParser, run: Path, names: str) -> list[Path]:
    """The comma-separated tags of a --tags option, or every complete one; the parser's error when
    one is missing or incomplete."""
    tags = [run / "checkpoints" / t for t in names.split(",")] if names else complete_tags(run)
    if not tags or not all(is_complete(t) for t in tags):
        p.error(f"no complete checkpoint tag among {[t.name for t in tags] or 'none'} in {run / 'checkpoints'}")
    return tags
