"""The Fashion-MNIST demo (`make demo`): shards -> pretraining -> frozen-feature evaluation.

1. Writes train/test shards from Fashion-MNIST's idx files: those of the Debian package
   dataset-fashion-mnist, else of runs/fashion-mnist, downloaded there and checked when missing
   (data/fashion_mnist.py).
2. Pretrains on the mini ViT (32x32 input, patch 4) with train/pretrain.py, the same entry
   point as every run, in a single process on the CPU (resumes if interrupted). The method is
   MAE by default; `--method NAME` runs any registered objective that has a demo preset
   (train/configs/NAME/demo.json) and `--variant VARIANT` one of its variant presets over it
   (train/configs/NAME/variants/VARIANT.json: MixedAE's Table A4 ablations, AdPE's variants /
   FGSM, MLO-MAE's blo|straight_through|unit_unroll_lr|official_code, energy's single corruptions or
   convnext_atto). An objective with its own classifier (MLO-MAE's level-II head, trained on an
   80/20 split of the train shards) also has that head scored on the test split.
3. Evaluates the pretrained encoder and the same architecture at random init on the test split:
   weighted kNN and a linear probe on frozen features (train/evaluate.py), fitted on a seeded
   subset of the train split (--eval_train, default 20000 of 60000; 0 = all): the features the
   objective's own `pool` option names (energy: average-pooled), else the cls token. Both splits
   are decoded once, by one worker per core, and shared by both encoders.
4. Prints a table (beside them the raw-pixel baselines, fitted on all 60000 train images) and
   writes <run>/eval.json next to <run>/encoder.safetensors/.json. Run folder: runs/demo for MAE
   at its preset's epochs, else runs/demo_<method>[_<variant>][_<N>ep] (_<N>ep for --epochs N:
   another budget is another run, never resumed from or reused for the preset's).

    python -m experiments.fashion_mnist.demo [--method NAME] [--variant VARIANT] [--epochs N] [--eval_train N]
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from data.cli import Parser
from data.folders import unwritable
from data.loader import cores_per_rank
from data.shard_index import ShardSet
from experiments.fashion_mnist.common import (
    RAW_PIXEL_BASELINES,
    REPO,
    TRAIN_IMAGES,
    cpu_training_env,
    demo_methods,
    epoch_options,
    fashion_mnist_shards,
    feature_pool,
    has_classifier,
    presets,
    variants,
)
from train.bench import cpu_name
from train.run.evaluation import decode_all, evaluate, load_encoder, subsample
from train.run.folder import git_commit, read_metrics

DEFAULT_METHOD = "mae"  # its run folder is runs/demo
# kNN / linear probe fitted on a third of the train split: feature extraction of the mini ViT is
# the evaluation's cost (about 750 images/s on 2 cores), and each encoder reads every sample.
EVAL_TRAIN_SAMPLES = 20_000
EVAL_SIZE = 32  # the mini ViT's input (MAE+ pretrains on 16 px crops; its sin-cos table is rebuilt for 32)


D = " (default: %(default)s)"  # argparse fills in each option's default


def run_pretraining(cmd: list[str]) -> None:
    """Pretraining in a child process. Ctrl-C reaches the child from the terminal (one process
    group): the child finishes its step, saves and says where in one line, while this process
    waits instead of dying with a traceback (or killing it 0.25 s later, as subprocess.run does);
    a SIGTERM to this process is passed on. A stopped or failed child ends the demo with its
    status, the demo's own command named to continue (its evaluation comes after the pretraining)."""
    child = subprocess.Popen(cmd, cwd=REPO, env=cpu_training_env())
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))}
    try:
        status = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if status in (130, 143):  # stopped by a person: its checkpoint is kept
        print("[demo] stopped during pretraining; run the same command again (make demo) to continue it and "
              "evaluate", file=sys.stderr)
    if status:
        raise SystemExit(status)


def run_name(method: str, variant: str, epochs: float) -> str:
    """The default run folder's name: demo for MAE at its preset's epochs, else
    demo_<method>[_<variant>][_<N>ep]. The epochs are in the name because the run is resumed
    (--resume auto) or reused when its folder exists: a run of another budget must not continue,
    or stand for, the preset's."""
    if method == DEFAULT_METHOD and not variant and not epochs:
        return "demo"
    return "_".join(["demo", method] + ([variant] if variant else []) + ([f"{epochs:g}ep"] if epochs else []))


def results_table(title: str, rows: list[tuple[str, str, str, str]]) -> list[str]:
    """The printed table: `title`, the column headers, then one line per (label, linear probe, kNN,
    what it stands on). The label column is as wide as the longest label, so the numbers of every
    method and variant name stand under their headers."""
    width = max(len(label) for label, *_ in rows) + 2
    lines = [title, f"{'':{width}}{'linear probe':>14}{'kNN (k=20)':>12}"]
    lines += [f"{label:{width}}{probe:>14}{knn:>12}" + (f"   {note}" if note else "")
              for label, probe, knn, note in rows]
    return lines


