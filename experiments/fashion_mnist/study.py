"""The Fashion-MNIST study (`make study`, `make study-full`): every method pretrained with the same
budget on the mini ViT, then evaluated three ways on the test split, over several seeds.

Per seed, each entry of entries.STUDY (a method's train/configs/<method>/demo.json + one of its variants/):
  1. pretrain on `--pretrain_samples` of the 60k training images (train/pretrain.py; a fraction of an
     epoch or whole epochs, warmup a third of them as the presets); with `--eval_epochs` the
     checkpoints at those epochs' ends are kept (run.keep_every_epochs) and evaluated too;
  2. weighted kNN (k = 20) and a linear probe on frozen features (train/evaluate.py);
  3. fine-tuning: `--finetune_epochs` over `--finetune_samples` training images
     (train/finetune.py, the MAE protocol shrunk to the mini ViT: AdamW, layer decay 0.75,
     label smoothing, crop + flip; no mixup / RandAugment at 32 px grayscale), top-1 on the test split.
     blr 5e-3 (peak lr 2.5e-3 at batch 128), not the paper's 5e-4: on the quick preset's 78 steps
     with blr 1e-3 MAE's fine-tuning *training* loss still sat at 1.96 (ln 10 = 2.30) at its end,
     1.73 with 5e-3 (seed 0, chosen on that training loss, never on the test split).
Controls: `random_init` (the same three evaluations of an untrained encoder) and `supervised`
(the ViT trained from scratch with the fine-tuning recipe on as many images as pretraining and
fine-tuning see together, in one schedule: the ceiling). Nothing is tuned on the test split: pretraining
uses the demo presets unchanged, and fine-tuning's one departure (FINETUNE_BLR) was chosen on training loss.
entries.EXTRA entries run when named: MixedAE's Table A4 ablations (the `ablation` preset) and MLO-MAE with
unit unroll rates.

Presets (PRESETS): `quick` (20k pretraining images, 10k fine-tuning images; about 90 minutes for
seeds 0 and 1 on a 2-core CPU) -> docs/RESULTS_quick.md; `full` (10 epochs, frozen features also
at epochs 1 and 3, fine-tuning on all 60k images) -> docs/RESULTS.md; `ablation` (3 epochs: the
MixedAE ablations and energy, entries.AT_ABLATION_BUDGET) ->
docs/RESULTS_ablation.md and a section of docs/RESULTS.md. Each run lives in
runs/study[_<preset>]/<entry>/seed<k>/ (pretraining resumes there; a finished entry is not run
again), its evaluations in result.json; report.py beside this file collects them into run
summaries (docs/study/<preset>/) and writes the report and figures. How a run is evaluated comes
from the run itself (common.py): its objective's `pool` option (energy: patch mean), its encoder's
iRPE (MAE+ / AdPE keep it when fine-tuning), its objective's own classifier (MLO-MAE's level-II
head, scored on the test split). A GPU runs the same commands unchanged.

    python -m experiments.fashion_mnist.study [--preset quick|full|ablation] [--seeds 0,1] [--jobs 2] \\
        [--only mae,mixedae] [--pretrain_samples N] [--finetune_samples N] [--eval_epochs 1,3]
    python -m experiments.fashion_mnist.study --preset full --status   # where each run stands (progress.py)
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from data.cli import Parser
from data.shard_index import ShardSet
from experiments.fashion_mnist import progress
from experiments.fashion_mnist.common import (
    FINETUNE_BLR,
    REPO,
    cpu_training_env,
    encoder_has_rpe,
    epoch_options,
    fashion_mnist_shards,
    feature_pool,
    has_classifier,
    presets,
    read_result,
)
from experiments.fashion_mnist.entries import ENTRIES, PRESETS, REPORT_ORDER, Entry
from experiments.fashion_mnist.plots import pyplot
from experiments.fashion_mnist.report import NO_FIGURES, check_figures, publish, write_report
from train.engine.checkpoint import tag_for
from train.run.evaluation import DecodedSet, decode_all, evaluate, load_encoder
from train.run.folder import read_metrics
from train.weights.export import export_checkpoint

EVAL_SIZE = 32  # every encoder is evaluated and fine-tuned at the mini ViT's 32 px (MAE+ pretrains on 16 px crops)
CKPT_EVERY = 100  # steps between checkpoints (pretraining and fine-tuning): a killed run loses at most this many


def _run(cmd: list[str]) -> float:
    """Run an entry point quietly; seconds taken. On failure the error names it and ends with its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True, env=cpu_training_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t0


