"""The study's report (docs/RESULTS.md and its siblings) from the per-run results of study.py beside
this file: a table of mean and spread over seeds, the cost of each method, accuracy against
pretraining images (runs with kept epoch checkpoints), the papers' claims judged against the seed
spread (claims.py), MLO-MAE's learned masks per kept checkpoint (learned_masks.py) and figures (plots.py with matplotlib when installed; each method's own PNGs).

The results are kept as committed run summaries, docs/study/<preset>/<entry>_seed<k>.json (the
run's result.json and its objective's options), so the report can be written again without the
run folders:

    python -m experiments.fashion_mnist.report --preset full [--runs runs/study_full] [--docs DIR]

--runs first collects the finished runs of a study folder into the summaries (and each method's
own figures into the figures folder). --docs writes the report, its figures and summaries into
another folder than docs/. Without matplotlib the committed report is not rewritten (it would
lose its figures): the command refuses, naming the fix, unless --docs points elsewhere.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json
import math
import shutil
import statistics
import subprocess
from pathlib import Path

from data.cli import Parser, refuse
from experiments.fashion_mnist import claims, plots
from experiments.fashion_mnist.common import FINETUNE_BLR, RAW_PIXEL_BASELINES, REPO, TRAIN_IMAGES, read_result
from experiments.fashion_mnist.entries import AT_ABLATION_BUDGET, PRESETS, REPORT_ORDER
from experiments.fashion_mnist.homologous_attention import has_topk, topk_reports
from experiments.fashion_mnist.learned_masks import mask_reports
from experiments.fashion_mnist.run_checkpoints import complete_tags
from train.engine.checkpoint import is_pinned

METRICS = plots.METRICS
RAW_PIXELS = {"logistic regression": RAW_PIXEL_BASELINES["logistic_regression"], "5-NN": RAW_PIXEL_BASELINES["knn_5"]}
COSTS = ("pretrain_minutes", "pretrain_seconds", "pretrain_images_per_s", "finetune_seconds", "level2_head_top1")


def summarize(results: list[dict]) -> dict[str, dict]:
    """entry -> {metric: (mean, min, max, n)} and costs (means), in the order entries first appear;
    frozen-feature metrics at earlier epochs under "<metric>@<epoch>"."""
    by_entry: dict[str, list[dict]] = {}
    for r in results:
        by_entry.setdefault(r["entry"], []).append(r)
    out = {}
    for name, runs in by_entry.items():
        row = {"label": runs[0]["label"], "seeds": sorted(r["seed"] for r in runs),
               "pretrain_images": runs[0].get("budget", {}).get("pretrain_samples")}  # one budget per table
        flat = [{**r, **{f"{k}@{e}": v for e, m in r.get("at_epochs", {}).items() for k, v in m.items()}}
                for r in runs]
        keys = [k for k, _ in METRICS] + list(COSTS) + sorted({k for f in flat for k in f if "@" in k})
        for key in keys:
            # NaN: a wall-clock not taken (study._timed: the run was resumed)
            values = [f[key] for f in flat if f.get(key) is not None and math.isfinite(f[key])]
            if values:
                row[key] = (statistics.fmean(values), min(values), max(values), len(values))
        out[name] = row
    return out


def _cell(stat: tuple | None, digits: int = 2) -> str:
    if stat is None:
        return "-"
    mean, lo, hi, n = stat
    return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def one_budget(results: dict[str, dict], fix: str) -> None:
    """Refused (naming two that differ and `fix`) unless every result, named by its key, has one budget:
    a table averages its runs and states one budget."""
    (first, reference), *rest = results.items()
    for name, r in rest:
        if r.get("budget") != reference.get("budget"):
            refuse(f"{name} was measured with {r.get('budget')}, {first} with {reference.get('budget')}: "
                   f"one table holds one budget; {fix}")


def collect(runs: Path, summaries: Path, figures: Path) -> None:
    """Every finished run under `runs` (<entry>/seed<k>/result.json) into summaries/<entry>_seed<k>.json,
    with its objective's options and the commit that trained it; its last figures into `figures`.
    Refused before anything is written when the runs' budgets differ from each other or from the
    summaries they would join."""
    incoming = {done: read_result(done) for done in sorted(runs.glob("*/seed*/result.json"))}
    replaced = {f"{r['entry']}_seed{r['seed']}.json" for r in incoming.values()}
    kept = {str(p): json.loads(p.read_text()) for p in sorted(summaries.glob("*_seed*.json"))
            if p.name not in replaced}  # the summaries these runs leave in place
    if incoming:
        one_budget(kept | {str(p): r for p, r in incoming.items()},
                   f"nothing was collected from {runs}: keep one budget's runs there, or report them into "
                   f"another folder (report.py --runs {runs} --docs DIR)")
    summaries.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    for done, result in incoming.items():
        meta = {}
        pretrain = done.parent / "pretrain"
        if (pretrain / "config.json").is_file():
            config = json.loads((pretrain / "config.json").read_text())
            meta = json.loads((pretrain / "meta.json").read_text())
            result["objective_config"] = config.get(config["objective"], {})
            code, git = meta.get("code", {}), meta.get("git", {})
            result["trained_at"] = code.get("git_commit") or git.get("commit", "unknown")
            result["torch_version"] = meta.get("torch", "unknown")
            if result["seed"] == 0:
                copy_method_figures(pretrain / "vis", result["entry"], figures)
            if config["objective"] == "mlomae" and "total_steps" in meta:
                result["learned_masks"] = epoch_masks(pretrain, config, meta["total_steps"])
            if config["objective"] == "mixedae" and has_topk(config["mixedae"]) and "total_steps" in meta:
                result["homologous_attention"] = epoch_topk(pretrain, config, meta["total_steps"])
        rows = result.get("metrics", [])
        zero = {k for m in rows for k in m if k.startswith("data_")} - {k for m in rows for k, v in m.items() if v}
        result["metrics"] = [{k: v for k, v in m.items() if k not in zero} for m in rows]  # no all-zero data counters
        speeds = [m["images_per_s"] for m in rows if "images_per_s" in m]
        if speeds:  # the median window: before the loop's fix (runs at f759f35) a window holding a save over-counted
            result["pretrain_images_per_s"] = round(statistics.median(speeds), 1)
        step_times = [m["step_time"] for m in rows if "step_time" in m]
        if step_times and "total_steps" in meta:  # the run's compute, also for runs resumed after an interruption
            result["pretrain_minutes"] = round(statistics.median(step_times) * meta["total_steps"] / 60, 1)
        (summaries / f"{result['entry']}_seed{result['seed']}.json").write_text(json.dumps(result, indent=1))


def kept_tags(pretrain: Path) -> list[Path]:
    """The checkpoints kept at epochs' ends (pinned) and the last one."""
    tags = complete_tags(pretrain)
    return [t for t in tags if is_pinned(t) or t == tags[-1]]