def main(argv: list[str] | None = None) -> dict:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    methods = demo_methods()
    p.add_argument("--method", choices=methods, default=DEFAULT_METHOD,
                   help="a registered objective with a demo preset (train/configs/<method>/demo.json)" + D)
    p.add_argument("--variant", "--ablation", dest="variant", default="",
                   help="a preset of train/configs/<method>/variants/ over the demo preset: " +
                        "; ".join(f"{m}: {', '.join(variants(m))}" for m in methods if variants(m)))
    p.add_argument("--epochs", type=float, default=0, help="pretraining epochs (0 = the preset's)" + D)
    p.add_argument("--eval_train", type=int, default=EVAL_TRAIN_SAMPLES,
                   help="train samples the kNN / linear probe fit on (seeded subset; 0 = all)" + D)
    p.add_argument("--skip_control", action="store_true", help="do not evaluate the random-init control")
    p.add_argument("--out", default="", help="run folder (default: runs/demo for MAE at its preset's epochs, else "
                                             "runs/demo_<method>[_<variant>][_<N>ep], _<N>ep for --epochs N)")
    a = p.parse_args(argv)
    try:
        configs = presets(a.method, a.variant)
    except ValueError as e:
        p.error(str(e))
    if a.eval_train < 0:
        p.error("--eval_train must be >= 0 (0 = all train samples)")
    run = Path(a.out) if a.out else REPO / "runs" / run_name(a.method, a.variant, a.epochs)
    if problem := unwritable(run):
        p.error(f"--out {run} {problem}")

    print("[demo] Fashion-MNIST shards (written once into runs/shards/fashion_mnist)", flush=True)
    train_index, test_index = fashion_mnist_shards()
    train, test = ShardSet.from_index(train_index), ShardSet.from_index(test_index)

    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "train.pretrain", "--ds_config", str(REPO / "ds_configs" / "cpu_demo.json"),
           *[arg for preset in configs for arg in ("--config", str(preset))], "--data.train_index",
           str(train_index), "--output_dir", str(run), "--resume", "auto"]
    if a.epochs:
        cmd += epoch_options(a.epochs, train.num_samples)
    classifier = has_classifier(a.method)
    if classifier:  # its own head is scored on the test split at the end (train/pretrain.py)
        cmd += ["--data.eval_index", str(test_index)]
    fresh = not (run / "checkpoints" / "latest").is_file()  # a resumed run's wall clock is not its cost
    run_pretraining(cmd)
    pretrain_s = time.perf_counter() - t0 if fresh else float("nan")
    head_eval = json.loads((run / "eval.json").read_text()) if classifier else None

    t0 = time.perf_counter()
    model_name = json.loads((run / "config.json").read_text())["model"]["name"]  # a timm backbone for energy
    pool = feature_pool(run)  # energy: average-pooled (its cls token is never trained); else the cls token
    eval_train = subsample(train, a.eval_train, seed=0)  # the same samples for both encoders and every run
    # Nothing else runs now: one decode worker per core (at most one per shard).
    print(f"[demo] evaluating the pretrained encoder{'' if a.skip_control else ' and the random-init control'}: "
          f"decoding {eval_train.num_samples} train and {test.num_samples} test images, then kNN and a linear probe "
          f"on each encoder's features", flush=True)
    decoded = [decode_all(split, EVAL_SIZE, min(cores_per_rank(), len(split.files)), f"decoding {what} images")
               for split, what in ((eval_train, "train"), (test, "test"))]
    pretrained = evaluate(load_encoder(encoder=str(run / "encoder.safetensors"), img_size=EVAL_SIZE), *decoded, pool)
    if not a.skip_control:
        print("[demo] the random-init control", flush=True)
    control = None if a.skip_control else evaluate(load_encoder(random_init=model_name, img_size=EVAL_SIZE, seed=0),
                                                   *decoded, pool)
    eval_s = time.perf_counter() - t0

    result = {
        **pretrained,
        "method": a.method,
        "ablation": a.variant or None,
        "random_init": control,
        "final_train_metrics": {k: v for k, v in [r for r in read_metrics(run) if "loss" in r][-1].items()
                                if k.startswith(("loss", "topk_acc", "level", "recon", "mask_prob"))},
        "level2_head_test_top1": head_eval["eval_top1"] if head_eval else None,
        "raw_pixel_baselines": RAW_PIXEL_BASELINES,
        "model": model_name,
        "features": pool,
        "pretrain_seconds": round(pretrain_s, 1) if fresh else None,  # None: resumed, this call's time is not the run's
        "eval_seconds": round(eval_s, 1),
        "eval_train_samples": eval_train.num_samples,
        "eval_test_samples": test.num_samples,
        "device": cpu_name(),
        "git": git_commit(),  # the code measured: a record of it names its commit
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }
    (run / "eval.json").write_text(json.dumps(result, indent=2))
    fitted = f"fitted on {eval_train.num_samples} train samples"
    rows = [(f"{(a.method.upper() + ' ' + a.variant).strip()} pretrained", f"{pretrained['linear_probe_top1']:.2f}",
             f"{pretrained['knn_top1']:.2f}", fitted)]
    if head_eval is not None:
        rows.append((f"{a.method.upper()} own head", f"{head_eval['eval_top1']:.2f}", "",
                     "its own classifier, trained during pretraining"))
    if control is not None:
        rows.append(("random init", f"{control['linear_probe_top1']:.2f}", f"{control['knn_top1']:.2f}", fitted))
    rows.append(("raw pixels", f"{RAW_PIXEL_BASELINES['logistic_regression']:.1f}",
                 f"{RAW_PIXEL_BASELINES['knn_5']:.1f}",
                 f"logistic regression / 5-NN on the pixels, fitted on all {TRAIN_IMAGES} train images"))
    print("\n" + "\n".join(results_table(f"Fashion-MNIST test top-1 (%), {model_name}, frozen {pool} features", rows)))
    took = f"pretraining {pretrain_s / 60:.1f} min" if fresh else "pretraining resumed (not timed)"
    print(f"{took}, evaluation {eval_s / 60:.1f} min on {result['device']}, torch {torch.__version__}; wrote "
          f"{run / 'eval.json'}")
    return result


if __name__ == "__main__":
    main()
