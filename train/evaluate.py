"""Evaluation on frozen features: weighted kNN and a linear probe, on any labeled shard set.

    python -m train.evaluate --train_index shards/train.json --test_index shards/test.json \
        (--encoder runs/x/encoder.safetensors | --encoder mae_pretrain_vit_base.pth | --checkpoint runs/x
         | --random_init vit_mini_patch4 [--img_size 32]) \
        [--pool cls|avg] [--max_train N] [--max_test N] [--subset_seed S] [--out eval.json]

--max_train / --max_test evaluate on a seeded subset of that many samples (0 = all): the same
samples for every encoder and every run with the same seed; only those are decoded.

kNN: cosine similarity, k = 20 nearest training features, votes weighted by exp(sim / 0.07)
(DINO's protocol). Linear probe: features standardised with the training mean/std, one linear
layer trained full-batch with L-BFGS on cross-entropy plus a small L2 penalty. This is the quick
probe for small data sets; the MAE LARS protocol is train/linprobe.py.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from data.cli import Parser, read_json
from data.folders import unwritable_file
from data.loader import resolve_num_workers
from data.progress import Progress
from data.shards import ShardSet, decode, raw_samples, shard_samples
from data.source import DECODED_CHANNELS
from data.transforms import EvalTransform
from model.interop import resize_pos_embed
from model.timm_backbone import TimmBackbone
from model.vit import VisionTransformer
from train.config import ConfigError

OUR_ARCH_KEYS = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias")


def encoder_from_timm_kwargs(kwargs: dict, img_size: int = 0) -> VisionTransformer | TimmBackbone:
    if "timm_model" in kwargs:  # a timm backbone (model/timm_backbone.py)
        return TimmBackbone(kwargs["timm_model"], img_size or kwargs["img_size"], kwargs["in_chans"])
    arch = {k: kwargs[k] for k in OUR_ARCH_KEYS} | ({"img_size": img_size} if img_size else {})
    return VisionTransformer(**arch, rpe=kwargs.get("rpe", False), global_pool="token", num_classes=0)


def load_state_any_size(model: VisionTransformer, state: dict) -> None:
    """Strict load; an encoder trained at another resolution (MAE+ crops) gets this model's own
    sin-cos `pos_embed` for its grid, or, when its table was learned (fine-tuned), that table
    interpolated (model/interop.py resize_pos_embed)."""
    if "pos_embed" in state and state["pos_embed"].shape != model.pos_embed.shape:
        state = {**state, "pos_embed": resize_pos_embed(state["pos_embed"], model.patch_embed.grid_size)}
    model.load_state_dict(state, strict=True)


def load_encoder(encoder: str | None = None, checkpoint: str | None = None, random_init: str | None = None,
                 img_size: int = 0, seed: int = 0) -> VisionTransformer:
    """Exactly one source: an exported .safetensors (+ .json), a run/checkpoint folder, or a registry name.
    img_size (0 = the encoder's own) evaluates at another resolution (e.g. an MAE+ encoder at full size)."""
    if sum(x is not None for x in (encoder, checkpoint, random_init)) != 1:
        raise ValueError("give exactly one of --encoder, --checkpoint, --random_init")
    if random_init is not None:
        from model.registry import create_model

        torch.manual_seed(seed)
        return create_model(random_init, **({"img_size": img_size} if img_size else {}))
    if encoder is not None:
        path = Path(encoder)
        if not path.with_suffix(".json").is_file():  # an official MAE / timm checkpoint
            from model.interop import encoder_from_state, safe_load, split_official_mae

            return encoder_from_state(split_official_mae(safe_load(path))[0])
        kwargs = json.loads(path.with_suffix(".json").read_text())["timm_kwargs"]
        model = encoder_from_timm_kwargs(kwargs, img_size)
        load_state_any_size(model, load_file(str(path)))
        return model
    from train.checkpoint import find_resume
    from train.export import encoder_state

    state, meta = encoder_state(find_resume(checkpoint, Path(checkpoint)))
    model = encoder_from_timm_kwargs(meta["encoder_timm_kwargs"], img_size)
    load_state_any_size(model, state)
    return model


@dataclasses.dataclass(frozen=True)
class ShardSubset(ShardSet):
    """Some samples of a shard set: `keep[i]` holds the positions (sample order in the tar) read
    from `files[i]`; `counts[i]` = len(keep[i])."""

    keep: tuple[frozenset[int], ...] = ()


def subsample(shards: ShardSet, max_samples: int, seed: int) -> ShardSet:
    """A seeded subset of `max_samples` samples (all of them when max_samples is 0 or covers the
    set): positions drawn without replacement over the index's sample counts, so the subset
    depends only on (index, max_samples, seed), not on the encoder or the number of workers."""
    total = shards.num_samples
    if max_samples < 0:
        raise ValueError(f"the subset size must be >= 0 (0 = all samples), got {max_samples}")
    if max_samples == 0 or max_samples >= total:
        return shards
    chosen = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:max_samples].sort().values
    ends = torch.tensor(shards.counts).cumsum(0)  # (num_shards,) first global index after each shard
    shard_of = torch.searchsorted(ends, chosen, right=True)  # (max_samples,)
    starts = ends - torch.tensor(shards.counts)
    positions: dict[int, set[int]] = {}
    for i, g in zip(shard_of.tolist(), chosen.tolist()):
        positions.setdefault(i, set()).add(g - int(starts[i]))
    ids = sorted(positions)
    same = {f.name: getattr(shards, f.name) for f in dataclasses.fields(ShardSet)}  # classes, labels, index
    return ShardSubset(**same | {"files": tuple(shards.files[i] for i in ids),
                                 "counts": tuple(len(positions[i]) for i in ids)},
                       keep=tuple(frozenset(positions[i]) for i in ids))