def _with_epochs(reports: list[dict], config: dict, total_steps: int) -> list[dict]:
    per_epoch = total_steps / config["optim"]["epochs"]
    return [{**r, "epoch": round(r["step"] / per_epoch, 2)} for r in reports]


def epoch_masks(pretrain: Path, config: dict, total_steps: int) -> list[dict]:
    """MLO-MAE: learned_masks' statistics at the kept checkpoints, each with its epoch, on the same
    1000 test images."""
    tags = kept_tags(pretrain)
    return _with_epochs(mask_reports(pretrain, tags, config["data"]["eval_index"]), config, total_steps) if tags else []


def epoch_topk(pretrain: Path, config: dict, total_steps: int) -> list[dict]:
    """MixedAE: homologous_attention's TopK shares at the kept checkpoints, each with its epoch, on 512
    images of the test split written beside the training index (study.py's shards); [] without it."""
    tags = kept_tags(pretrain)
    if not tags:
        return []
    test = Path(config["data"]["train_index"]).with_name("test.json")
    return _with_epochs(topk_reports(pretrain, tags, str(test)), config, total_steps) if test.is_file() else []


def copy_method_figures(vis: Path, entry: str, figures: Path) -> None:
    """The last step's PNG of each kind a run drew (reconstructions, attention, masks, restorations)."""
    latest: dict[str, Path] = {}
    for png in sorted(vis.glob("*_step*.png")):
        latest[png.name.rsplit("_step", 1)[0]] = png
    for kind, png in latest.items():
        shutil.copyfile(png, figures / f"{entry}_{kind}.png")