def resumable(run: Path, seed: int) -> list[str]:
    """Options every pretraining and fine-tuning run gets: a run that was killed (the study runs for
    hours) resumes in `run` from its last checkpoint, and resumes exactly (tests/train/test_*_run.py)."""
    return ["--output_dir", str(run), "--resume", "auto", "--seed", str(seed), "--run.ckpt_every", str(CKPT_EVERY)]


def _timed(run: Path, cmd: list[str]) -> float:
    """Seconds the run took when it ran through (kept in seconds.json: a rerun that only finds
    the finished run, or one resumed after an interruption, does not replace the measurement)."""
    record = run / "seconds.json"
    fresh = not record.is_file() and not (run / "checkpoints" / "latest").is_file()
    seconds = _run(cmd)
    if fresh:
        record.write_text(json.dumps({"seconds": seconds}))
    return json.loads(record.read_text())["seconds"] if record.is_file() else float("nan")


def pretrain(entry: Entry, run: Path, seed: int, epochs: float, train: Path, test: Path, n_train: int,
             keep_epochs: bool) -> dict:
    """Pretrain (resuming in `run`); with `keep_epochs` every epoch's checkpoint stays for epoch_encoders."""
    configs = presets(entry.method, entry.variant)
    cmd = ["-m", "train.pretrain", "--ds_config", "ds_configs/cpu_demo.json",
           *[a for p in configs for a in ("--config", str(p))], "--data.train_index", str(train),
           *resumable(run, seed), "--run.progress", "false",
           "--run.vis_every", str(10**9), *epoch_options(epochs, n_train)]  # figures at the last step only
    if keep_epochs:
        cmd += ["--run.keep_every_epochs", "1"]
    if has_classifier(entry.method):  # its own head (MLO-MAE's level II) is scored on the test split at the end
        cmd += ["--data.eval_index", str(test)]
    seconds = _timed(run, cmd)
    rows = [r for r in read_metrics(run) if "loss" in r]
    return {"pretrain_seconds": round(seconds, 1), "loss_curve": [(r["step"], r["loss"]) for r in rows],
            "pretrain_images_per_s": round(statistics.median(r["images_per_s"] for r in rows), 1),
            "metrics": [{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in rows]}


def epoch_encoders(run: Path, epochs: list[int]) -> dict[int, Path]:
    """{epoch: encoder.safetensors} exported (once) from the run's kept checkpoint at each epoch's end."""
    per_epoch = json.loads((run / "meta.json").read_text())["steps_per_epoch"]
    found = {}
    for k in epochs:
        out = run / f"epoch{k}" / "encoder.safetensors"
        if not out.is_file():
            export_checkpoint(run / "checkpoints" / tag_for(k * per_epoch), out)
        found[k] = out
    return found


def finetune(run: Path, seed: int, epochs: float, samples: int, train: Path, test: Path, init: Path | None,
             rpe: bool) -> dict:
    """Top-1 on the test split after fine-tuning `init` (None: from scratch)."""
    cmd = ["-m", "train.finetune", "--ds_config", "ds_configs/cpu_demo.json", "--model.name", "vit_mini_patch4",
           "--model.img_size", str(EVAL_SIZE), "--model.rpe", str(rpe).lower(), "--finetune.num_classes", "10",
           "--finetune.mixup", "0", "--finetune.cutmix", "0", "--data.train_transform", "crop_flip",
           "--data.crop_scale_min", "0.35", "--data.num_workers", "1", "--data.train_index", str(train),
           "--data.eval_index", str(test), "--optim.blr", str(FINETUNE_BLR), "--optim.layer_decay", "0.75",
           "--run.log_every", "50", "--run.progress", "false", "--run.export", "false",
           *resumable(run, seed), *epoch_options(epochs, samples)]
    if epochs == int(epochs):
        cmd += ["--data.epoch_size", str(samples)]
    if init is not None:
        cmd += ["--model.init_from", str(init)]
    seconds = _timed(run, cmd)
    rows = [r for r in read_metrics(run) if "loss" in r]
    return {"finetune_top1": json.loads((run / "eval.json").read_text())["eval_top1"], "finetune_seconds": round(seconds, 1),
            "finetune_images_per_s": round(statistics.median(r["images_per_s"] for r in rows), 1)}


class Decoded:
    """The train and test splits decoded once at EVAL_SIZE, on first use, for every kNN / linear probe."""

    def __init__(self, train: ShardSet, test: ShardSet):
        self.sets, self.train_set, self.test_set = None, train, test

    def get(self) -> tuple[DecodedSet, DecodedSet]:
        if self.sets is None:
            self.sets = decode_all(self.train_set, EVAL_SIZE), decode_all(self.test_set, EVAL_SIZE)
        return self.sets


def budget_of(a) -> dict:
    """The budget a result.json records (a finished run is reused only with the same one)."""
    budget = {"pretrain_samples": a.pretrain_samples, "finetune_epochs": a.finetune_epochs,
              "finetune_samples": a.finetune_samples}
    if a.eval_epochs:
        budget["eval_epochs"] = a.eval_epochs
    return budget


def run_entry(name: str, seed: int, a, train: Path, test: Path, decoded: Decoded) -> dict:
    entry, out = ENTRIES[name], a.out / name / f"seed{seed}"
    done = out / "result.json"
    budget = budget_of(a)
    if done.is_file():
        result = read_result(done)
        if result["budget"] != budget:  # never mix budgets in one table
            sys.exit(f"{done} was measured with {result['budget']}, this study asks for {budget}; use another --out")
        return result
    out.mkdir(parents=True, exist_ok=True)
    train_set = decoded.train_set
    pretrain_epochs = a.pretrain_samples / train_set.num_samples
    result: dict = {"entry": name, "label": entry.label, "seed": seed, "pool": "cls"}
    if name == "supervised":  # as many training images as pretraining + fine-tuning see, in one schedule
        # one nominal epoch of that many images (the shard stream repeats past the 60k)
        images = int(a.pretrain_samples + a.finetune_epochs * a.finetune_samples)
        result |= finetune(out / "finetune", seed, 1, images, train, test, None, rpe=False)
    else:
        rpe = False
        if entry.method:
            result |= pretrain(entry, out / "pretrain", seed, pretrain_epochs, train, test, train_set.num_samples,
                               bool(a.eval_epochs))
            encoder = load_encoder(encoder=str(out / "pretrain" / "encoder.safetensors"), img_size=EVAL_SIZE)
            if (out / "pretrain" / "eval.json").is_file():  # MLO-MAE's level-II head on the test split
                result["level2_head_top1"] = json.loads((out / "pretrain" / "eval.json").read_text())["eval_top1"]
            result["pool"] = feature_pool(out / "pretrain")
            rpe = encoder_has_rpe(out / "pretrain")
            result["at_epochs"] = {}  # the accuracy-vs-pretraining curve: frozen features at earlier epochs
            for k, path in epoch_encoders(out / "pretrain", a.eval_epochs).items():
                early = load_encoder(encoder=str(path), img_size=EVAL_SIZE)
                result["at_epochs"][str(k)] = evaluate(early, *decoded.get(), result["pool"])
        else:
            encoder = load_encoder(random_init="vit_mini_patch4", img_size=EVAL_SIZE, seed=seed)
        t0 = time.perf_counter()
        result |= evaluate(encoder, *decoded.get(), result["pool"])
        result["eval_seconds"] = round(time.perf_counter() - t0, 1)
        init = out / "pretrain" / "encoder.safetensors" if entry.method else None
        result |= finetune(out / "finetune", seed, a.finetune_epochs, a.finetune_samples, train, test, init, rpe)
    result |= {"device": "cuda" if torch.cuda.is_available() else "cpu", "torch_threads": torch.get_num_threads(),
               "budget": budget}
    partial = done.with_name(done.name + ".partial")  # whole or absent: a kill mid-write leaves no cut result.json
    partial.write_text(json.dumps(result, indent=1))
    os.replace(partial, done)
    return result


D = " (default: %(default)s)"  # argparse fills in each option's default


def run_parallel(a, work: list[tuple[int, str]]) -> list[dict]:
    """Every (seed, entry) as its own study process, `a.jobs` at a time, each with cores / jobs
    OpenMP threads (on the 2-core CPU two 1-thread runs train MAE at 600 images/s together, one
    2-thread run at 500); output in <out>/<entry>/seed<k>/study.log. Entries are taken in the
    order given: put the longest first. Exits naming the entries that failed, after the rest ran."""
    threads = max(1, (os.cpu_count() or 1) // a.jobs)
    budget = [*(["--shards", str(a.shards)] if a.shards else []), "--pretrain_samples", str(a.pretrain_samples),
              "--finetune_epochs", str(a.finetune_epochs), "--finetune_samples", str(a.finetune_samples),
              "--eval_epochs", ",".join(map(str, a.eval_epochs))]

    def one(seed: int, name: str) -> int:
        log = a.out / name / f"seed{seed}" / "study.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "experiments.fashion_mnist.study", "--preset", a.preset, *budget, "--seeds",
               str(seed), "--only", name, "--out", str(a.out), "--no_report"]
        print(f"[study] {name} seed {seed} ({threads} threads; log {log})", flush=True)
        with log.open("a") as f:
            return subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                  env={**cpu_training_env(), "OMP_NUM_THREADS": str(threads)}).returncode

    with ThreadPoolExecutor(a.jobs) as pool:
        codes = list(pool.map(lambda w: one(*w), work))
    failed = [f"{name} seed {seed}" for (seed, name), code in zip(work, codes) if code]
    if failed:
        sys.exit(f"[study] failed: {', '.join(failed)}; see study.log in their run folders")
    return [read_result(a.out / name / f"seed{seed}" / "result.json") for seed, name in work]


