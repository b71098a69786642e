"""Evaluation on frozen features, for the evaluate command (train/evaluate.py) and a run's own
evaluation (train/run/trainer.py): encoders loaded from any weights file, shards decoded with the
skipped samples counted by kind, weighted kNN and a linear probe, and the classification accuracy
of an objective's classifier over every rank's share of labeled shards.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from PIL import Image

from data.cli import InputError, read_json
from data.faults import ERROR_KINDS, CorruptDataError, SampleError, ShardIndexError
from data.loader import resolve_num_workers
from data.progress import Progress
from data.shard_index import ShardSet
from data.shards import DECODE_ERRORS, decode, shard_samples
from data.transforms import EvalTransform
from model.interop import encoder_from_state, split_official_mae
from model.weights_reader import safe_load
from model.vit import VisionTransformer
from train.weights.described import CHECKPOINT_FIX, EXPORT_FIX, checkpoint_description, described_encoder

def load_encoder(encoder: str | None = None, checkpoint: str | None = None, random_init: str | None = None,
                 img_size: int = 0, seed: int = 0, num_heads: int = 0) -> VisionTransformer:
    """Exactly one source: an exported .safetensors (+ .json), a run/checkpoint folder, or a registry name.
    img_size (0 = the encoder's own) evaluates at another resolution (e.g. an MAE+ encoder at full size).
    num_heads (0 = by the width) is an official / timm checkpoint's, which its weights do not hold."""
    if sum(x is not None for x in (encoder, checkpoint, random_init)) != 1:
        raise ValueError("give exactly one of --encoder, --checkpoint, --random_init")
    if random_init is not None:
        from model.registry import create_model

        torch.manual_seed(seed)
        return create_model(random_init, **({"img_size": img_size} if img_size else {}))
    if encoder is not None:
        path = Path(encoder)
        if not path.with_suffix(".json").is_file():  # an official MAE / timm checkpoint
            size = {"img_size": img_size} if img_size else {}
            return encoder_from_state(split_official_mae(safe_load(path))[0], num_heads or None, **size)
        description = read_json(path.with_suffix(".json"), "the encoder's description")
        if not isinstance(description, dict) or "timm_kwargs" not in description:
            raise InputError(f"the encoder's description {path.with_suffix('.json')} holds no timm_kwargs (the "
                             f"encoder's architecture): {EXPORT_FIX}")
        return described_encoder(description["timm_kwargs"], safe_load(path),
                                 f"{path.with_suffix('.json')}: timm_kwargs", EXPORT_FIX, img_size)
    from train.engine.checkpoint import COMPLETE, find_resume
    from train.weights.export import encoder_state

    tag = find_resume(checkpoint, Path(checkpoint))
    state, meta = encoder_state(tag)
    return described_encoder(checkpoint_description(meta, tag, state), state,
                             f"{tag / COMPLETE}: encoder_timm_kwargs", CHECKPOINT_FIX, img_size)


LARGEST_PERMUTATION = 1 << 24  # positions a subset draws from by a permutation of them all (128 MiB of int64)


def _distinct_positions(total: int, count: int, seed: int) -> torch.Tensor:
    """`count` distinct positions in [0, total), seeded, in draw order. Up to LARGEST_PERMUTATION
    the first of a random permutation (the subsets evaluations have always used); past it, from
    repeated uniform draws keeping each position's first: memory grows with `count`, not with a
    total an index may claim."""
    generator = torch.Generator().manual_seed(seed)
    if total <= LARGEST_PERMUTATION:
        return torch.randperm(total, generator=generator)[:count]
    chosen: dict[int, None] = {}  # insertion-ordered: the draw order
    while len(chosen) < count:
        for position in torch.randint(total, (count - len(chosen),), generator=generator).tolist():
            chosen.setdefault(position)
    return torch.tensor(list(chosen), dtype=torch.long)


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
    chosen = _distinct_positions(total, max_samples, seed).sort().values
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


class Coverage(NamedTuple):
    """How much of a shard set an evaluation read: `listed` samples (its index's counts, or its
    subset's), `used` of them, and the others by why they were skipped (data/faults.py's kinds, in
    their order; truncated_shard counts the samples a shard cut short did not deliver)."""

    index: Path | None  # the shard index read
    listed: int
    used: int
    skipped: dict[str, int]

    @classmethod
    def of(cls, shards: ShardSet, used: int, skipped: Counter) -> "Coverage":
        return cls(shards.index, shards.num_samples, used, {k: skipped[k] for k in ERROR_KINDS if skipped[k]})

    def skips(self) -> str:
        """E.g. '2 skipped: undecodable_image 1, truncated_shard 1'."""
        kinds = ", ".join(f"{k} {n:,}" for k, n in self.skipped.items())
        return f"{sum(self.skipped.values()):,} skipped: {kinds}"

    def describe(self, what: str) -> str:
        """E.g. '9,998 of 10,000 test samples (2 skipped: undecodable_image 2)'."""
        said = f"{self.used:,} of {self.listed:,} {what} samples"
        return f"{said} ({self.skips()})" if self.skipped else said

    def require_some(self) -> None:
        """An evaluation of no sample is not an accuracy of 0: CorruptDataError naming the index."""
        if not self.used:
            raise CorruptDataError(f"none of the {self.listed:,} samples of the shard index {self.index} could be "
                                   f"used ({self.skips()}): fix or rewrite its shards (data/write_shards.py); "
                                   f"python -m data.verify {self.index} lists the bad ones")


class EvalStream(torch.utils.data.IterableDataset):
    """Every sample of a shard set (of a ShardSubset: its kept samples) once, in shard order, split
    by worker, in batches of up to `batch_size`: (images (B, C, H, W), labels (B,), skipped
    (len(ERROR_KINDS),)), where `skipped` counts by kind the samples this worker skipped since its
    previous batch. Each worker ends with a batch that may hold no image, carrying its last count."""

    def __init__(self, shards: ShardSet, transform: EvalTransform, batch_size: int):
        super().__init__()
        self.shards, self.transform, self.batch_size = shards, transform, batch_size

    def _shards(self, worker: int, workers: int):
        """(shard, the positions kept in it (None: all), the samples expected from it) of one worker."""
        files, counts = self.shards.files[worker::workers], self.shards.counts[worker::workers]
        keeps = self.shards.keep[worker::workers] if isinstance(self.shards, ShardSubset) else (None,) * len(files)
        return zip(files, keeps, counts, strict=True)

    def _samples(self, worker: int, workers: int, skipped: Counter):
        """(image, label) of each usable sample; the others counted in `skipped` by kind."""
        for shard, keep, expected in self._shards(worker, workers):
            delivered = 0
            for pos, raw in enumerate(shard_samples(shard, Counter())):
                if keep is not None and pos not in keep:
                    continue
                delivered += 1
                try:
                    img, label = decode(raw, self.shards.labels)
                    image = self.transform(img)
                except SampleError as e:
                    skipped[e.kind] += 1
                    continue
                except Image.DecompressionBombError:  # PIL checks GIF frames as it decodes
                    skipped["decompression_bomb"] += 1
                    continue
                except DECODE_ERRORS:
                    skipped["undecodable_image"] += 1
                    continue
                yield image, label
            skipped["truncated_shard"] += max(0, expected - delivered)

    @staticmethod
    def _batch(samples: list[tuple[torch.Tensor, int]], skipped: Counter):
        """One batch with the samples skipped since the previous one (`skipped` is emptied)."""
        counts = torch.tensor([skipped[k] for k in ERROR_KINDS])
        skipped.clear()
        images = torch.stack([x for x, _ in samples]) if samples else torch.empty(0)
        return images, torch.tensor([y for _, y in samples], dtype=torch.long), counts

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        skipped: Counter = Counter()
        batch: list[tuple[torch.Tensor, int]] = []
        for sample in self._samples(worker, workers, skipped):
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield self._batch(batch, skipped)
                batch = []
        yield self._batch(batch, skipped)


def eval_batches(shards: ShardSet, transform: EvalTransform, batch_size: int, num_workers: int, skipped: Counter):
    """The (images, labels) batches of an EvalStream read by `num_workers` DataLoader workers; the
    samples skipped are added to `skipped` by kind."""
    loader = torch.utils.data.DataLoader(EvalStream(shards, transform, batch_size), batch_size=None,
                                         num_workers=num_workers if shards.files else 0,
                                         generator=torch.Generator().manual_seed(0))  # leave the global RNG alone
    for images, labels, counts in loader:
        skipped.update({k: n for k, n in zip(ERROR_KINDS, counts.tolist(), strict=True) if n})
        if len(labels):
            yield images, labels


class DecodedSet(NamedTuple):
    """A labeled shard set decoded and transformed once, for evaluating many encoders of one input
    size (the study): decoding costs more than the mini ViT's forward pass."""

    images: torch.Tensor  # (N, 3, H, W) float32, EvalTransform(H, crop_pct=1.0) applied
    labels: torch.Tensor  # (N,) int64
    classes: tuple[str, ...]
    coverage: Coverage


def decode_all(shards: ShardSet, img_size: int, num_workers: int = 1, what: str = "decoding") -> DecodedSet:
    images, labels, skipped = [], [], Counter()
    with Progress(what, shards.num_samples, "images") as progress:
        for x, y in eval_batches(shards, EvalTransform(img_size, crop_pct=1.0), 1024, num_workers, skipped):
            images.append(x)
            labels.append(y)
            progress.update(len(y))
    coverage = Coverage.of(shards, sum(len(y) for y in labels), skipped)
    coverage.require_some()
    return DecodedSet(torch.cat(images), torch.cat(labels), tuple(shards.classes), coverage)


class Features(NamedTuple):
    features: torch.Tensor  # (N, D)
    labels: torch.Tensor  # (N,) int64
    coverage: Coverage


@torch.no_grad()
def extract_features(model: VisionTransformer, source: ShardSet | DecodedSet, batch_size: int = 256,
                     num_workers: int = 1, pool: str = "cls", what: str = "features") -> Features:
    """(num_samples, D) features after the final norm: cls token or mean of patch tokens (a timm
    backbone: its own pooled features), their labels, and which samples they cover (CorruptDataError
    when none)."""
    model.eval()
    skipped: Counter = Counter()
    if isinstance(source, DecodedSet):
        if source.images.shape[-1] != model.img_size:
            raise ValueError(f"decoded at {source.images.shape[-1]} px, the encoder takes {model.img_size} px")
        batches = zip(source.images.split(batch_size), source.labels.split(batch_size))
    else:
        batches = eval_batches(source, EvalTransform(model.img_size, crop_pct=1.0), batch_size, num_workers, skipped)
    feats, labels = [], []
    total = len(source.labels) if isinstance(source, DecodedSet) else source.num_samples
    with Progress(what, total, "images") as progress:
        for images, y in batches:
            feats.append(model.pooled_features(images, pool))  # (B, D)
            labels.append(y)
            progress.update(len(y))
    used = sum(map(len, labels))
    coverage = source.coverage if isinstance(source, DecodedSet) else Coverage.of(source, used, skipped)
    coverage.require_some()
    return Features(torch.cat(feats), torch.cat(labels), coverage)


@torch.no_grad()
def classification_accuracy(predict, shards: ShardSet, img_size: int, crop_pct: float, rank: int, world: int,
                            device: torch.device, dtype: torch.dtype, batch_size: int = 256,
                            num_workers: int = 1) -> dict[str, float]:
    """Top-1 / top-5 (%) of `predict(images) -> logits` over a labeled shard set; rank r reads
    shards r, r + world, ...; counts are summed over ranks. Uses no global RNG. num_workers -1:
    data.num_workers' auto (data/loader.py). With the samples scored (`eval_samples`) of those
    listed (`eval_listed`), and those skipped by kind (`eval_skipped_<kind>`, kinds with any);
    CorruptDataError on every rank when no sample could be scored."""
    num_workers = resolve_num_workers(num_workers)
    mine = dataclasses.replace(shards, files=shards.files[rank::world], counts=shards.counts[rank::world])
    skipped: Counter = Counter()
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # correct@1, correct@5, seen
    for images, labels in eval_batches(mine, EvalTransform(img_size, crop_pct), batch_size, num_workers, skipped):
        logits = predict(images.to(device, dtype))
        labels = labels.to(device)
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices  # (B, 5)
        counts += torch.stack([(top[:, 0] == labels).sum(), (top == labels[:, None]).any(1).sum(),
                               torch.tensor(len(labels), device=device)]).double()
    lost = torch.tensor([skipped[k] for k in ERROR_KINDS], dtype=torch.float64, device=device)  # (kinds,)
    counts = torch.cat([counts, lost])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts)
    correct1, correct5, seen, *lost_counts = counts.tolist()
    coverage = Coverage.of(shards, int(seen), Counter(dict(zip(ERROR_KINDS, map(int, lost_counts), strict=True))))
    coverage.require_some()
    return {"eval_top1": 100 * correct1 / seen, "eval_top5": 100 * correct5 / seen, "eval_samples": int(seen),
            "eval_listed": coverage.listed, **{f"eval_skipped_{k}": n for k, n in coverage.skipped.items()}}