def load(summaries: Path, order: list[str]) -> list[dict]:
    """The run summaries of a folder, in the study's entry order, then by seed."""
    results = [json.loads(p.read_text()) for p in summaries.glob("*_seed*.json")]
    rank = {name: i for i, name in enumerate(order)}
    return sorted(results, key=lambda r: (rank.get(r["entry"], len(rank)), r["seed"]))


def earlier_epochs(row: dict) -> list[int]:
    """The epochs before the last whose frozen features a summary row holds ("<metric>@<epoch>")."""
    return sorted({int(k.split("@")[1]) for k in row if "@" in k})


def epoch_curves(summary: dict) -> dict[str, dict]:
    """{label: {metric: [(pretraining images, mean top-1), ...]}} for entries with earlier epochs
    evaluated; the random-init control is every curve's point at 0 images."""
    start = summary.get("random_init", {})
    return {row["label"]: {
        key: ([(0, start[key][0])] if key in start else []) +
             [(e * TRAIN_IMAGES, row[f"{key}@{e}"][0]) for e in earlier_epochs(row) if f"{key}@{e}" in row] +
             ([(row["pretrain_images"], row[key][0])] if key in row else [])
        for key, _ in METRICS[:2]} for row in summary.values() if earlier_epochs(row)}


def _minutes(stat: tuple | None) -> tuple | None:
    """A (mean, min, max, n) of seconds in minutes."""
    return None if stat is None else (*(v / 60 for v in stat[:3]), stat[3])


def table(summary: dict) -> list[str]:
    """The main table. Pretraining minutes: the median logged step time x the run's steps where the
    run summary has them (the compute, comparable when a run was interrupted and resumed),
    else the measured wall-clock; fine-tuning: wall-clock including its start-up and evaluation."""
    lines = ["| method | kNN | linear | fine-tune | pretraining (min) | images/s | fine-tuning (min) |",
             "|---|---|---|---|---|---|---|"]
    for row in summary.values():
        pretrain = row.get("pretrain_minutes") or _minutes(row.get("pretrain_seconds"))
        lines.append(f"| {row['label']} | " + " | ".join(_cell(row.get(k)) for k, _ in METRICS) +
                     f" | {_cell(pretrain, 1)} | {_cell(row.get('pretrain_images_per_s'), 0)}"
                     f" | {_cell(_minutes(row.get('finetune_seconds')), 1)} |")
    lines += [f"| raw pixels ({name}) | {value if 'NN' in name else '-'} | {value if 'NN' not in name else '-'} "
              f"| - | - | - | - |" for name, value in RAW_PIXELS.items()]
    for row in summary.values():  # objectives with their own classifier (MLO-MAE)
        if "level2_head_top1" in row:
            lines += ["", f"{row['label']}'s own level-II head (trained during pretraining on its D_tr split): "
                          f"{_cell(row['level2_head_top1'])} on the test split."]
    return lines


