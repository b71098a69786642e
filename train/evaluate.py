"""Evaluation on frozen features: weighted kNN and a linear probe, on any labeled shard set.

    python -m train.evaluate --train_index shards/train.json --test_index shards/test.json \
        (--encoder runs/x/encoder.safetensors | --encoder mae_pretrain_vit_base.pth [--num_heads H] | --checkpoint runs/x
         | --random_init vit_mini_patch4 [--img_size 32]) \
        [--pool cls|avg] [--max_train N] [--max_test N] [--subset_seed S] [--out eval.json [--overwrite]]

--max_train / --max_test evaluate on a seeded subset of that many samples (0 = all): the same
samples for every encoder and every run with the same seed; only those are decoded.

kNN: cosine similarity, k = 20 nearest training features, votes weighted by exp(sim / 0.07)
(DINO's protocol). Linear probe: features standardised with the training mean/std, one linear
layer trained full-batch with L-BFGS on cross-entropy plus a small L2 penalty. This is the quick
probe for small data sets; the MAE LARS protocol is train/linprobe.py.

The result says what was scored: the encoder (the --encoder file, the --checkpoint tag, or the
--random_init name and seed), the pooling (--pool) and the image size used (--img_size, or the
encoder's own for 0), in the printed line and as "encoder", "pool" and "img_size" in the JSON.
When the encoder's description says how it was trained and implies the other pooling (an export
or checkpoint of a fine-tuned encoder, global_pool avg; a checkpoint whose objective reads its own
`pool` option, e.g. energy's), a one-line note says so before the scores.

--out is written under a temporary name and renamed once complete; it replaces an existing file
only with --overwrite, and is refused even then when it is one of the inputs (an index, a shard,
the encoder or its .json) or lies inside the checkpoint evaluated.

The test index must give the training index's class names to the same labels (it may name only
the first of them) and share none of its shards: checked from the two indexes before any image is
decoded (data/shard_index.py check_scored_against, check_held_out). Samples that cannot be used
(data/faults.py's kinds) are skipped and counted: the result says how many of each set's samples
were used and why the others were not, and a set of which none could be used is refused (exit 2)
rather than scored 0.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import dataclasses
import json
from pathlib import Path

from data.cli import Parser, read_json, regular_file
from data.faults import CorruptDataError
from data.folders import unwritable_file
from data.loader import AUTO_WORKERS, resolve_num_workers
from data.outputs import check_output, written_whole
from data.shard_index import ShardSet, check_held_out, check_scored_against
from data.source import DECODED_CHANNELS
from model.weights_reader import WeightsFileError
from train.config.errors import ConfigError
from train.config.options import PretrainConfig
from train.config.values import Interval, check_range, from_text
from train.estimate.memory import GIB, ram
from train.run.evaluation import (  # noqa: F401  (also what scripts import from train.evaluate)
    Coverage,
    DecodedSet,
    EvalStream,
    Features,
    ShardSubset,
    classification_accuracy,
    coverage_keys,
    decode_all,
    eval_batches,
    eval_summary,
    evaluate,
    extract_features,
    input_channels,
    knn_top1,
    linear_probe_top1,
    load_encoder,
    scores,
    subsample,
)
from train.weights.described import (  # noqa: F401  (also what scripts import from train.evaluate)
    ENCODER_FILES,
    OUR_ARCH_KEYS,
    encoder_from_timm_kwargs,
    load_state_any_size,
)


def checked_encoder(a: argparse.Namespace):
    """The encoder the options name, loaded and checked against the shards (3-channel RGB) and
    --img_size; ConfigError naming the option, both values and the fix."""
    given = [f"--{k}" for k in ("encoder", "checkpoint", "random_init") if getattr(a, k) is not None]
    if len(given) != 1:
        raise ConfigError(f"give exactly one of --encoder, --checkpoint, --random_init (got {', '.join(given) or 'none'})")
    if a.encoder is not None:
        # judged from its stat alone: a FIFO or a device is never opened
        path = regular_file(a.encoder, "--encoder", f"{ENCODER_FILES}; for a run folder use --checkpoint")
        if path.with_suffix(".json").exists():  # malformed: named with line and column; a FIFO: refused unopened
            read_json(path.with_suffix(".json"), "the encoder's description")
    if a.checkpoint is not None:
        from train.weights.export import find_checkpoint

        a.checkpoint = str(find_checkpoint(a.checkpoint, "--checkpoint"))
    if a.num_heads < 0:
        raise ConfigError(f"--num_heads must be >= 0 (0 = by the width), got {a.num_heads}")
    if a.num_heads and (a.encoder is None or Path(a.encoder).with_suffix(".json").exists()):
        raise ConfigError("--num_heads is for an official MAE or timm checkpoint, whose weights do not hold it; an "
                          "export's .json, a run and a registry name give their own: leave it out")
    source = a.encoder or a.checkpoint or a.random_init
    try:
        model = load_encoder(a.encoder, a.checkpoint, a.random_init, a.img_size, a.seed, a.num_heads)
    except WeightsFileError as e:  # it names the file and what is wrong with it
        fix = ENCODER_FILES if a.encoder is not None else "give another of the run's checkpoints (checkpoints/step*)"
        raise ConfigError(f"{given[0]}: {e}; {fix}") from None
    except (ValueError, RuntimeError, KeyError) as e:  # not weights, weights of another shape, a size that does not fit
        size = (f" (--img_size {a.img_size}: give a multiple of the encoder's patch size, or 0 for its own size)"
                if a.img_size and "divisible" in str(e) else
                f" (--img_size {a.img_size}: the encoder at that size does not fit in memory; give a smaller size, or "
                f"0 for its own)" if a.img_size and "allocate" in str(e) else "")
        raise ConfigError(f"{given[0]} {source}: {e}{size}") from None
    channels = input_channels(model)
    if channels != DECODED_CHANNELS:
        raise ConfigError(f"{given[0]} {source} takes {channels}-channel images, the shards decode to "
                          f"{DECODED_CHANNELS}-channel RGB (grayscale replicated): evaluate an encoder trained with "
                          f"model.in_chans {DECODED_CHANNELS}")
    return model


def encoder_source(a: argparse.Namespace) -> tuple[str, str]:
    """(as said in the line, as recorded in the JSON) of the encoder scored: the --encoder file or
    the --checkpoint tag (absolute in the JSON, read back from elsewhere), or --random_init's name
    and seed."""
    if a.random_init is not None:
        said = f"random init {a.random_init} (seed {a.seed})"
        return said, said
    if a.encoder is not None:
        return a.encoder, str(Path(a.encoder).resolve())
    return f"checkpoint {a.checkpoint}", str(Path(a.checkpoint).resolve())  # the tag checked_encoder found


def _description(a: argparse.Namespace) -> dict:
    """What the encoder's description says of its training: an export's .json (timm_kwargs,
    objective), or a checkpoint's complete.json (encoder_timm_kwargs, config); {} when there is none
    (official MAE or timm weights, a random init) or it cannot be read."""
    try:
        if a.encoder is not None and Path(a.encoder).with_suffix(".json").is_file():
            found = json.loads(Path(a.encoder).with_suffix(".json").read_text())
            return {"timm_kwargs": found.get("timm_kwargs")} if isinstance(found, dict) else {}
        if a.checkpoint is not None:
            from train.engine.checkpoint import read_meta

            meta = read_meta(Path(a.checkpoint))
            return {"timm_kwargs": meta.get("encoder_timm_kwargs"), "config": meta.get("config"),
                    "objective": meta.get("objective")} if isinstance(meta, dict) else {}
    except (OSError, ValueError, RecursionError):  # load_encoder read it already: nothing to add here
        pass
    return {}


def implied_pool(a: argparse.Namespace) -> tuple[str, str] | None:
    """(pooling, why) the encoder's description implies for its features, or None when it says
    nothing of it. A fine-tuned encoder (global_pool avg) classified fc_norm of the patch mean, its
    cls token unnormalised; an objective with its own `pool` option (energy) trained on those
    features (the demo and the study score such a run on them)."""
    described = _description(a)
    kwargs, config = described.get("timm_kwargs"), described.get("config")
    if not isinstance(kwargs, dict) or "timm_model" in kwargs:  # a timm backbone pools as timm does, whatever --pool
        return None
    if kwargs.get("global_pool") == "avg":
        return "avg", "was fine-tuned with global_pool avg (its classifier read fc_norm of the patch mean)"
    objective = described.get("objective")
    own = config.get(objective) if isinstance(config, dict) and isinstance(objective, str) else None
    if isinstance(own, dict) and own.get("pool") in ("cls", "avg"):
        return own["pool"], f"trained {objective} on {objective}.pool {own['pool']} features"
    return None


def pool_note(a: argparse.Namespace) -> str | None:
    """A one-line note when --pool is not the pooling the encoder's description implies."""
    implied = implied_pool(a)
    if implied is None or implied[0] == a.pool:
        return None
    pool, why = implied
    return (f"note: --pool {a.pool}, but {encoder_source(a)[0]} {why}: docs/EVALUATION.md scores it with "
            f"--pool {pool}")


