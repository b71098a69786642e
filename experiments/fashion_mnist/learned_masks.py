"""What MLO-MAE's masking network T gives at each checkpoint of a run, on labeled test images:
does it still read the image, or has it collapsed to one saturated mask for every image?

    python -m experiments.fashion_mnist.learned_masks RUN_DIR [--tags step00000375,step00001125] \\
        [--index test.json] [--images 1000]

One JSON line per checkpoint tag (default: every complete tag of the run, oldest first): the
statistics the run logs per step (masking_net.mask_statistics), here over the same `--images`
images (a seeded subset of `--index`, default the run's `data.eval_index`) for every tag, plus
`distinct_masks` (different top-k masks among them; 1 = image-independent) and `always_masked`
(patches masked in every image). T is replicated, kept in the objective's extra state of a tag
(run_checkpoints.py).
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
from model.objectives.masking_net import mask_statistics, top_masking
from model.objectives.mlomae import MLOMAEObjective


@torch.no_grad()
def mask_report(obj: MLOMAEObjective, images: torch.Tensor, batch_size: int = 500) -> dict:
    """(M, C, H, W) images -> mask_statistics over all M, distinct_masks, always_masked."""
    probs = torch.cat([obj.mask_probabilities(chunk)[1] for chunk in images.split(batch_size)])  # (M, N)
    mask = top_masking(probs, obj.cfg.mask_ratio).mask  # (M, N) 1 = masked
    stats = {k: round(v.item(), 5) for k, v in mask_statistics(probs, mask).items()}
    return {"images": len(images), "patches": probs.shape[1],
            "distinct_masks": len(torch.unique(mask.to(torch.uint8), dim=0)),
            "always_masked": int((mask == 1).all(0).sum()), **stats}


def mask_reports(run: Path, tags: list[Path], index: str, images: int = 1000, subset_seed: int = 1) -> list[dict]:
    """mask_report of each tag, all on the same `images` images of the labeled shard index."""
    return probe_tags(run, "mlomae", tags, index, images, subset_seed, mask_report)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_probe_options(p, "mlomae", images=1000)
    p.add_argument("--index", default="", help="labeled shard index of the images; empty = the run's "
                                                "data.eval_index (default: empty)")
    a = p.parse_args(argv)
    tags = chosen_tags(p, a.run, a.tags)
    index = a.index or json.loads((a.run / "config.json").read_text())["data"]["eval_index"]
    if not index:
        p.error(f"{a.run} trained without data.eval_index: name the images with --index <labeled shard index>")
    reports = mask_reports(a.run, tags, index, a.images, a.subset_seed)
    for report in reports:
        print(json.dumps(report))
    return reports


if __name__ == "__main__":
    main()