def epoch_table(summary: dict) -> list[str]:
    """kNN / linear at each evaluated epoch and at the end (mean over seeds)."""
    rows = {n: r for n, r in summary.items() if any("@" in k for k in r)}
    if not rows:
        return []
    epochs = sorted({e for r in rows.values() for e in earlier_epochs(r)})
    top = max(r["pretrain_images"] for r in rows.values())
    cols = [*epochs, f"{top / TRAIN_IMAGES:g}"]
    lines = ["", "## Accuracy against pretraining", "",
             "Frozen features of the checkpoints kept at the end of each listed epoch (the same run: its learning rate "
             "had not finished its schedule there); epoch 0 is the random-init control.", "",
             "| method | " + " | ".join(f"kNN @{e}" for e in [0, *cols]) + " | " +
             " | ".join(f"linear @{e}" for e in [0, *cols]) + " |", "|---|" + "---|" * (2 * len(cols) + 2)]
    start = summary.get("random_init", {})
    for row in rows.values():
        cells = []
        for key, _ in METRICS[:2]:
            cells.append(_cell(start.get(key)))
            cells += [_cell(row.get(f"{key}@{e}")) for e in epochs] + [_cell(row.get(key))]
        short = row["pretrain_images"] < top  # an entry run at the ablation preset's budget (reduced_budget_rows)
        label = f"{row['label']} ({row['pretrain_images'] / TRAIN_IMAGES:g} epochs in all)" if short else row["label"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def reduced_budget_rows(summary: dict, reduced: dict) -> dict[str, dict]:
    """The rows of entries.AT_ABLATION_BUDGET (energy) from the ablation preset's summary, shaped for the
    accuracy-against-pretraining table and figure: their last checkpoint becomes one more earlier
    epoch ("<metric>@3"), so the curve ends at 3 epochs instead of reaching the 10-epoch column."""
    rows = {}
    for name in AT_ABLATION_BUDGET:
        if name in reduced and name not in summary:
            row = dict(reduced[name])
            epochs = f"{row['pretrain_images'] / TRAIN_IMAGES:g}"
            for key, _ in METRICS[:2]:
                if key in row:
                    row[f"{key}@{epochs}"] = row.pop(key)
            rows[name] = row
    return rows


def claim_lines(summary: dict, results: list[dict], ablation: list[dict] | None, ab: dict,
                expected: list[str] = ()) -> list[str]:
    """The claims whose entries this study runs (`expected`, or has results for): MAIN on its runs,
    except those naming an entry run at the ablation preset's budget (energy), judged there (`ab`:
    summarize(ablation)) against that budget's random-init control. The ablation preset's own
    report (no `ablation`) judges its Table A4 claims in the same table."""
    reduced = f"{ablation[0]['budget']['pretrain_samples'] / TRAIN_IMAGES:g}-epoch runs" if ablation else ""
    here = set(expected) | set(summary)
    elsewhere = set(AT_ABLATION_BUDGET) if ablation else set()  # judged on the ablation preset's runs

    def run_here(*entries: str) -> bool:
        return set(entries) <= here | elsewhere

    lines = ["", "## The papers' claims at this scale", "", "| claim | compared on | outcome |", "|---|---|---|"]
    for c in claims.MAIN + (() if ablation else claims.ABLATION):
        if not run_here(c.better, c.worse):
            continue
        if {c.better, c.worse} & elsewhere:
            lines.append(f"| {c.claim} | {claims.METRIC_NAMES[c.metric]}, {reduced} | {claims.judge(ab, c)} |")
        else:
            lines.append(f"| {c.claim} | {claims.METRIC_NAMES[c.metric]} | {claims.judge(summary, c)} |")
    # each curve claim from this study's runs, else from the ablation preset's (AT_ABLATION_BUDGET)
    by_entry = {e: [r for r in results if r["entry"] == e] or [r for r in ablation or [] if r["entry"] == e]
                for e in ("mixedae", "adpe", "energy")}
    eps = {r["entry"]: r.get("objective_config", {}).get("adv_eps") for r in by_entry["adpe"]}
    curves = {  # entry: (claim, compared on, verdict), judged only where the entry is run
        "mixedae": ("MixedAE paper (Fig. 6): TopK sampling accuracy rises over training (about 0.8 at ImageNet scale)",
                    "first vs last 5 logged steps", lambda: claims.topk_rises(by_entry["mixedae"])),
        "adpe": ("AdPE paper: the adversary's perturbation (how far it gets toward epsilon)",
                 "largest logged offset at the end",
                 lambda: claims.adversary_reach(by_entry["adpe"], eps.get("adpe") or float("nan"))),
        "energy": ("Energy paper: restoration improves with the number of gradient steps N",
                   "smooth-L1 to the original, last 5 logged steps",
                   lambda: claims.restoration_by_steps(by_entry["energy"])),
    }
    lines += [f"| {claim} | {on} | {verdict()} |" for entry, (claim, on, verdict) in curves.items() if run_here(entry)]
    if ablation:
        budget = ablation[0]["budget"]
        lines += ["", f"At a reduced budget ({budget['pretrain_samples']} pretraining images, {reduced}; the ablation "
                      "preset): MixedAE's Table A4 ablations and energy-based pretraining, with MAE, MixedAE and "
                      "random init rerun at that budget:", "",
                  "| claim | compared on | outcome |", "|---|---|---|"]
        lines += [f"| {c.claim} | {claims.METRIC_NAMES[c.metric]} | {claims.judge(ab, c)} |" for c in claims.ABLATION]
        lines += ["", *table(ab)]
    for paragraph in claims.__doc__.strip().split("\n\n")[1:]:  # how a verdict is reached
        lines += ["", paragraph.replace("\n", " ")]
    return lines


def mask_lines(results: list[dict]) -> list[str]:
    """MLO-MAE: what the masking network gives at each kept checkpoint (learned_masks.py)."""
    runs = [r for r in results if r.get("learned_masks")]
    if not runs:
        return []
    lines = ["", "## MLO-MAE's learned masks", "",
             f"The masking network T of each kept checkpoint on the same {runs[0]['learned_masks'][0]['images']} test "
             "images (experiments/fashion_mnist/learned_masks.py): how many different top-k masks it gives them "
             "(1 = the same mask for every image), how many patches it masks in every image, its mean probability "
             "p overall and on the masked patches (their weights in the level-I loss), the share of p within 0.01 "
             "of 0 or 1 (saturated: almost no hypergradient passes), and the std of p over images.", "",
             "| run | epoch | distinct masks | always masked | p mean | p masked | saturated | spread |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for m in r["learned_masks"]:
            lines.append(f"| {r['label']} seed {r['seed']} | {m['epoch']:g} | {m['distinct_masks']} | "
                         f"{m['always_masked']} of {m['patches']} | {m['mask_prob_mean']:.3f} | "
                         f"{m['mask_prob_masked']:.3f} | {m['mask_prob_saturated']:.3f} | {m['mask_prob_spread']:.4f} |")
    return lines


def topk_lines(results: list[dict]) -> list[str]:
    """MixedAE: what its homologous TopK attention selects at each kept checkpoint (homologous_attention.py)."""
    runs = [r for r in results if r.get("homologous_attention")]
    if not runs:
        return []
    first = runs[0]["homologous_attention"][0]
    blocks = sorted(int(k.removeprefix("topk_acc_block")) for k in first if k.startswith("topk_acc_block"))
    lines = ["", "## MixedAE's homologous attention", "",
             f"TopK sampling accuracy (the share of each patch query's kept keys that come from its own image) of "
             f"each kept checkpoint on the same {first['images']} test images and mixings "
             "(experiments/fashion_mnist/homologous_attention.py): its mean over blocks, the same with the segment "
             "embeddings left out of the encoder's input, each block's, and chance (keys drawn at random).", "",
             "| run | epoch | chance | TopK accuracy | without segment embeddings | " +
             " | ".join(f"block {b}" for b in blocks) + " |", "|---|---|---|---|---|" + "---|" * len(blocks)]
    for r in runs:
        for m in r["homologous_attention"]:
            without = m.get("without_segments_topk_acc")
            lines.append(f"| {r['label']} seed {r['seed']} | {m['epoch']:g} | {m.get('chance', float('nan')):.3f} | "
                         f"{m['topk_acc']:.3f} | {'-' if without is None else f'{without:.3f}'} | " +
                         " | ".join(f"{m[f'topk_acc_block{b}']:.3f}" for b in blocks) + " |")
    return lines


def figure_lines(results: list[dict], summary: dict, figures: Path, link: str, curves: dict) -> list[str]:
    """Draw the figures (when matplotlib is installed) and link them with each method's own;
    `curves`: the summary rows drawn against pretraining images (epoch_curves)."""
    drawn: list[str] = []
    plt = plots.pyplot()
    if plt is not None:
        eps = {r["entry"]: r["objective_config"]["adv_eps"] for r in results
               if r.get("objective_config", {}).get("adversary", "none") != "none"}
        # keys drawn at random come from the query's own image about r of the time (claims.topk_rises)
        ratios = {r["objective_config"]["mix_ratio"] for r in results if "mix_ratio" in r.get("objective_config", {})}
        chance = None
        if len(ratios) == 1:
            r = ratios.pop()
            chance = (r, f"chance (r = {r:g})")
        drawn = [n for n in (
            plots.loss_curves(plt, results, figures), plots.accuracy_bars(plt, summary, figures),
            plots.accuracy_vs_images(plt, epoch_curves(curves), figures),
            plots.over_training(plt, results, figures, r"topk_acc", "TopK sampling accuracy (mean over blocks)",
                                "topk_accuracy.png", reference=chance),
            plots.over_training(plt, results, figures, r"adv_.*", "largest adversarial offset / epsilon",
                                "adversary.png", eps, reference=(1.0, "epsilon"))) if n]
    own = [(f"{row['label']}: {png.stem.removeprefix(name + '_').replace('_', ' ')}", png.name)
           for name, row in summary.items() for png in sorted(figures.glob(f"{name}_*.png"))
           if not any(png.stem.startswith(f"{other}_") and len(other) > len(name) for other in summary)]
    if not drawn and not own:
        return []
    lines = ["", "## Figures", ""]
    lines += [line for name in drawn for line in (f"![{name}]({link}/{name})", "")]
    lines += [line for caption, name in own for line in (f"**{caption}**", "", f"![{caption}]({link}/{name})", "")]
    return lines


def write_report(results: list[dict], report: Path, figures: Path, discussion: Path | None = None,
                 ablation: list[dict] | None = None, expected: list[str] = (), preset: str = "full") -> int:
    """The report from the run results; `discussion` (hand-written about the committed run) verbatim;
    `expected`: the study's entries, those without results listed as still to run; `preset` names
    the command in the report's first line. Returns the number of figures it links."""
    one_budget({f"{r['entry']} seed {r['seed']}": r for r in results}, "report each budget's runs on its own")
    summary = summarize(results)
    figures.mkdir(parents=True, exist_ok=True)
    budget = results[0]["budget"]
    seeds = sorted({r["seed"] for r in results})
    trained = sorted({r.get("trained_at", "")[:7] for r in results} - {""})
    torch_versions = sorted({r.get("torch_version", "") for r in results} - {""})
    lines = [
        "# Fashion-MNIST study: every method on the mini ViT", "",
        f"Generated by `python -m experiments.fashion_mnist.report --preset {preset}` (experiments/fashion_mnist/"
        f"report.py; do not edit by hand) at commit {_git_commit()} from runs trained at commit(s) "
        f"{', '.join(trained) or 'unknown'}; device {results[0]['device']} ({results[0]['torch_threads']} thread(s) "
        f"per run, torch {', '.join(torch_versions) or 'unknown'}); seeds {seeds}. Budget per method: pretraining "
        f"on {budget['pretrain_samples']} training images ({budget['pretrain_samples'] / TRAIN_IMAGES:g} epochs of "
        f"the {TRAIN_IMAGES // 1000}k), then {budget['finetune_epochs']:g} "
        f"fine-tuning epoch(s) of {budget['finetune_samples']} images. Test split top-1 (%): mean over seeds, "
        "(min-max) in brackets. kNN (k = 20, cosine, weighted) and linear probe on frozen features (cls token; "
        "energy: patch mean); fine-tuning: the MAE protocol shrunk to the mini ViT (experiments/fashion_mnist/"
        f"study.py says how; its one changed setting, blr {FINETUNE_BLR:g}, was chosen on MAE's fine-tuning training "
        "loss). Nothing was tuned on the test split. Costs: pretraining minutes are the median logged step time x "
        "the run's steps where the run summary has them (its compute, comparable across resumed runs), else the "
        "measured wall-clock; fine-tuning minutes are wall-clock, start-up and test evaluation included.",
    ]
    reduced = summarize(ablation or [])
    missing = [e for e in expected if e not in summary]
    if ablation is not None:  # the full study: its entries run at the ablation preset's budget
        missing += [f"{e} at the ablation preset's budget" for e in AT_ABLATION_BUDGET if e not in reduced]
    curves = summary | reduced_budget_rows(summary, reduced)
    if missing:
        lines += ["", f"**Still to run:** {', '.join(missing)} (the study resumes them; this report is partial)."]
    lines += ["", *table(summary), *epoch_table(curves), *claim_lines(summary, results, ablation, reduced, expected),
              *mask_lines(results), *topk_lines(results)]
    if discussion is not None and discussion.is_file():
        lines += ["", discussion.read_text().strip()]
    link = figures.relative_to(report.parent).as_posix() if figures.is_relative_to(report.parent) else str(figures)
    drawn = figure_lines(results, summary, figures, link, curves)
    lines += drawn
    report.write_text("\n".join(lines) + "\n")
    return sum(line.startswith("![") for line in drawn)


def paths(preset: str, docs: Path = REPO / "docs") -> dict[str, Path]:
    """Where a preset's report, hand-written discussion, run summaries and figures live."""
    suffix = "" if preset == "full" else f"_{preset}"
    return {"report": docs / f"RESULTS{suffix}.md", "discussion": docs / f"RESULTS{suffix}_discussion.md",
            "summaries": docs / "study" / preset, "figures": docs / "figures" / (preset if suffix else "")}


NO_FIGURES = ("matplotlib is not installed, so the report would be written without its figures: install it "
              "(pip install -e '.[study]')")


def check_figures(docs: Path) -> None:
    """Before any work: the committed report (under docs/) is never rewritten without its figures."""
    if plots.pyplot() is None and docs.resolve() == (REPO / "docs").resolve():
        refuse(f"{NO_FIGURES}, or write it elsewhere (report.py --docs DIR, study.py --report FILE); "
               f"docs/ is left as it is")


def publish(preset: str, runs: Path | None, order: list[str], expected: list[str], docs: Path = REPO / "docs") -> Path:
    """Collect `runs` (when given) into the preset's summaries and write its report; the full
    study's report also judges the ablation preset's summaries. Returns the report's path; says
    where it went and how many figures it links. Refused (exit 2) before anything is written when
    there is nothing to report, when runs of different budgets would share its table, or when the
    report under docs/ would lose its figures."""
    check_figures(docs)
    where = paths(preset, docs)
    if runs is not None and not runs.is_dir():
        refuse(f"--runs {runs} is not a folder: give the study's run folder (runs/study_{preset})")
    if not load(where["summaries"], order) and (runs is None or not any(runs.glob("*/seed*/result.json"))):
        refuse(f"no run summaries in {where['summaries']}" + (f" and no finished run in {runs}" if runs else "")
               + ": pass --runs with the study's run folder")
    if runs is not None:
        collect(runs, where["summaries"], where["figures"])
    results = load(where["summaries"], order)
    ablation = load(paths("ablation", docs)["summaries"], order) if preset == "full" else None
    figures = write_report(results, where["report"], where["figures"], where["discussion"], ablation, expected, preset)
    if plots.pyplot() is not None:
        print(f"wrote {where['report']} with {figures} figure(s) in {where['figures']}")
    else:
        print(f"wrote {where['report']} linking {figures} figure(s) already in {where['figures']}, drawing none: "
              f"matplotlib is not installed (pip install -e '.[study]')")
    return where["report"]


def main(argv: list[str] | None = None) -> Path:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), default="full", help="which study (default %(default)s)")
    p.add_argument("--runs", type=Path, help="the study's run folder to collect first (default: the summaries only)")
    p.add_argument("--docs", type=Path, default=REPO / "docs",
                   help="the folder of the report, its figures and run summaries (default: docs/, the committed ones)")
    a = p.parse_args(argv)
    return publish(a.preset, a.runs, REPORT_ORDER, PRESETS[a.preset]["entries"], a.docs)


if __name__ == "__main__":
    main()
