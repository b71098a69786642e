"""docs/RESULTS.md from the study's per-run results (study.py beside this file): a table of mean and spread
over seeds, cost per method, the papers' qualitative claims checked against the numbers, and
figures (loss curves and accuracy bars with matplotlib when installed; each method's own PNGs
from its seed-0 run folder: reconstructions, attention maps, MLO-MAE masks, energy restorations).

A claim "holds" when the means are ordered as the paper says and the gap is larger than the
spread of either side (max - min over seeds); "within the spread" otherwise; "contradicted" when
the order is reversed by more than the spread; with a single seed no claim is judged.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
from pathlib import Path

from experiments.fashion_mnist.common import FINETUNE_BLR, RAW_PIXEL_BASELINES

METRICS = (("knn_top1", "kNN"), ("linear_probe_top1", "linear"), ("finetune_top1", "fine-tune"))

RAW_PIXELS = {"logistic regression": RAW_PIXEL_BASELINES["logistic_regression"], "5-NN": RAW_PIXEL_BASELINES["knn_5"]}
# (better entry, worse entry, metric, the paper's claim)
CLAIMS = (
    ("mae", "mixedae_naive", "finetune_top1", "MixedAE paper: naive mixing degrades MAE"),
    ("mixedae", "mae", "finetune_top1", "MixedAE paper: MixedAE improves on MAE"),
    ("adpe", "maeplus", "finetune_top1", "AdPE paper: adversarial positions improve on MAE+"),
    ("mlomae", "mae", "linear_probe_top1", "MLO-MAE paper: learned masks give better linear accuracy than MAE"),
)


def summarize(results: list[dict]) -> dict[str, dict]:
    """entry -> {metric: (mean, min, max, n)} and costs (means), in the order entries first appear."""
    by_entry: dict[str, list[dict]] = {}
    for r in results:
        by_entry.setdefault(r["entry"], []).append(r)
    out = {}
    for name, runs in by_entry.items():
        row = {"label": runs[0]["label"], "seeds": sorted(r["seed"] for r in runs)}
        for key in [k for k, _ in METRICS] + ["pretrain_seconds", "pretrain_images_per_s", "finetune_seconds",
                                               "level2_head_top1"]:
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                row[key] = (statistics.fmean(values), min(values), max(values), len(values))
        out[name] = row
    return out


def _cell(stat: tuple | None, digits: int = 2) -> str:
    if stat is None:
        return "-"
    mean, lo, hi, n = stat
    return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def judge(summary: dict, better: str, worse: str, metric: str) -> str:
    if better not in summary or worse not in summary or metric not in summary[better] \
            or metric not in summary[worse]:
        return "not measured"
    (b, blo, bhi, bn), (w, wlo, whi, wn) = summary[better][metric], summary[worse][metric]
    if min(bn, wn) < 2:  # one seed gives no spread to judge a gap against
        return f"one seed only ({b:.2f} vs {w:.2f}): not judged"
    spread = max(bhi - blo, whi - wlo)
    if b - w > spread:
        return "holds"
    if w - b > spread:
        return "contradicted"
    return "within the spread"


def judge_restoration(runs: list[dict]) -> str:
    """Energy: restoration works when every seed's last step is closer to the original than its input."""
    runs = [r for r in runs if "restored_l1" in r]
    if not runs:
        return "not measured"
    ratios = ", ".join(f"{r['restored_l1'] / r['corrupted_l1']:.3f}" for r in runs)
    verdict = "holds" if all(r["restored_l1"] < r["corrupted_l1"] for r in runs) else "contradicted"
    return f"{verdict} (restored / corrupted smooth-L1 per seed: {ratios})"


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def plots(results: list[dict], summary: dict, figures: Path) -> list[str]:
    """Loss curves (seed 0) and accuracy bars; [] without matplotlib (`pip install -e .[study]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        if r["seed"] == min(summary[r["entry"]]["seeds"]) and r.get("loss_curve"):
            steps, losses = zip(*r["loss_curve"])
            ax.plot(steps, losses, label=r["label"])
    ax.set(xlabel="optimizer step", ylabel="pretraining loss (each method's own)", yscale="log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figures / "loss_curves.png", dpi=120)
    written.append("loss_curves.png")
    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(summary)
    width = 0.27
    for i, (key, title) in enumerate(METRICS):
        means = [summary[n][key][0] if key in summary[n] else 0.0 for n in names]
        lo = [summary[n][key][0] - summary[n][key][1] if key in summary[n] else 0.0 for n in names]
        hi = [summary[n][key][2] - summary[n][key][0] if key in summary[n] else 0.0 for n in names]
        ax.bar([j + (i - 1) * width for j in range(len(names))], means, width, yerr=[lo, hi], label=title, capsize=2)
    ax.set_xticks(range(len(names)), [summary[n]["label"] for n in names], rotation=30, ha="right", fontsize=7)
    lows = [summary[n][k][1] for n in names for k, _ in METRICS if k in summary[n]]
    ax.set(ylabel="test top-1 (%)", ylim=(max(0.0, min(lows) - 5), 100) if lows else None)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figures / "accuracy.png", dpi=120)
    written.append("accuracy.png")
    return written


def method_figures(out: Path, summary: dict, figures: Path) -> list[tuple[str, str]]:
    """(caption, file) of each method's own last-step PNGs from its first seed's pretraining run."""
    found = []
    for name, row in summary.items():
        vis = out / name / f"seed{row['seeds'][0]}" / "pretrain" / "vis"
        if not vis.is_dir():
            continue
        latest: dict[str, Path] = {}
        for png in sorted(vis.glob("*_step*.png")):
            latest[png.name.rsplit("_step", 1)[0]] = png  # the last step of each kind
        for kind, png in latest.items():
            target = f"{name}_{kind}.png"
            shutil.copyfile(png, figures / target)
            found.append((f"{row['label']}: {kind.replace('_', ' ')}", target))
    return found


def write_report(results: list[dict], out: Path, report: Path, discussion: Path | None = None) -> None:
    """docs/RESULTS.md; `discussion` (hand-written, about the committed run) is included verbatim."""
    summary = summarize(results)
    figures = report.parent / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    budget = results[0]["budget"]
    seeds = sorted({r["seed"] for r in results})
    lines = [
        "# Fashion-MNIST study: every method on the mini ViT",
        "",
        f"Generated by `make study` (experiments/fashion_mnist/study.py, report.py) at commit {_git_commit()}; device "
        f"{results[0]['device']} ({results[0]['torch_threads']} threads); seeds {seeds}. Budget per method: "
        f"pretraining on {budget['pretrain_samples']} of the 60k training images, then "
        f"{budget['finetune_epochs']:g} fine-tuning epoch(s) of {budget['finetune_samples']} images. "
        "Test split top-1 (%): mean over seeds, (min-max) in brackets. kNN (k = 20, cosine, weighted) and "
        "linear probe on frozen features (cls token; energy: patch mean); fine-tuning: the MAE protocol "
        "shrunk to the mini ViT (experiments/fashion_mnist/study.py says how; its one changed setting, blr "
        f"{FINETUNE_BLR:g}, was chosen on MAE's fine-tuning training loss). Nothing was tuned on the test split.",
        "",
        "| method | kNN | linear | fine-tune | pretraining (s) | images/s | fine-tuning (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in summary.items():
        lines.append(f"| {row['label']} | " + " | ".join(_cell(row.get(k)) for k, _ in METRICS) +
                     f" | {_cell(row.get('pretrain_seconds'), 0)} | {_cell(row.get('pretrain_images_per_s'), 0)}"
                     f" | {_cell(row.get('finetune_seconds'), 0)} |")
    lines += [f"| raw pixels ({name}) | {value if 'NN' in name else '-'} | {value if 'NN' not in name else '-'} "
              f"| - | - | - | - |" for name, value in RAW_PIXELS.items()]
    for row in summary.values():  # objectives with their own classifier (MLO-MAE)
        if "level2_head_top1" in row:
            lines += ["", f"{row['label']}'s own level-II head (trained during pretraining on its D_tr split): "
                          f"{_cell(row['level2_head_top1'])} on the test split."]
    lines += ["", "## The papers' claims at this scale", "", "| claim | compared on | outcome |", "|---|---|---|"]
    for better, worse, metric, claim in CLAIMS:
        lines.append(f"| {claim} | {dict(METRICS)[metric]} | {judge(summary, better, worse, metric)} |")
    lines.append("| Energy paper: gradient descent on the learned energy restores corrupted images | smooth-L1 to the "
                 f"original, last logged training steps | {judge_restoration([r for r in results if r['entry'] == 'energy'])} |")
    lines += ["", "A claim holds when the means are ordered as the paper says by more than the spread (max - min "
                  "over seeds) of either side, is contradicted when reversed by more than it, and is otherwise "
                  "within the spread. The energy restorations are also shown in the figure below (rows: corrupted, "
                  "step 1, last step, original)."]
    if discussion is not None and discussion.is_file():
        lines += ["", discussion.read_text().strip()]
    plotted = plots(results, summary, figures)
    own = method_figures(out, summary, figures)
    if plotted or own:
        lines += ["", "## Figures", ""]
    for name in plotted:
        lines += [f"![{name}](figures/{name})", ""]
    for caption, name in own:
        lines += [f"**{caption}**", "", f"![{caption}](figures/{name})", ""]
    report.write_text("\n".join(lines) + "\n")