# training's seed range, read from its field (numpy takes seeds below 2**32)
SEEDS = Interval.parse(next(f for f in dataclasses.fields(PretrainConfig) if f.name == "seed").metadata["range"])
BATCH = 256  # images per batch of the feature extraction


def seed(text: str) -> int:
    """An argparse type: an integer in training's seed range."""
    try:
        value = from_text(int, text)
        check_range(value, SEEDS)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def checked_workers(num_workers: int, train: ShardSet, test: ShardSet) -> int:
    """--num_workers as the DataLoader takes it: -1 is training's auto (data.num_workers, capped by the
    shards); a count more than the larger set's shards is refused, as training refuses it (each
    worker reads whole shards: the others would start and read nothing)."""
    shards = max(len(train.files), len(test.files))
    try:
        workers = resolve_num_workers(num_workers, shards)
    except ValueError:
        raise ConfigError(f"--num_workers must be >= 0, or -1 for auto, got {num_workers}") from None
    if workers > max(1, shards):
        raise ConfigError(f"{shards} shards cannot feed {workers} workers: each reads whole shards. Write at least "
                          f"{workers} shards (data/write_shards.py with a smaller --samples_per_shard), or use fewer "
                          f"workers (--num_workers {shards}, or -1 for auto)")
    return workers


