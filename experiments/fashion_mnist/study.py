"""The Fashion-MNIST study (`make study`): every method pretrained with the same budget on the
mini ViT, then evaluated three ways on the test split, over several seeds; docs/RESULTS.md.

Per seed, each entry of STUDY (a method's train/configs/<method>/demo.json + one of its variants/):
  1. pretrain on `--pretrain_samples` of the 60k training images (train/pretrain.py; a fraction of an
     epoch or whole epochs);
  2. weighted kNN (k = 20) and a linear probe on frozen features (train/evaluate.py);
  3. short fine-tuning: `--finetune_epochs` over `--finetune_samples` training images
     (train/finetune.py, the MAE protocol shrunk to the mini ViT: AdamW, layer decay 0.75,
     label smoothing, crop + flip; no mixup / RandAugment at 32 px grayscale), top-1 on the test split.
     blr 5e-3 (peak lr 2.5e-3 at batch 128), not the paper's 5e-4: the schedule is 78 steps, and
     with blr 1e-3 MAE's fine-tuning *training* loss still sat at 1.96 (ln 10 = 2.30) at its end,
     1.73 with 5e-3 (seed 0, chosen on that training loss, never on the test split).
Controls: `random_init` (the same three evaluations of an untrained encoder) and `supervised`
(the ViT trained from scratch with the fine-tuning recipe on as many images as pretraining and
fine-tuning see together, in one schedule: the ceiling). Nothing is tuned on the test split: pretraining
uses the demo presets unchanged, and fine-tuning's one departure (FINETUNE_BLR) was chosen on training loss.

Each run lives in runs/study/<entry>/seed<k>/ (pretraining resumes there; a finished entry is
not run again), its evaluations in result.json; report.py beside this file writes docs/RESULTS.md
and the figures from them. How a run is evaluated comes from the run itself (common.py): its
objective's `pool` option (energy: patch mean), its encoder's iRPE (MAE+ / AdPE keep it when
fine-tuning), its objective's own classifier (MLO-MAE's level-II head, scored on the test split).

The defaults (20k pretraining images, 10k fine-tuning images, seeds 0 and 1) take about 90 minutes
on a 2-core CPU; a GPU runs the same command unchanged.

    python -m experiments.fashion_mnist.study [--seeds 0,1] [--pretrain_samples 20000] [--finetune_samples 10000] \\
        [--only mae,mixedae]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from data.shards import ShardSet
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
)
from experiments.fashion_mnist.report import write_report
from train.checkpoint import tag_for
from train.evaluate import DecodedSet, decode_all, evaluate, load_encoder
from train.export import export_checkpoint
from train.run_dir import read_metrics

EVAL_SIZE = 32  # every encoder is evaluated and fine-tuned at the mini ViT's 32 px (MAE+ pretrains on 16 px crops)
CKPT_EVERY = 100  # pretraining steps between checkpoints: a killed run loses at most this many (energy: ~4 min)


@dataclass(frozen=True)
class Entry:
    label: str  # as the tables say it
    method: str = ""  # a registered objective with a demo preset; "": no pretraining (a control)
    variant: str = ""  # one of train/configs/<method>/variants/, over the demo preset


# The study's design: which methods and variants it compares, and the labels of its tables. The
# paper claims report.py checks name these entries.
STUDY = {
    "mae": Entry("MAE", "mae"),
    "mixedae": Entry("MixedAE", "mixedae"),
    "mixedae_naive": Entry("MixedAE naive mixing", "mixedae", "naive_mixing"),
    "maeplus": Entry("MAE+ (RPE)", "maeplus", "maeplus_rpe"),
    "adpe": Entry("AdPE (RPE-coord, default)", "maeplus", "rpe_coord"),
    "mlomae": Entry("MLO-MAE", "mlomae"),
    "energy": Entry("Energy (mixture)", "energy"),
    "random_init": Entry("random init (control)"),
    "supervised": Entry("supervised from scratch (ceiling)"),
}
# Run only when named (--only): the MixedAE ablations of its Table A4 and MLO-MAE's unit unroll rates.
EXTRA = {
    "mixedae_homocon_only": Entry("MixedAE: HomoCon alone", "mixedae", "homocon_only"),
    "mixedae_no_segment": Entry("MixedAE without segment embeddings", "mixedae", "without_segment_embeddings"),
    "mixedae_without_mixing": Entry("MixedAE without mixing", "mixedae", "without_mixing"),
    "mixedae_masked_sa": Entry("MixedAE: masked self-attention", "mixedae", "masked_self_attention"),
    "mlomae_unit": Entry("MLO-MAE, unit unroll rates", "mlomae", "unit_unroll_lr"),
}
ENTRIES = STUDY | EXTRA

# Budgets by name (`--preset`): the quick one-third-epoch study (`make study`), the deciding
# 10-epoch study (`make study-full`, issue 28) and the reduced budget of the MixedAE ablations.
PRESETS = {
    "quick": {"pretrain_samples": 20000, "finetune_epochs": 1.0, "finetune_samples": 10000, "eval_epochs": "",
              "out": "runs/study", "report": "docs/RESULTS_quick.md"},
    "full": {"pretrain_samples": 600000, "finetune_epochs": 1.0, "finetune_samples": 60000, "eval_epochs": "1,3",
             "out": "runs/study_full", "report": "docs/RESULTS.md"},
    "ablation": {"pretrain_samples": 180000, "finetune_epochs": 1.0, "finetune_samples": 60000, "eval_epochs": "1",
                 "out": "runs/study_ablation", "report": "docs/RESULTS_ablation.md"},
}


def _run(cmd: list[str]) -> float:
    """Run an entry point quietly; seconds taken. On failure the error names it and ends with its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True, env=cpu_training_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t0