class EvalStream(torch.utils.data.IterableDataset):
    """Every sample of a shard set (of a ShardSubset: its kept samples) once, in shard order,
    split by worker; corrupt ones skipped."""

    def __init__(self, shards: ShardSet, transform: EvalTransform):
        super().__init__()
        self.shards, self.transform = shards, transform

    def _raw(self, worker: int, workers: int):
        files = list(self.shards.files[worker::workers])
        if not isinstance(self.shards, ShardSubset):
            yield from raw_samples(files, Counter())  # eval skips silently
            return
        for f, keep in zip(files, self.shards.keep[worker::workers], strict=True):
            for pos, raw in enumerate(shard_samples(f, Counter())):
                if pos in keep:
                    yield raw

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for raw in self._raw(worker, workers):
            try:
                img, label = decode(raw, self.shards.labels)
            except (KeyError, OSError, ValueError, SyntaxError):
                continue
            yield self.transform(img), label


class DecodedSet(NamedTuple):
    """A labeled shard set decoded and transformed once, for evaluating many encoders of one input
    size (the study): decoding costs more than the mini ViT's forward pass."""

    images: torch.Tensor  # (N, 3, H, W) float32, EvalTransform(H, crop_pct=1.0) applied
    labels: torch.Tensor  # (N,) int64
    classes: tuple[str, ...]


def _eval_batches(shards: ShardSet, img_size: int, batch_size: int, num_workers: int):
    return torch.utils.data.DataLoader(EvalStream(shards, EvalTransform(img_size, crop_pct=1.0)),
                                       batch_size=batch_size, num_workers=num_workers,
                                       generator=torch.Generator().manual_seed(0))  # leave the global RNG alone


def decode_all(shards: ShardSet, img_size: int, num_workers: int = 1, what: str = "decoding") -> DecodedSet:
    images, labels = [], []
    with Progress(what, shards.num_samples, "images") as progress:
        for x, y in _eval_batches(shards, img_size, 1024, num_workers):
            images.append(x)
            labels.append(y)
            progress.update(len(y))
    return DecodedSet(torch.cat(images), torch.cat(labels), tuple(shards.classes))


@torch.no_grad()
def extract_features(model: VisionTransformer, source: ShardSet | DecodedSet, batch_size: int = 256,
                     num_workers: int = 1, pool: str = "cls",
                     what: str = "features") -> tuple[torch.Tensor, torch.Tensor]:
    """(num_samples, D) features after the final norm: cls token or mean of patch tokens (a timm
    backbone: its own pooled features)."""
    model.eval()
    if isinstance(source, DecodedSet):
        if source.images.shape[-1] != model.img_size:
            raise ValueError(f"decoded at {source.images.shape[-1]} px, the encoder takes {model.img_size} px")
        batches = zip(source.images.split(batch_size), source.labels.split(batch_size))
    else:
        batches = _eval_batches(source, model.img_size, batch_size, num_workers)
    feats, labels = [], []
    total = len(source.labels) if isinstance(source, DecodedSet) else source.num_samples
    with Progress(what, total, "images") as progress:
        for images, y in batches:
            feats.append(model.pooled_features(images, pool))  # (B, D)
            labels.append(y)
            progress.update(len(y))
    return torch.cat(feats), torch.cat(labels)