def check_batch_fits(img_size: int, train: ShardSet, test: ShardSet) -> None:
    """ConfigError when one batch of --img_size images exceeds this machine's memory: refused before
    the encoder is built at that size (its position table alone may not fit)."""
    if not img_size:
        return
    images = min(BATCH, max(train.num_samples, test.num_samples))
    need = images * DECODED_CHANNELS * img_size**2 * 4  # float32
    limit, where = ram()
    if need > limit:
        raise ConfigError(f"--img_size {img_size}: one batch of {images} images of {DECODED_CHANNELS} x {img_size} x "
                          f"{img_size} float32 needs {need / GIB:,.1f} GiB, more than the {limit / GIB:,.1f} GiB of "
                          f"{where}; give a smaller --img_size (0 = the encoder's own)")


def evaluation_inputs(a: argparse.Namespace, train: ShardSet, test: ShardSet) -> list[Path]:
    """What --out may not be nor lie inside: the indexes and their shards, the encoder and its
    .json, the checkpoint tag (its run folder may hold the result)."""
    inputs = [Path(a.train_index), Path(a.test_index), *map(Path, train.files), *map(Path, test.files)]
    if a.encoder is not None:
        inputs += [Path(a.encoder), Path(a.encoder).with_suffix(".json")]
    if a.checkpoint is not None:  # the tag folder checked_encoder found
        inputs.append(Path(a.checkpoint))
    return inputs


