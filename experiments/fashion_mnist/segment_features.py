"""Do MixedAE's frozen features depend on the segment embedding the encoder was pretrained with?

    python -m experiments.fashion_mnist.segment_features RUN_DIR --train_index train.json \\
        --test_index test.json [--tags step00004680] [--sources 0] [--max_train 0] [--max_test 0]

MixedAE adds a segment embedding (the sin-cos code of an image's index in its group) to the input
of every encoder block, at every pretraining step. The exported encoder is a plain ViT, so the
study's kNN and linear probe read single images without it: every block's input then lacks a
vector the encoder never saw missing. This tool measures what that costs. For each checkpoint
tag (default: the last) it prints one JSON line with kNN (k = 20) and linear-probe top-1 on
frozen cls features, computed
- `without`: no segment embedding, the study's protocol (the table's numbers, up to float
  rounding when the tag is the exported one);
- `source<s>`: the embedding of source s added to every patch token's block input, the cls token
  getting none, as in pretraining. Source 0 is BERT's convention for one-segment inputs; each
  image met every source index in pretraining, so any s is as familiar to the encoder.

Global attention throughout: a single image is all one source, so homologous attention would
only restrict which of its own keys each query sees.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from experiments.fashion_mnist.run_checkpoints import (
    build_run_objective,
    chosen_tags,
    load_tag,
    probe_set,
)
from kernels import GLOBAL
from model.objectives.mixedae import MixedAEObjective
from train.engine.checkpoint import read_meta
from train.run.evaluation import DecodedSet, knn_top1, linear_probe_top1


@torch.no_grad()
def cls_features(obj: MixedAEObjective, images: torch.Tensor, source: int | None,
                 batch_size: int = 256) -> torch.Tensor:
    """(M, C, H, W) -> (M, D) cls features after the final norm; `source` None adds no segment
    embedding (the exported encoder's features), else source s's embedding on every patch token."""
    if source is not None and not 0 <= source < obj.g:
        raise ValueError(f"source {source} is not a segment index of this run: choose one in 0..{obj.g - 1}")
    enc, feats = obj.encoder, []
    for chunk in images.split(batch_size):
        x = enc.add_cls_token(enc.embed_patches(chunk))  # (B, 1+N, D)
        block_input = None
        if source is not None:
            segments = torch.full(x.shape[:2], source, dtype=torch.long, device=x.device)  # (B, 1+N)
            segments[:, 0] = GLOBAL  # cls: no segment embedding, as in pretraining
            block_input = obj.segment_input(segments, x.dtype)
        feats.append(enc.forward_tokens(x, block_input)[:, 0])
    return torch.cat(feats)


def probe_accuracies(obj: MixedAEObjective, train: DecodedSet, test: DecodedSet, sources: list[int]) -> dict:
    """{"without": {...}, "source<s>": {...}}: kNN and linear-probe top-1 (%) for each way of
    feeding the segment embedding."""
    out = {}
    for source in [None, *sources]:
        train_f, test_f = cls_features(obj, train.images, source), cls_features(obj, test.images, source)
        args = (train_f, train.labels, test_f, test.labels, len(train.classes))
        out["without" if source is None else f"source{source}"] = {
            "knn_top1": round(knn_top1(*args), 2), "linear_probe_top1": round(linear_probe_top1(*args), 2)}
    return out


def mixedae_with_segments(run: Path) -> MixedAEObjective:
    """The run's MixedAE objective at init; refused when it pretrained without segment embeddings."""
    obj = build_run_objective(run, "mixedae")
    if not obj.cfg.segment_embed:
        raise ValueError(f"{run} pretrained without segment embeddings (mixedae.segment_embed false): "
                         f"its features have none to add")
    return obj


def segment_reports(obj: MixedAEObjective, tags: list[Path], train: DecodedSet, test: DecodedSet,
                    sources: list[int]) -> Iterator[dict]:
    """probe_accuracies at each checkpoint tag, loaded into `obj` in turn (each one as it is done:
    a tag takes minutes on the full Fashion-MNIST splits)."""
    for tag in tags:
        yield {"tag": tag.name, "step": read_meta(tag)["step"], **probe_accuracies(load_tag(obj, tag), train, test, sources)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a mixedae run folder (config.json, ds_config.json, checkpoints/)")
    p.add_argument("--train_index", required=True, help="labeled shard index the kNN and probe fit on")
    p.add_argument("--test_index", required=True, help="labeled shard index they are scored on")
    p.add_argument("--tags", default="", help="comma-separated checkpoint tags (default: the last complete one)")
    p.add_argument("--sources", default="0", help="comma-separated segment indices to feed (default %(default)s)")
    p.add_argument("--max_train", type=int, default=0, help="seeded subset of the train index; 0 = all (default)")
    p.add_argument("--max_test", type=int, default=0, help="seeded subset of the test index; 0 = all (default)")
    p.add_argument("--subset_seed", type=int, default=0, help="seed of the subsets (default %(default)s)")
    a = p.parse_args(argv)
    tags = chosen_tags(p, a.run, a.tags)
    if not a.tags:
        tags = tags[-1:]
    try:
        sources = [int(s) for s in a.sources.split(",")]
    except ValueError:
        p.error(f"--sources takes comma-separated integers, got {a.sources!r}")
    try:
        obj = mixedae_with_segments(a.run)
        img_size = obj.encoder.patch_embed.img_size  # decoded as the study's evaluation does
        train = probe_set(a.train_index, a.max_train, img_size, a.subset_seed)
        test = probe_set(a.test_index, a.max_test, img_size, a.subset_seed)
        reports = []
        for report in segment_reports(obj, tags, train, test, sources):
            print(json.dumps(report), flush=True)
            reports.append(report)
    except ValueError as e:
        p.error(str(e))
    return reports


if __name__ == "__main__":
    main()
