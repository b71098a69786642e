"""The study's figures (matplotlib, the `study` extra): each function draws one PNG into `figures`
from the per-run results and returns its file name, or None when it has nothing to draw. Seed:
the first of each entry's seeds."""
from __future__ import annotations

import re
from pathlib import Path

METRICS = (("knn_top1", "kNN"), ("linear_probe_top1", "linear"), ("finetune_top1", "fine-tune"))


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _first_seed(results: list[dict]) -> list[dict]:
    first: dict[str, dict] = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        first.setdefault(r["entry"], r)
    return list(first.values())


def _save(fig, figures: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(figures / name, dpi=120)
    pyplot().close(fig)  # clf() alone leaves pyplot holding every figure a report draws
    return name


def loss_curves(plt, results: list[dict], figures: Path) -> str | None:
    runs = [r for r in _first_seed(results) if r.get("loss_curve")]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        steps, losses = zip(*r["loss_curve"])
        ax.plot(steps, losses, label=r["label"])
    ax.set(xlabel="optimizer step", ylabel="pretraining loss (each method's own)", yscale="log")
    ax.legend(fontsize=7)
    return _save(fig, figures, "loss_curves.png")


def accuracy_bars(plt, summary: dict, figures: Path) -> str | None:
    names = [n for n in summary if any(k in summary[n] for k, _ in METRICS)]
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.27
    for i, (key, title) in enumerate(METRICS):
        stats = [summary[n].get(key) for n in names]
        means = [s[0] if s else 0.0 for s in stats]
        err = [[s[0] - s[1] if s else 0.0 for s in stats], [s[2] - s[0] if s else 0.0 for s in stats]]
        ax.bar([j + (i - 1) * width for j in range(len(names))], means, width, yerr=err, label=title, capsize=2)
    ax.set_xticks(range(len(names)), [summary[n]["label"] for n in names], rotation=30, ha="right", fontsize=7)
    lows = [summary[n][k][1] for n in names for k, _ in METRICS if k in summary[n]]
    ax.set(ylabel="test top-1 (%)", ylim=(max(0.0, min(lows) - 5), 100))
    ax.legend(fontsize=7)
    return _save(fig, figures, "accuracy.png")


def accuracy_vs_images(plt, curves: dict[str, dict], figures: Path) -> str | None:
    """curves: {label: {metric: [(pretraining images, top-1), ...]}} (report.epoch_curves)."""
    if not curves:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, title) in zip(axes, METRICS[:2]):
        for label, by_metric in curves.items():
            points = by_metric.get(key, [])
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set(xlabel="pretraining images", ylabel=f"{title} top-1 (%), test split",
               title=f"{title} on frozen features (0: random init)")
    axes[0].legend(fontsize=7)
    return _save(fig, figures, "accuracy_vs_images.png")


def over_training(plt, results: list[dict], figures: Path, pattern: str, ylabel: str, name: str,
                  scale: dict[str, float] | None = None, reference: tuple[float, str] | None = None) -> str | None:
    """Every logged metric whose whole name matches the regex `pattern` against the optimizer step,
    one line per (entry, metric), divided by scale[entry] when given (e.g. an adversary's epsilon);
    `reference` (value, label) draws a dashed level to read them against (chance, epsilon)."""
    series = []
    for r in _first_seed(results):
        rows = r.get("metrics", [])
        keys = sorted({k for m in rows for k in m if re.fullmatch(pattern, k)})
        for k in keys:
            points = [(m["step"], m[k] / (scale or {}).get(r["entry"], 1.0)) for m in rows if k in m]
            series.append((f"{r['label']}: {k}" if len(keys) > 1 else r["label"], points))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series:
        ax.plot(*zip(*points), label=label)
    if reference is not None:
        ax.axhline(reference[0], color="gray", linestyle="--", linewidth=1, label=reference[1])
    ax.set(xlabel="optimizer step", ylabel=ylabel)
    ax.legend(fontsize=7)
    return _save(fig, figures, name)