def main(argv: list[str] | None = None) -> dict:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_index", required=True, help="labeled shard index the kNN / probe fit on")
    p.add_argument("--test_index", required=True, help="labeled shard index scored")
    p.add_argument("--encoder", help="exported encoder.safetensors (+ .json), official MAE or timm checkpoint")
    p.add_argument("--checkpoint", help="run folder or checkpoint tag folder")
    p.add_argument("--random_init", help="registry name: the same architecture at random init (control)")
    p.add_argument("--img_size", type=int, default=0, help="evaluation resolution; 0 = the encoder's own (default %(default)s)")
    p.add_argument("--num_heads", type=int, default=0,
                   help="attention heads of an official / timm --encoder of a width other than ViT-Ti/S/B/L/H's "
                        "(the weights do not hold it); 0 = by the width (default %(default)s)")
    p.add_argument("--seed", type=seed, default=0, help="seed of --random_init (default %(default)s)")
    p.add_argument("--pool", choices=["cls", "avg"], default="cls",
                   help="feature: cls token or patch mean (default %(default)s); score a fine-tuned encoder "
                        "(global_pool avg) and an energy encoder pretrained on energy.pool avg (its default) with avg")
    p.add_argument("--num_workers", type=int, default=1,
                   help=f"decode workers, at most the shards of the larger set; {AUTO_WORKERS} = auto, as training's "
                        f"data.num_workers (default %(default)s)")
    p.add_argument("--max_train", type=int, default=0, help="evaluate on this many training samples; 0 = all (default %(default)s)")
    p.add_argument("--max_test", type=int, default=0, help="evaluate on this many test samples; 0 = all (default %(default)s)")
    p.add_argument("--subset_seed", type=seed, default=0,
                   help="seed of the --max_train / --max_test subsets (default %(default)s)")
    p.add_argument("--out", help="also write the result JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    a = p.parse_args(argv)
    if min(a.max_train, a.max_test) < 0:
        p.error("--max_train and --max_test must be >= 0 (0 = all samples)")
    if a.img_size < 0:
        p.error("--img_size must be >= 0 (0 = the encoder's own)")
    if a.out and (problem := unwritable_file(Path(a.out))):
        raise ConfigError(f"--out {a.out} {problem}")
    try:
        train_set, test_set = ShardSet.from_index(a.train_index), ShardSet.from_index(a.test_index)
        train_set.require_labels("--train_index: the kNN and the linear probe fit on its labels")
        test_set.require_labels("--test_index: the kNN and the linear probe are scored against its labels")
        check_scored_against(test_set, train_set, "--test_index", "--train_index")
        check_held_out(test_set, train_set, "--test_index", "--train_index")
    except (OSError, ValueError) as e:  # a missing or malformed index, an unlabeled one, labels that differ: exit 2
        raise ConfigError(str(e)) from None
    workers = checked_workers(a.num_workers, train_set, test_set)
    train = subsample(train_set, a.max_train, a.subset_seed)
    test = subsample(test_set, a.max_test, a.subset_seed + 1)  # not the train positions
    check_batch_fits(a.img_size, train, test)
    model = checked_encoder(a)
    if a.out:
        check_output(Path(a.out), evaluation_inputs(a, train_set, test_set), a.overwrite, "--out")
    if note := pool_note(a):
        print(note, flush=True)
    try:
        features = [extract_features(model, s, BATCH, pool=a.pool, num_workers=workers, what=f"{what} features")
                    for s, what in ((train, "train"), (test, "test"))]
    except CorruptDataError as e:  # no usable sample in a set: nothing to score, nothing written
        raise ConfigError(str(e)) from None
    said, recorded = encoder_source(a)
    # what was scored: two results compare only when these agree (model.img_size: --img_size, or the encoder's own)
    result = ({"encoder": recorded, "pool": a.pool, "img_size": model.img_size}
              | scores(*features, len(train.classes)) | coverage_keys(*(f.coverage for f in features)))
    print(f"{said}, {a.pool} features at {model.img_size} px: kNN top-1 {result['knn_top1']:.2f}%, linear probe "
          f"top-1 {result['linear_probe_top1']:.2f}% on {features[1].coverage.describe('test')}; fitted on "
          f"{features[0].coverage.describe('training')}")
    print(json.dumps(result))
    if a.out:
        with written_whole(Path(a.out)) as tmp:
            tmp.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    from train.run.cli import cli

    cli(main)