def main(argv: list[str] | None = None) -> list[dict]:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), default="quick",
                   help="the budget and where it goes; the options below override it" + D)
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds, one run of every entry each" + D)
    p.add_argument("--pretrain_samples", type=int,
                   help="training images each method pretrains on: under one epoch (60000) or whole epochs")
    p.add_argument("--finetune_epochs", type=float, help="fine-tuning epochs of --finetune_samples images")
    p.add_argument("--finetune_samples", type=int, help="training images per fine-tuning epoch")
    p.add_argument("--eval_epochs", help="comma-separated earlier epochs whose checkpoints are also evaluated "
                                         "(kNN and linear probe; whole-epoch budgets)")
    p.add_argument("--only", default="", help="comma-separated entries (default: the preset's; any of " +
                   ", ".join(ENTRIES) + ")")
    p.add_argument("--no_report", action="store_true",
                   help="write no report (--jobs runs each entry this way; the parent process writes it)")
    p.add_argument("--shards", type=Path, help="a folder with Fashion-MNIST's train.json and test.json shard "
                   "indexes (default: runs/shards/fashion_mnist, written on first use)")
    p.add_argument("--jobs", type=int, default=1,
                   help="entries run side by side, each a process with cores / jobs threads" + D)
    p.add_argument("--out", type=Path, help="run folders (default: runs/study for quick, else runs/study_<preset>)")
    p.add_argument("--status", action="store_true",
                   help="print where each run of this preset (seeds, --only) stands, from its run folders, and exit")
    p.add_argument("--report", type=Path, help="write the report of this call's results here (default: the "
                   "preset's docs/RESULTS*.md from every finished run in --out, with its run summaries)")
    a = p.parse_args(argv)
    preset = PRESETS[a.preset]
    for key in ("pretrain_samples", "finetune_epochs", "finetune_samples", "eval_epochs"):
        if getattr(a, key) is None:
            setattr(a, key, preset[key])
    a.out = a.out or REPO / "runs" / ("study" if a.preset == "quick" else f"study_{a.preset}")
    try:
        a.eval_epochs = [int(k) for k in str(a.eval_epochs).split(",") if k]
    except ValueError:
        p.error(f"--eval_epochs {a.eval_epochs!r}: give comma-separated whole epochs (e.g. 1,3)")
    if a.jobs < 1:
        p.error(f"--jobs {a.jobs}: give 1 or more")
    # refused now, not after the hours of pretraining that come before fine-tuning
    if not (a.finetune_epochs > 0 and math.isfinite(a.finetune_epochs)):
        p.error(f"--finetune_epochs {a.finetune_epochs:g}: give a positive number of epochs (e.g. 1)")
    if a.finetune_samples <= 0:
        p.error(f"--finetune_samples {a.finetune_samples}: give a positive number of training images (e.g. 60000)")
    names = [n for n in a.only.split(",") if n] or preset["entries"]
    unknown = sorted(set(names) - set(ENTRIES))
    if unknown:
        p.error(f"unknown entries {unknown}; choose from {list(ENTRIES)}")
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds {a.seeds!r}: give comma-separated integers (e.g. 0,1)")
    # one run folder per (entry, seed): a repeat would count a run twice, and with --jobs train it twice at once
    for option, given in (("--seeds", seeds), ("--only", names)):
        repeated = sorted({str(x) for x in given if given.count(x) > 1})
        if repeated:
            p.error(f"{option} gives {', '.join(repeated)} more than once: name each once")
    if a.status:
        print(progress.report([progress.entry_status(a.out, name, seed, budget_of(a)) for seed in seeds
                               for name in names]))
        return []
    if not a.no_report and a.report is None:  # hours before the report: refused now if it would lose its figures
        check_figures(REPO / "docs")
    if a.report is not None and a.report.is_dir():
        p.error(f"--report {a.report} is a folder: give the report's file name")
    if a.shards is None:
        train, test = fashion_mnist_shards()
    else:
        train, test = a.shards / "train.json", a.shards / "test.json"
        if not (train.is_file() and test.is_file()):
            p.error(f"--shards {a.shards}: no train.json and test.json there (python -m data.write_shards "
                    "fashion-mnist DIR writes them)")
    decoded = Decoded(ShardSet.from_index(train), ShardSet.from_index(test))
    n_train = decoded.train_set.num_samples
    if a.pretrain_samples <= 0 or (a.pretrain_samples > n_train and a.pretrain_samples % n_train):
        p.error(f"--pretrain_samples {a.pretrain_samples}: give fewer than one epoch ({n_train}) or whole epochs")
    epochs = a.pretrain_samples / n_train
    if a.eval_epochs and (epochs != int(epochs) or not all(0 < k < epochs for k in a.eval_epochs)):
        p.error(f"--eval_epochs {a.eval_epochs}: give whole epochs before the last of a whole-epoch budget "
                f"(--pretrain_samples {a.pretrain_samples} is {epochs:g} epochs)")
    for seed in seeds:  # never mix budgets in one table: refused before any entry runs
        for name in names:
            done = a.out / name / f"seed{seed}" / "result.json"
            if done.is_file() and read_result(done).get("budget") != budget_of(a):
                p.error(f"{done} was measured with another budget than this study's {budget_of(a)}; use another --out")
    if a.jobs > 1:
        results = run_parallel(a, [(seed, name) for seed in seeds for name in names])
    else:
        results = []
        for seed in seeds:
            for name in names:
                print(f"[study] {name} seed {seed}", flush=True)
                results.append(run_entry(name, seed, a, train, test, decoded))
    if a.no_report:
        return results
    if a.report is not None:
        figures = write_report(results, a.report, a.report.parent / "figures", expected=names, preset=a.preset)
        print(f"[study] {figures} figure(s) in {a.report.parent / 'figures'}" + ("" if pyplot() else f" ({NO_FIGURES})"))
        report = a.report
    else:
        report = publish(a.preset, a.out, REPORT_ORDER, preset["entries"])
    print(f"[study] wrote {report}")
    return results


if __name__ == "__main__":
    main()