@torch.no_grad()
def classification_accuracy(predict, shards: ShardSet, img_size: int, crop_pct: float, rank: int, world: int,
                            device: torch.device, dtype: torch.dtype, batch_size: int = 256,
                            num_workers: int = 1) -> dict[str, float]:
    """Top-1 / top-5 (%) of `predict(images) -> logits` over a labeled shard set; rank r reads
    shards r, r + world, ...; counts are summed over ranks. Uses no global RNG. num_workers -1:
    data.num_workers' auto (data/loader.py)."""
    num_workers = resolve_num_workers(num_workers)
    mine = dataclasses.replace(shards, files=shards.files[rank::world], counts=shards.counts[rank::world])
    loader = torch.utils.data.DataLoader(EvalStream(mine, EvalTransform(img_size, crop_pct)), batch_size=batch_size,
                                         num_workers=num_workers if mine.files else 0,
                                         generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # correct@1, correct@5, seen
    for images, labels in loader:
        logits = predict(images.to(device, dtype))
        labels = labels.to(device)
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices  # (B, 5)
        counts += torch.stack([(top[:, 0] == labels).sum(), (top == labels[:, None]).any(1).sum(),
                               torch.tensor(len(labels), device=device)]).double()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts)
    correct1, correct5, seen = counts.tolist()
    return {"eval_top1": 100 * correct1 / max(seen, 1), "eval_top5": 100 * correct5 / max(seen, 1),
            "eval_samples": int(seen)}


def knn_top1(train_f: torch.Tensor, train_y: torch.Tensor, test_f: torch.Tensor, test_y: torch.Tensor,
             num_classes: int, k: int = 20, temperature: float = 0.07, chunk: int = 1024) -> float:
    """Weighted kNN accuracy (%): cosine similarity, votes exp(sim / T) over the k nearest."""
    train_f, test_f = F.normalize(train_f.float(), dim=1), F.normalize(test_f.float(), dim=1)
    correct = 0
    with Progress("kNN", len(test_f), "images") as progress:
        for i in range(0, len(test_f), chunk):
            sim = test_f[i : i + chunk] @ train_f.T  # (b, n_train)
            top_sim, top_idx = sim.topk(min(k, len(train_f)), dim=1)  # (b, k); a small subset may hold fewer
            votes = torch.zeros(len(top_sim), num_classes)
            votes.scatter_add_(1, train_y[top_idx], (top_sim / temperature).exp())
            correct += (votes.argmax(1) == test_y[i : i + chunk]).sum().item()
            progress.update(len(top_sim))
    return 100.0 * correct / len(test_f)