def eval_summary(result: dict[str, float]) -> str:
    """classification_accuracy's result in words: 'top-1 85.10%, top-5 97.02% on 9,998 of 10,000
    evaluation samples (2 skipped: undecodable_image 2)'."""
    skipped = {k.removeprefix("eval_skipped_"): int(v) for k, v in result.items() if k.startswith("eval_skipped_")}
    coverage = Coverage(None, int(result["eval_listed"]), int(result["eval_samples"]), skipped)
    return f"top-1 {result['eval_top1']:.2f}%, top-5 {result['eval_top5']:.2f}% on {coverage.describe('evaluation')}"


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


def scores(train: Features, test: Features, num_classes: int) -> dict[str, float]:
    """kNN and linear-probe top-1 (%) of `test`, fitted on `train`, over the training set's classes.
    A label past them (shards whose labels the index does not record and its classes do not cover)
    is refused with ShardIndexError naming the index, rather than failing inside the kNN."""
    for f in (train, test):
        if int(f.labels.max()) >= num_classes:
            raise ShardIndexError(f"the shard index {f.coverage.index} holds label {int(f.labels.max())}, past the "
                                  f"{num_classes} classes of the training index: python -m data.verify "
                                  f"{f.coverage.index} names the samples; re-index the shards with a --classes file "
                                  f"naming every class (python -m data.index_shards)")
    if len(train.features) < 2:  # the probe standardises by the training features' std, NaN for one sample
        raise InputError(f"the linear probe would fit on {len(train.features)} training sample, and standardising "
                         f"its features needs at least 2: give more (--max_train 0 = all of them)")
    args = (train.features, train.labels, test.features, test.labels, num_classes)
    return {"knn_top1": knn_top1(*args), "linear_probe_top1": linear_probe_top1(*args)}


def evaluate(model: VisionTransformer, train: ShardSet | DecodedSet, test: ShardSet | DecodedSet, pool: str = "cls",
             num_workers: int = 1) -> dict[str, float]:
    return scores(extract_features(model, train, pool=pool, num_workers=num_workers, what="train features"),
                  extract_features(model, test, pool=pool, num_workers=num_workers, what="test features"),
                  len(train.classes))


def coverage_keys(train: Coverage, test: Coverage) -> dict:
    """The samples behind a result: `train_samples` / `test_samples` used, of `*_listed`, and those
    skipped by kind (`*_skipped`: {kind: count}, empty when none was)."""
    return {"train_samples": train.used, "test_samples": test.used, "train_listed": train.listed,
            "test_listed": test.listed, "train_skipped": train.skipped, "test_skipped": test.skipped}


def input_channels(model) -> int:
    """The channels an encoder's input has (a timm backbone records them; our ViT's patch embedding holds them)."""
    return getattr(model, "in_chans", None) or model.patch_embed.proj.in_channels
