"""The papers' claims the Fashion-MNIST study can test, each judged from the per-run results
(study.py's result.json) against the spread over seeds.

A comparison "holds" when the means are ordered as the paper says and the gap is larger than the
spread (max - min over seeds) of either side, is "contradicted" when reversed by more than it, and
is "within the spread" otherwise. A claim of equality ("about equal") holds when the gap is within
the spread. A claim about a curve (TopK accuracy rising, restoration improving with N) holds when
it does in every seed.

With one seed there is no spread yet: the verdict is marked "provisional" and judged against the
test set's sampling noise instead, two standard errors of the difference of two accuracies on
the 10,000 test images (about 1.1 points at 82%). That floor leaves out the seed-to-seed variation,
which is usually larger, so a provisional "holds" can still turn into "within the spread".
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

TEST_IMAGES = 10000  # Fashion-MNIST's test split: every accuracy here is scored on all of it
METRIC_NAMES = {"knn_top1": "kNN", "linear_probe_top1": "linear", "finetune_top1": "fine-tune"}


@dataclass(frozen=True)
class Comparison:
    claim: str  # the paper's claim, as the report writes it
    better: str  # the entry the paper puts above (for "about equal": either side)
    worse: str
    metric: str  # a key of METRIC_NAMES
    equal: bool = False  # the paper says the two are about equal


# On the main study (both presets). Entries are study.py's names.
MAIN = (
    Comparison("MixedAE paper: naive mixing degrades MAE", "mae", "mixedae_naive", "finetune_top1"),
    Comparison("MixedAE paper: MixedAE improves on MAE", "mixedae", "mae", "finetune_top1"),
    Comparison("AdPE paper: adversarial positions improve on MAE+", "adpe", "maeplus", "finetune_top1"),
    Comparison("MLO-MAE paper: learned masks give better linear accuracy than MAE", "mlomae", "mae",
               "linear_probe_top1"),
    Comparison("MLO-MAE paper: learned masks give better fine-tuning accuracy than MAE", "mlomae", "mae",
               "finetune_top1"),
    Comparison("MLO-MAE paper, unit unroll rates (the official code's form): better linear accuracy than MAE",
               "mlomae_unit", "mae", "linear_probe_top1"),
    Comparison("MLO-MAE paper, unit unroll rates (the official code's form): better fine-tuning accuracy than MAE",
               "mlomae_unit", "mae", "finetune_top1"),
    *(Comparison(f"Energy paper: pretraining beats random init ({name})", "energy", "random_init", metric)
      for metric, name in METRIC_NAMES.items()),
)
# On the MixedAE ablations of its Table A4 (fine-tuning top-1 there; the ablation preset here).
ABLATION = (
    Comparison("MixedAE Table A4b: HomoCon alone fails (below full MixedAE)", "mixedae", "mixedae_homocon_only",
               "finetune_top1"),
    Comparison("MixedAE Table A4b: HomoCon alone fails (below random init)", "random_init", "mixedae_homocon_only",
               "finetune_top1"),
    Comparison("MixedAE Table A4c: without segment embeddings is worse than MixedAE", "mixedae",
               "mixedae_no_segment", "finetune_top1"),
    Comparison("MixedAE Table A4c: without mixing is worse than without segment embeddings", "mixedae_no_segment",
               "mixedae_without_mixing", "finetune_top1"),
    Comparison("MixedAE Table A4a: masked self-attention is about equal to MAE", "mixedae_masked_sa", "mae",
               "finetune_top1", equal=True),
)


def judge(summary: dict, c: Comparison) -> str:
    """The verdict on one comparison from summarize()'s {entry: {metric: (mean, min, max, n)}}, with the
    means, their gap and the margin it was judged against, e.g. "holds (90.50 vs 86.00: +4.50, spread 2.00)"."""
    if any(c.metric not in summary.get(e, {}) for e in (c.better, c.worse)):
        return "not measured"
    (b, blo, bhi, bn), (w, wlo, whi, wn) = summary[c.better][c.metric], summary[c.worse][c.metric]
    provisional = min(bn, wn) < 2  # one seed gives no spread: the test set's sampling noise stands in
    margin, name = (sampling_noise(b, w), "test-set noise") if provisional else (max(bhi - blo, whi - wlo), "spread")
    verdict = f"{_verdict(b - w, margin, c.equal, name)} ({b:.2f} vs {w:.2f}: {b - w:+.2f}, {name} {margin:.2f})"
    return f"provisional, one seed: {verdict}" if provisional else verdict


def sampling_noise(a: float, b: float, n: int = TEST_IMAGES) -> float:
    """Two standard errors (points) of the difference of two top-1 accuracies a, b (%) on n images."""
    return 2 * math.sqrt((a * (100 - a) + b * (100 - b)) / n)


def _verdict(gap: float, margin: float, equal: bool, name: str) -> str:
    if equal:
        return "holds" if abs(gap) <= margin else "contradicted"
    if gap > margin:
        return "holds"
    if -gap > margin:
        return "contradicted"
    return f"within the {name}"


def _every_seed(values: list[bool], detail: str, seeds: int) -> str:
    verdict = f"{'holds' if all(values) else 'contradicted'} ({detail})"
    return f"provisional, one seed: {verdict}" if seeds < 2 else verdict


def restoration_curve(metrics: list[dict], last: int = 5) -> list[float]:
    """Energy: smooth-L1 to the original after N = 0 (the corrupted input), 1, 2, ... gradient steps
    on the energy, mean over the last `last` logged training steps; [] when the run logs none."""
    rows = [m for m in metrics if "corrupted_l1" in m][-last:]
    if not rows:
        return []
    steps = sorted(int(k.removeprefix("loss_step")) for k in rows[-1] if k.startswith("loss_step"))
    keys = ["corrupted_l1", *(f"loss_step{n}" for n in steps)]
    return [statistics.fmean(r[k] for r in rows) for k in keys]


def restoration_by_steps(runs: list[dict]) -> str:
    """Energy: the claim holds when restoration_curve falls with every step in every seed."""
    curves = [c for c in (restoration_curve(r.get("metrics", [])) for r in runs) if c]
    if not curves:
        return "not measured"
    detail = "; ".join(" > ".join(f"N={n}: {v:.4f}" for n, v in enumerate(c)) for c in curves)
    return _every_seed([all(a > b for a, b in zip(c, c[1:])) for c in curves], detail, len(curves))


def topk_rises(runs: list[dict], window: int = 5) -> str:
    """MixedAE: TopK sampling accuracy (share of each query's TopK keys from its own image), mean of
    the first and of the last `window` logged steps. It rises when the gain is more than two
    standard errors of the difference of those means (from the step-to-step variation inside
    each window); the claim holds when it rises in every seed. Chance, keys drawn at random, is
    about the mixing ratio r (each image holds r of the N patch keys; the cls key is never the
    query's own)."""
    curves = [[m["topk_acc"] for m in r.get("metrics", []) if "topk_acc" in m] for r in runs]
    curves = [c for c in curves if len(c) >= 2 * window]
    if not curves:
        return "not measured"
    parts, rises = [], []
    for c in curves:
        first, last = c[:window], c[-window:]
        gain = statistics.fmean(last) - statistics.fmean(first)
        noise = 2 * math.sqrt((statistics.variance(first) + statistics.variance(last)) / window)
        rises.append(gain > noise)
        parts.append(f"{statistics.fmean(first):.3f} -> {statistics.fmean(last):.3f}, "
                     f"{'a rise' if gain > noise else 'no rise'} beyond noise {noise:.3f}")
    ratios = {r.get("objective_config", {}).get("mix_ratio") for r in runs} - {None}
    chance = f"; chance about r = {ratios.pop():g}" if len(ratios) == 1 else ""
    return _every_seed(rises, "; ".join(parts) + chance, len(curves))


def adversary_reach(runs: list[dict], eps: float) -> str:
    """AdPE: the largest adversarial perturbation logged at the end of training, as a share of its
    budget epsilon (the claim's mechanism: how far the adversary gets)."""
    finals = []
    for r in runs:
        rows = [m for m in r.get("metrics", []) if any(k.startswith("adv_") for k in m)]
        if rows:
            finals.append(max(v for k, v in rows[-1].items() if k.startswith("adv_")))
    if not finals:
        return "not measured"
    return "; ".join(f"{v:.3g} (eps {eps:g}): {v / eps:.3f} of eps" for v in finals)
