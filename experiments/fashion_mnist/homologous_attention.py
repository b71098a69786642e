"""What MixedAE's homologous TopK attention picks at each checkpoint of a run, on test images:
does each query keep keys of its own image more often than chance, and does that come from the
segment embeddings?

    python -m experiments.fashion_mnist.homologous_attention RUN_DIR --index test.json \\
        [--tags step00000468,step00004680] [--images 512]

One JSON line per checkpoint tag (default: every complete tag of the run, oldest first), all on
the same `--images` images (a seeded subset of the labeled shard index `--index`),
mixed the same way (a seeded draw) for every tag:
- `topk_acc`, `topk_acc_block<i>`: the TopK sampling accuracy the run logs per step (the share of
  each patch query's kept keys that come from its own image), here on those images;
- `without_segments_*`: the same with the segment embeddings left out of the encoder's input.
  Where it equals `topk_acc`, the attention does not use them to find its own image;
- `chance`: the share that keys drawn at random would give, K / (N + 1) (N patch keys, of which
  K come from the query's image, plus the cls key, never the query's own).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json
from pathlib import Path

import torch

from experiments.fashion_mnist.run_checkpoints import add_probe_options, chosen_tags, probe_tags
from model.objectives.mixedae import MixedAEObjective
from model.objectives.mixing import mix_images


@torch.no_grad()
def topk_shares(obj: MixedAEObjective, images: torch.Tensor, segments: bool, seed: int = 0,
                batch_size: int = 256) -> dict[str, float]:
    """(M, C, H, W) images -> TopK sampling accuracy per block and their mean, over all M images
    mixed in groups of g (a draw seeded by `seed` per batch); `segments` False leaves the segment
    embeddings out. Batches weigh by their number of mixed images."""
    saved, obj.cfg.segment_embed = obj.cfg.segment_embed, segments and obj.cfg.segment_embed
    try:
        sums: dict[str, float] = {}
        mixed_images = 0
        for i, chunk in enumerate(images.split(batch_size)):
            mixing = obj.draw_mixing(len(chunk), chunk.device, torch.Generator().manual_seed(seed + i))
            mixed = mix_images(chunk, mixing, obj.patch_size)  # (len(chunk) / g, C, H, W)
            _, stats = obj.encode_mixed(mixed, mixing.segment)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v.item() * len(mixed)
            mixed_images += len(mixed)
    finally:
        obj.cfg.segment_embed = saved
    return {k: round(v / mixed_images, 4) for k, v in sums.items()}


def has_topk(mixedae: dict) -> bool:
    """Whether a run's `mixedae` options (config.json) select keys by TopK on mixed images."""
    return mixedae.get("attention", "topk") == "topk" and mixedae.get("mixing", "compose") != "none"


def topk_report(obj: MixedAEObjective, images: torch.Tensor) -> dict:
    """One checkpoint (loaded into `obj`) on (M, C, H, W) images: chance, the shares with the
    segment embeddings and (when the run has them) without."""
    if not has_topk({"attention": obj.cfg.attention, "mixing": obj.cfg.mixing}):
        raise ValueError(f"this run has attention {obj.cfg.attention!r} and mixing {obj.cfg.mixing!r}: no homologous "
                         f"TopK selection on mixed images to read")
    if len(images) % obj.g:
        raise ValueError(f"{len(images)} images do not split into groups of g = {obj.g}: give a multiple of {obj.g}")
    n = obj.encoder.num_patches
    with_segments = topk_shares(obj, images, segments=True)
    without = topk_shares(obj, images, segments=False) if obj.cfg.segment_embed else {}
    chance = {} if obj.cfg.topk_per_source else {"chance": round(obj.topk / (n + 1), 4)}
    return {"images": len(images), **chance, **with_segments,
            **{f"without_segments_{k}": v for k, v in without.items()}}


def topk_reports(run: Path, tags: list[Path], index: str, images: int = 512, subset_seed: int = 1) -> list[dict]:
    """topk_report of each tag, all on the same images and mixings."""
    return probe_tags(run, "mixedae", tags, index, images, subset_seed, topk_report)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_probe_options(p, "mixedae", images=512, images_help=", a multiple of the group size")
    p.add_argument("--index", required=True, help="labeled shard index of the images (e.g. Fashion-MNIST's "
                                                    "test.json)")
    a = p.parse_args(argv)
    tags = chosen_tags(p, a.run, a.tags)
    try:
        reports = topk_reports(a.run, tags, a.index, a.images, a.subset_seed)
    except ValueError as e:
        p.error(str(e))
    for report in reports:
        print(json.dumps(report))
    return reports


if __name__ == "__main__":
    main()