def _timed(run: Path, cmd: list[str]) -> float:
    """Seconds the run took when it ran through (kept in seconds.json: a rerun that only finds
    the finished run, or one resumed after an interruption, does not replace the measurement)."""
    record = run / "seconds.json"
    fresh = not record.is_file() and not (run / "checkpoints" / "latest").is_file()
    seconds = _run(cmd)
    if fresh:
        record.write_text(json.dumps({"seconds": seconds}))
    return json.loads(record.read_text())["seconds"] if record.is_file() else float("nan")


def restoration(rows: list[dict]) -> dict:
    """Energy: smooth-L1 to the original of the corrupted input and of the last restoration step,
    mean over the last 5 logged steps (the restoration claim, measured on training batches)."""
    last = rows[-5:]
    final = max(k for k in last[-1] if k.startswith("loss_step"))
    return {"corrupted_l1": sum(r["corrupted_l1"] for r in last) / len(last),
            "restored_l1": sum(r[final] for r in last) / len(last)}


def pretrain(entry: Entry, run: Path, seed: int, epochs: float, train: Path, test: Path, n_train: int,
             keep_epochs: bool) -> dict:
    """Pretrain (resuming in `run`); with `keep_epochs` every epoch's checkpoint stays for epoch_encoders."""
    configs = presets(entry.method, entry.variant)
    cmd = ["-m", "train.pretrain", "--ds_config", "ds_configs/cpu_demo.json",
           *[a for p in configs for a in ("--config", str(p))], "--data.train_index", str(train),
           "--output_dir", str(run), "--resume", "auto", "--seed", str(seed), "--run.progress", "false",
           "--run.ckpt_every", str(CKPT_EVERY), "--run.vis_every", str(10**9),  # figures at the last step only
           *epoch_options(epochs, n_train)]
    if keep_epochs:
        cmd += ["--run.keep_every_epochs", "1"]
    if has_classifier(entry.method):  # its own head (MLO-MAE's level II) is scored on the test split at the end
        cmd += ["--data.eval_index", str(test)]
    seconds = _timed(run, cmd)
    rows = [r for r in read_metrics(run) if "loss" in r]
    return {"pretrain_seconds": round(seconds, 1), "loss_curve": [(r["step"], r["loss"]) for r in rows],
            "pretrain_images_per_s": round(sum(r["images_per_s"] for r in rows) / len(rows), 1),
            "metrics": [{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in rows],
            **(restoration(rows) if "corrupted_l1" in rows[-1] else {})}


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
           "--run.log_every", "50", "--run.ckpt_every", "100000", "--run.progress", "false", "--run.export", "false",
           "--output_dir", str(run), "--resume", "auto", "--seed", str(seed), *epoch_options(epochs, samples)]
    if epochs == int(epochs):
        cmd += ["--data.epoch_size", str(samples)]
    if init is not None:
        cmd += ["--model.init_from", str(init)]
    seconds = _timed(run, cmd)
    rows = [r for r in read_metrics(run) if "loss" in r]
    return {"finetune_top1": json.loads((run / "eval.json").read_text())["eval_top1"], "finetune_seconds": round(seconds, 1),
            "finetune_images_per_s": round(sum(r["images_per_s"] for r in rows) / len(rows), 1)}