def linear_probe_top1(train_f: torch.Tensor, train_y: torch.Tensor, test_f: torch.Tensor, test_y: torch.Tensor,
                      num_classes: int, weight_decay: float = 1e-4, max_iter: int = 200) -> float:
    """Accuracy (%) of a linear classifier on standardised features, fitted full-batch by L-BFGS."""
    mean, std = train_f.mean(0), train_f.std(0) + 1e-6
    xtr, xte = (train_f - mean) / std, (test_f - mean) / std
    head = torch.nn.Linear(xtr.shape[1], num_classes)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    opt = torch.optim.LBFGS(head.parameters(), lr=1.0, max_iter=max_iter, history_size=20,
                            line_search_fn="strong_wolfe")
    progress = Progress("linear probe (L-BFGS)", max_iter * 5 // 4, "evaluations")  # LBFGS's default max_eval

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(head(xtr), train_y) + weight_decay * head.weight.pow(2).sum()
        loss.backward()
        progress.update()
        return loss

    with torch.enable_grad(), progress:
        opt.step(closure)
    with torch.no_grad():
        return 100.0 * (head(xte).argmax(1) == test_y).float().mean().item()


def evaluate(model: VisionTransformer, train: ShardSet | DecodedSet, test: ShardSet | DecodedSet, pool: str = "cls",
             num_workers: int = 1) -> dict[str, float]:
    train_f, train_y = extract_features(model, train, pool=pool, num_workers=num_workers, what="train features")
    test_f, test_y = extract_features(model, test, pool=pool, num_workers=num_workers, what="test features")
    num_classes = len(train.classes)
    return {
        "knn_top1": knn_top1(train_f, train_y, test_f, test_y, num_classes),
        "linear_probe_top1": linear_probe_top1(train_f, train_y, test_f, test_y, num_classes),
    }


def input_channels(model) -> int:
    """The channels an encoder's input has (a timm backbone records them; our ViT's patch embedding holds them)."""
    return getattr(model, "in_chans", None) or model.patch_embed.proj.in_channels


def checked_encoder(a: argparse.Namespace):
    """The encoder the options name, loaded and checked against the shards (3-channel RGB) and
    --img_size; ConfigError naming the option, both values and the fix."""
    given = [f"--{k}" for k in ("encoder", "checkpoint", "random_init") if getattr(a, k) is not None]
    if len(given) != 1:
        raise ConfigError(f"give exactly one of --encoder, --checkpoint, --random_init (got {', '.join(given) or 'none'})")
    if a.encoder is not None:
        path = Path(a.encoder)
        if not path.is_file():
            raise ConfigError(f"--encoder {path} {'is a folder' if path.is_dir() else 'does not exist'}: give an "
                              f"exported encoder.safetensors (with its .json beside it), an official MAE or a timm "
                              f"checkpoint; for a run folder use --checkpoint")
        if path.with_suffix(".json").is_file():
            read_json(path.with_suffix(".json"), "the encoder's description")  # malformed: named with line and column
    if a.checkpoint is not None:
        from train.export import find_checkpoint

        a.checkpoint = str(find_checkpoint(a.checkpoint, "--checkpoint"))
    source = a.encoder or a.checkpoint or a.random_init
    try:
        model = load_encoder(a.encoder, a.checkpoint, a.random_init, a.img_size, a.seed)
    except (ValueError, RuntimeError, KeyError) as e:  # not weights, weights of another shape, a size that does not fit
        size = (f" (--img_size {a.img_size}: give a multiple of the encoder's patch size, or 0 for its own size)"
                if a.img_size and "divisible" in str(e) else "")
        raise ConfigError(f"{given[0]} {source}: {e}{size}") from None
    channels = input_channels(model)
    if channels != DECODED_CHANNELS:
        raise ConfigError(f"{given[0]} {source} takes {channels}-channel images, the shards decode to "
                          f"{DECODED_CHANNELS}-channel RGB (grayscale replicated): evaluate an encoder trained with "
                          f"model.in_chans {DECODED_CHANNELS}")
    return model


def main(argv: list[str] | None = None) -> dict:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_index", required=True, help="labeled shard index the kNN / probe fit on")
    p.add_argument("--test_index", required=True, help="labeled shard index scored")
    p.add_argument("--encoder", help="exported encoder.safetensors (+ .json), official MAE or timm checkpoint")
    p.add_argument("--checkpoint", help="run folder or checkpoint tag folder")
    p.add_argument("--random_init", help="registry name: the same architecture at random init (control)")
    p.add_argument("--img_size", type=int, default=0, help="evaluation resolution; 0 = the encoder's own (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of --random_init (default %(default)s)")
    p.add_argument("--pool", choices=["cls", "avg"], default="cls", help="feature: cls token or patch mean (default %(default)s)")
    p.add_argument("--num_workers", type=int, default=1, help="decode workers (default %(default)s)")
    p.add_argument("--max_train", type=int, default=0, help="evaluate on this many training samples; 0 = all (default %(default)s)")
    p.add_argument("--max_test", type=int, default=0, help="evaluate on this many test samples; 0 = all (default %(default)s)")
    p.add_argument("--subset_seed", type=int, default=0, help="seed of the --max_train / --max_test subsets (default %(default)s)")
    p.add_argument("--out", help="also write the result JSON here")
    a = p.parse_args(argv)
    if min(a.max_train, a.max_test) < 0:
        p.error("--max_train and --max_test must be >= 0 (0 = all samples)")
    if a.img_size < 0 or a.num_workers < 0:
        p.error("--img_size and --num_workers must be >= 0")
    if a.out and (problem := unwritable_file(Path(a.out))):
        raise ConfigError(f"--out {a.out} {problem}")
    try:
        train_set, test_set = ShardSet.from_index(a.train_index), ShardSet.from_index(a.test_index)
        train_set.require_labels("--train_index: the kNN and the linear probe fit on its labels")
        test_set.require_labels("--test_index: the kNN and the linear probe are scored against its labels")
    except (OSError, ValueError) as e:  # a missing or malformed index, an unlabeled one: exit 2
        raise ConfigError(str(e)) from None
    model = checked_encoder(a)
    train = subsample(train_set, a.max_train, a.subset_seed)
    test = subsample(test_set, a.max_test, a.subset_seed + 1)  # not the train positions
    result = evaluate(model, train, test, a.pool, a.num_workers)
    result |= {"train_samples": train.num_samples, "test_samples": test.num_samples}
    print(json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    from train.cli import cli

    cli(main)