class Decoded:
    """The train and test splits decoded once at EVAL_SIZE, on first use, for every kNN / linear probe."""

    def __init__(self, train: ShardSet, test: ShardSet):
        self.sets, self.train_set, self.test_set = None, train, test

    def get(self) -> tuple[DecodedSet, DecodedSet]:
        if self.sets is None:
            self.sets = decode_all(self.train_set, EVAL_SIZE), decode_all(self.test_set, EVAL_SIZE)
        return self.sets


def run_entry(name: str, seed: int, a, train: Path, test: Path, decoded: Decoded) -> dict:
    entry, out = ENTRIES[name], a.out / name / f"seed{seed}"
    done = out / "result.json"
    budget = {"pretrain_samples": a.pretrain_samples, "finetune_epochs": a.finetune_epochs,
              "finetune_samples": a.finetune_samples}
    if a.eval_epochs:
        budget["eval_epochs"] = a.eval_epochs
    if done.is_file():
        result = json.loads(done.read_text())
        if result["budget"] != budget:  # never mix budgets in one table
            sys.exit(f"{done} was measured with {result['budget']}, this study asks for {budget}; use another --out")
        return result
    out.mkdir(parents=True, exist_ok=True)
    train_set = decoded.train_set
    pretrain_epochs = a.pretrain_samples / train_set.num_samples
    result: dict = {"entry": name, "label": entry.label, "seed": seed, "pool": "cls"}
    if name == "supervised":  # as many training images as pretraining + fine-tuning see, in one schedule
        images = int(a.pretrain_samples + a.finetune_epochs * a.finetune_samples)
        n = train_set.num_samples
        epochs, samples = (images // n, n) if images > n and images % n == 0 else (1, images)  # whole epochs past one
        result |= finetune(out / "finetune", seed, epochs, samples, train, test, None, rpe=False)
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
    done.write_text(json.dumps(result, indent=1))
    return result


D = " (default: %(default)s)"  # argparse fills in each option's default

def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), default="quick",
                   help="the budget and where it goes; the options below override it" + D)
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds, one run of every entry each" + D)
    p.add_argument("--pretrain_samples", type=int,
                   help="training images each method pretrains on: under one epoch (60000) or whole epochs")
    p.add_argument("--finetune_epochs", type=float, help="fine-tuning epochs of --finetune_samples images")
    p.add_argument("--finetune_samples", type=int, help="training images per fine-tuning epoch")
    p.add_argument("--eval_epochs", help="comma-separated earlier epochs whose checkpoints are also evaluated "
                                         "(kNN and linear probe; whole-epoch budgets)")
    p.add_argument("--only", default="", help="comma-separated entries (default: all of " + ", ".join(STUDY) +
                   "; also " + ", ".join(EXTRA) + ")")
    p.add_argument("--out", type=Path, help="run folders")
    p.add_argument("--report", type=Path, help="the report written from the results")
    a = p.parse_args(argv)
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key) is None:
            setattr(a, key, REPO / value if key in ("out", "report") else value)
    a.eval_epochs = [int(k) for k in str(a.eval_epochs).split(",") if k]
    names = [n for n in a.only.split(",") if n] or list(STUDY)
    unknown = sorted(set(names) - set(ENTRIES))
    if unknown:
        p.error(f"unknown entries {unknown}; choose from {list(ENTRIES)}")
    train, test = fashion_mnist_shards()
    decoded = Decoded(ShardSet.from_index(train), ShardSet.from_index(test))
    n_train = decoded.train_set.num_samples
    if a.pretrain_samples <= 0 or (a.pretrain_samples > n_train and a.pretrain_samples % n_train):
        p.error(f"--pretrain_samples {a.pretrain_samples}: give fewer than one epoch ({n_train}) or whole epochs")
    epochs = a.pretrain_samples / n_train
    if a.eval_epochs and (epochs != int(epochs) or not all(0 < k < epochs for k in a.eval_epochs)):
        p.error(f"--eval_epochs {a.eval_epochs}: give whole epochs before the last of a whole-epoch budget "
                f"(--pretrain_samples {a.pretrain_samples} is {epochs:g} epochs)")
    results = []
    for seed in (int(s) for s in a.seeds.split(",")):
        for name in names:
            print(f"[study] {name} seed {seed}", flush=True)
            results.append(run_entry(name, seed, a, train, test, decoded))
    write_report(results, a.out, a.report, a.report.parent / "study_discussion.md")
    print(f"[study] wrote {a.report}")
    return results


if __name__ == "__main__":
    main()
