"""The study's report from per-run results (experiments/fashion_mnist/report.py): mean and range over
seeds, accuracy against pretraining at the kept epochs, the claims, run summaries collected from
run folders and written again without them, each method's own figures."""
import json

import pytest

from experiments.fashion_mnist.report import (
    epoch_curves,
    figure_lines,
    load,
    paths,
    publish,
    reduced_budget_rows,
    summarize,
    table,
    write_report,
)

BUDGET = {"pretrain_samples": 180000, "finetune_epochs": 1, "finetune_samples": 60000, "eval_epochs": [1]}


def _result(entry, seed, knn, linear, finetune, **extra):
    return {"entry": entry, "label": entry.upper(), "seed": seed, "knn_top1": knn, "linear_probe_top1": linear,
            "finetune_top1": finetune, "pretrain_seconds": 120.0 + 60 * seed, "pretrain_images_per_s": 500.0,
            "finetune_seconds": 30.0, "loss_curve": [(1, 1.0), (2, 0.5)], "device": "cpu", "torch_threads": 1,
            "budget": BUDGET, **extra}


RESULTS = [
    _result("mae", 0, 70.0, 78.0, 85.0, at_epochs={"1": {"knn_top1": 60.0, "linear_probe_top1": 70.0}}),
    _result("mae", 1, 72.0, 80.0, 87.0, at_epochs={"1": {"knn_top1": 62.0, "linear_probe_top1": 71.0}}),
    _result("mixedae", 0, 71.0, 79.0, 90.0), _result("mixedae", 1, 71.0, 79.0, 91.0),
    _result("mlomae", 0, 60.0, 70.0, 80.0, level2_head_top1=75.0), _result("mlomae", 1, 60.0, 72.0, 80.0),
    _result("random_init", 0, 50.0, 55.0, 60.0), _result("random_init", 1, 52.0, 57.0, 62.0),
]


def test_summary_means_ranges_and_earlier_epochs():
    s = summarize(RESULTS)
    assert list(s) == ["mae", "mixedae", "mlomae", "random_init"]  # first-seen order
    assert s["mae"]["knn_top1"] == (71.0, 70.0, 72.0, 2)
    assert s["mae"]["knn_top1@1"] == (61.0, 60.0, 62.0, 2)
    assert s["mae"]["pretrain_seconds"] == (150.0, 120.0, 180.0, 2)
    assert s["mlomae"]["level2_head_top1"] == (75.0, 75.0, 75.0, 1)  # only where it was measured


def test_a_resumed_run_has_no_wall_clock_and_the_summary_leaves_it_out():
    resumed = [{**RESULTS[0], "finetune_seconds": float("nan")}, RESULTS[1]]  # study._timed: NaN when resumed
    assert summarize(resumed)["mae"]["finetune_seconds"] == (30.0, 30.0, 30.0, 1)
    assert "finetune_seconds" not in summarize(resumed[:1])["mae"]  # the table prints "-", not "nan"


def test_accuracy_against_pretraining_starts_at_random_init():
    s = summarize(RESULTS)
    assert epoch_curves(s) == {"MAE": {"knn_top1": [(0, 51.0), (60000, 61.0), (180000, 71.0)],
                                       "linear_probe_top1": [(0, 56.0), (60000, 70.5), (180000, 79.0)]}}


def test_report_tables_claims_and_what_is_still_to_run(tmp_path):
    report = tmp_path / "RESULTS.md"
    discussion = tmp_path / "discussion.md"
    discussion.write_text("## Discussion\n\nWritten by hand.\n")
    write_report(RESULTS, report, tmp_path / "figures", discussion, expected=["mae", "mixedae", "energy"])
    text = report.read_text()
    # minutes for the costs: 120 s and 180 s of pretraining
    assert "| MAE | 71.00 (70.00-72.00) | 79.00 (78.00-80.00) | 86.00 (85.00-87.00) | 2.5 (2.0-3.0) | 500 (500-500) " \
           "| 0.5 (0.5-0.5) |" in text
    from experiments.fashion_mnist.common import RAW_PIXEL_BASELINES as raw

    assert f"| raw pixels (logistic regression) | - | {raw['logistic_regression']} |" in text
    assert f"| raw pixels (5-NN) | {raw['knn_5']} | - |" in text
    assert "| kNN @0 | kNN @1 | kNN @3 | linear @0 | linear @1 | linear @3 |" in text
    assert "| MAE | 51.00 (50.00-52.00) | 61.00 (60.00-62.00) | 71.00 (70.00-72.00) | 56.00 (55.00-57.00) |" in text
    assert "| MixedAE paper: MixedAE improves on MAE | fine-tune | holds (90.50 vs 86.00: +4.50, spread 2.00) |" in text
    assert "learned masks give better linear accuracy than MAE | linear | contradicted (71.00 vs 79.00: -8.00, " \
           "spread 2.00) |" in text
    # the level-II head's own accuracy (75 on seed 0), not MLO-MAE's fine-tuning (80)
    assert "MLOMAE's own level-II head (trained during pretraining on its D_tr split): 75.00 on the test split." in text
    assert _table_shapes(text) and all(header == separator and rows <= {header}
                                       for header, separator, rows in _table_shapes(text))
    assert "**Still to run:** energy" in text
    assert "seeds [0, 1]" in text and "pretraining on 180000 training images (3 epochs of the 60k)" in text
    assert text.index("## Discussion\n\nWritten by hand.") > text.index("## The papers' claims")


def _table_shapes(text):
    """(header, separator, {rows}) pipe counts of each markdown table of a report: a table renders
    only when its separator has one cell per header cell."""
    lines = text.splitlines()
    shapes = []
    for i, line in enumerate(lines):
        if line.startswith("|---"):
            rows = []
            for row in lines[i + 1:]:
                if not row.startswith("|"):
                    break
                rows.append(row.count("|"))
            shapes.append((lines[i - 1].count("|"), line.count("|"), set(rows)))
    return shapes


def _finished_run(root, entry, seed, result):
    run = root / entry / f"seed{seed}"
    (run / "pretrain" / "vis").mkdir(parents=True)
    (run / "result.json").write_text(json.dumps(result))
    (run / "pretrain" / "config.json").write_text(json.dumps({"objective": entry, entry: {"adv_eps": 20.0}}))
    (run / "pretrain" / "meta.json").write_text(json.dumps({"steps_per_epoch": 468, "total_steps": 600, "code": {"git_commit": "abc1234def"},
                                                                  "torch": "2.14.1"}))
    for step in (100, 200):
        (run / "pretrain" / "vis" / f"{entry}_reconstruction_step{step:08d}.png").write_bytes(
            f"png {step} seed {seed}".encode())


def test_collected_summaries_write_the_report_without_the_run_folders(capsys, tmp_path):
    runs, docs = tmp_path / "runs", tmp_path / "docs"
    windows = [{"step": 50, "images_per_s": 100.0, "step_time": 1.0, "data_skipped_x": 0, "data_converted_y": 0},
               {"step": 100, "images_per_s": 900.0, "step_time": 0.1, "data_skipped_x": 0, "data_converted_y": 2},
               {"step": 150, "images_per_s": 300.0, "step_time": 0.3, "data_skipped_x": 0, "data_converted_y": 0}]
    for r in RESULTS:
        _finished_run(runs, r["entry"], r["seed"], dict(r, metrics=windows) if r["entry"] == "mae" else r)
    ablation = [dict(r, entry=f"{r['entry']}") for r in RESULTS]
    (docs / "study" / "ablation").mkdir(parents=True)
    for r in ablation:
        (docs / "study" / "ablation" / f"{r['entry']}_seed{r['seed']}.json").write_text(json.dumps(r))
    order = ["random_init", "mlomae", "mixedae", "mae"]
    report = publish("full", runs, order, order, docs)
    where = paths("full", docs)
    assert report == docs / "RESULTS.md" and where["figures"] == docs / "figures"
    summary = json.loads((where["summaries"] / "mae_seed1.json").read_text())
    assert summary["objective_config"] == {"adv_eps": 20.0} and summary["trained_at"] == "abc1234def"
    assert summary["pretrain_images_per_s"] == 300.0  # the median window, not the mean (433.3)
    assert [sorted(m) for m in summary["metrics"]][1] == ["data_converted_y", "images_per_s", "step", "step_time"]
    assert summary["pretrain_minutes"] == 0.3 * 600 / 60  # median step time x the run's 600 steps
    assert [(r["entry"], r["seed"]) for r in load(where["summaries"], order)][:3] == \
        [("random_init", 0), ("random_init", 1), ("mlomae", 0)]
    assert (where["figures"] / "mae_mae_reconstruction.png").read_bytes() == b"png 200 seed 0"  # seed 0's last step
    text = report.read_text()
    assert "![MAE: mae reconstruction](figures/mae_mae_reconstruction.png)" in text
    assert "from runs trained at commit(s) abc1234" in text and "torch 2.14.1)" in text
    assert "At a reduced budget (180000 pretraining images, 3-epoch runs; the ablation preset): MixedAE's Table A4" in text
    # the run folders gone, the committed summaries write the same report
    import shutil

    shutil.rmtree(runs)
    first = text
    assert publish("full", None, order, order, docs).read_text() == first
    with pytest.raises(SystemExit) as status:
        publish("quick", None, order, order, docs)
    assert status.value.code == 2 and "no run summaries" in capsys.readouterr().err
    assert paths("quick", docs)["figures"] == docs / "figures" / "quick"


def test_report_needs_no_plotting_library(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    write_report(RESULTS, tmp_path / "RESULTS.md", tmp_path / "figures")
    assert "loss_curves.png" not in (tmp_path / "RESULTS.md").read_text()


def test_without_matplotlib_the_committed_report_is_kept_and_another_folder_says_so(tmp_path, monkeypatch, capsys):
    from experiments.fashion_mnist import plots, report

    monkeypatch.setattr(plots, "pyplot", lambda: None)
    committed = paths("full")["report"]
    before = committed.stat().st_mtime, committed.read_text()
    with pytest.raises(SystemExit) as status:
        report.main(["--preset", "full"])
    assert status.value.code == 2 and "docs/ is left as it is" in capsys.readouterr().err
    assert (committed.stat().st_mtime, committed.read_text()) == before
    docs = tmp_path / "docs"
    (docs / "study" / "full").mkdir(parents=True)
    for r in RESULTS:
        (docs / "study" / "full" / f"{r['entry']}_seed{r['seed']}.json").write_text(json.dumps(r))
    assert report.main(["--preset", "full", "--docs", str(docs)]) == docs / "RESULTS.md"
    said = capsys.readouterr().out
    assert "RESULTS.md linking 0 figure(s) already in" in said and "drawing none: matplotlib is not installed" in said
    assert "![" not in (docs / "RESULTS.md").read_text()
    (docs / "figures" / "mae_reconstructions.png").write_bytes(b"drawn by an earlier run")  # a method's own figure
    report.main(["--preset", "full", "--docs", str(docs)])
    said = capsys.readouterr().out
    assert "RESULTS.md linking 1 figure(s) already in" in said, said
    assert "](figures/mae_reconstructions.png)" in (docs / "RESULTS.md").read_text()


def test_plots_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")  # the `study` extra; not part of the test install
    from PIL import Image

    topk = [{"step": i, "topk_acc": 0.3 + 0.01 * i} for i in range(12)]
    adv = [{"step": i, "adv_rpe_0": 0.1 * i} for i in range(12)]
    extra = [_result("mixedae_naive", 0, 70.0, 78.0, 85.0, metrics=topk),
             _result("adpe", 0, 70.0, 78.0, 85.0, metrics=adv, objective_config={"adversary": "rpe", "adv_eps": 2.0})]
    write_report(RESULTS + extra, tmp_path / "RESULTS.md", tmp_path / "figures")
    text = (tmp_path / "RESULTS.md").read_text()
    for name in ("loss_curves.png", "accuracy.png", "accuracy_vs_images.png", "topk_accuracy.png", "adversary.png"):
        assert Image.open(tmp_path / "figures" / name).size[0] > 500
        assert f"![{name}](figures/{name})" in text


def test_curves_over_training_draw_their_reference_level(tmp_path):
    pytest.importorskip("matplotlib")
    from experiments.fashion_mnist import plots

    class KeepLines:  # pyplot, reading each figure's lines back as _save writes it (then closes it)
        def __init__(self, plt):
            self.plt, self.lines = plt, {}

        def subplots(self, *args, **kwargs):
            fig, ax = self.plt.subplots(*args, **kwargs)
            save = fig.savefig

            def read_then_save(*a, **k):
                self.lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
                save(*a, **k)

            fig.savefig = read_then_save
            return fig, ax

    plt = KeepLines(plots.pyplot())
    run = _result("mixedae", 0, 70.0, 78.0, 85.0, metrics=[{"step": i, "topk_acc": 0.25} for i in range(3)])
    assert plots.over_training(plt, [run], tmp_path, "topk_acc", "TopK", "t.png", reference=(0.25, "chance")) == "t.png"
    assert plt.lines == {"MIXEDAE": [0.25, 0.25, 0.25], "chance": [0.25, 0.25]}  # axhline: two points at the level


def test_energy_is_judged_at_the_ablation_budget_and_drawn_to_its_last_epoch(tmp_path):
    """entries.AT_ABLATION_BUDGET: energy runs only in the ablation preset (3 epochs); the full report
    judges its claims on those runs against that preset's random init, and puts its last checkpoint
    in the accuracy-against-pretraining table as epoch 3."""
    full_budget = dict(BUDGET, pretrain_samples=600000, eval_epochs=[1, 3])
    full = [dict(r, budget=full_budget, at_epochs={"1": {"knn_top1": 60.0, "linear_probe_top1": 70.0},
                                                   "3": {"knn_top1": 65.0, "linear_probe_top1": 75.0}})
            if r["entry"] == "mae" else dict(r, budget=full_budget) for r in RESULTS]
    restoration = [{"step": s, "corrupted_l1": 0.5, "loss_step1": 0.45, "loss_step2": 0.4} for s in (1, 2)]
    ablation = [_result("energy", 0, 40.0, 50.0, 58.0, metrics=restoration,
                        at_epochs={"1": {"knn_top1": 30.0, "linear_probe_top1": 45.0}}),
                _result("random_init", 0, 50.0, 55.0, 60.0)]
    report = tmp_path / "RESULTS.md"
    write_report(full, report, tmp_path / "figures", ablation=ablation, expected=["mae"])
    text = report.read_text()
    # energy vs random init on the 3-epoch runs (one seed each: provisional, test-set noise)
    assert "| Energy paper: pretraining beats random init (kNN) | kNN, 3-epoch runs | provisional, one seed: " \
           "contradicted (40.00 vs 50.00: -10.00, test-set noise 1.40) |" in text
    assert "restoration improves with the number of gradient steps N | smooth-L1 to the original, last 5 logged " \
           "steps | provisional, one seed: holds (N=0: 0.5000 > N=1: 0.4500 > N=2: 0.4000) |" in text
    # columns 0, 1, 3, 10: energy's last checkpoint (3 epochs) under @3, nothing under @10
    assert "| ENERGY (3 epochs in all) | 51.00 (50.00-52.00) | 30.00 | 40.00 | - | 56.00 (55.00-57.00) | 45.00 | " \
           "50.00 | - |" in text
    assert "| MAE | 51.00 (50.00-52.00) | 60.00 (60.00-60.00) | 65.00 (65.00-65.00) | 71.00 (70.00-72.00) |" in text
    assert "Still to run" not in text
    write_report(full, report, tmp_path / "figures", ablation=ablation[1:], expected=["mae"])
    assert "**Still to run:** energy at the ablation preset's budget" in report.read_text()


def test_a_reports_claims_are_those_its_preset_runs_and_the_ablation_report_judges_table_a4(tmp_path):
    ablation = [_result(entry, 0, 60.0, 70.0, top1) for entry, top1 in
                [("mae", 80.0), ("mixedae", 81.0), ("mixedae_no_segment", 79.0), ("mixedae_without_mixing", 77.0),
                 ("mixedae_homocon_only", 60.0), ("mixedae_masked_sa", 80.2), ("random_init", 76.0)]]
    report = tmp_path / "RESULTS_ablation.md"
    expected = ["energy", "mae", "mixedae", "mixedae_homocon_only", "mixedae_no_segment", "mixedae_without_mixing",
                "mixedae_masked_sa", "random_init"]
    write_report(ablation, report, tmp_path / "figures", expected=expected)
    claims_table = report.read_text().split("## The papers' claims at this scale")[1].split("\n\n")[1]
    assert "| MixedAE Table A4c: without mixing is worse than without segment embeddings | fine-tune | " \
           "provisional, one seed: holds (79.00 vs 77.00: +2.00, test-set noise 1.17) |" in claims_table
    assert "| MixedAE Table A4a: masked self-attention is about equal to MAE | fine-tune | provisional, one seed: " \
           "holds (80.20 vs 80.00: +0.20, test-set noise 1.13) |" in claims_table
    assert "MixedAE paper: MixedAE improves on MAE | fine-tune" in claims_table
    assert "pretraining beats random init (kNN) | kNN | not measured" in claims_table  # energy: in the preset, no run
    assert "AdPE" not in claims_table and "MLO-MAE" not in claims_table and "naive" not in claims_table


def _tree(folder):
    """{relative path: bytes} of every file under `folder`."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_runs_of_another_budget_are_refused_before_anything_is_written(tmp_path, capsys):
    """One table averages its runs and states one budget: a run measured with another budget than the
    summaries it would join, or than the other runs collected with it, is refused, nothing written."""
    runs, docs = tmp_path / "runs", tmp_path / "docs"
    order = ["mae", "mixedae"]
    (docs / "study" / "full").mkdir(parents=True)
    for r in RESULTS[:2]:  # mae seeds 0 and 1 at BUDGET
        (docs / "study" / "full" / f"mae_seed{r['seed']}.json").write_text(json.dumps(r))
    longer = dict(BUDGET, pretrain_samples=600000)
    _finished_run(runs, "mixedae", 0, dict(RESULTS[2], budget=longer))
    before = _tree(docs)
    with pytest.raises(SystemExit) as status:
        publish("full", runs, order, order, docs)
    err = capsys.readouterr().err
    assert status.value.code == 2 and len(err.splitlines()) == 1
    assert f"{runs / 'mixedae' / 'seed0' / 'result.json'} was measured with {longer}" in err
    assert "one table holds one budget" in err and "--docs DIR" in err
    assert _tree(docs) == before  # no summary, figure or report
    # the runs' own budgets differ (no summaries there yet)
    _finished_run(runs, "mixedae", 1, RESULTS[3])
    with pytest.raises(SystemExit) as status:
        publish("full", runs, order, order, tmp_path / "other")
    assert status.value.code == 2 and "one table holds one budget" in capsys.readouterr().err
    assert not (tmp_path / "other" / "study").exists()
    # a rerun of every summary's run at the new budget replaces them all: one budget again
    for seed in (0, 1):
        _finished_run(runs, "mae", seed, dict(RESULTS[seed], budget=longer))
    (runs / "mixedae" / "seed1" / "result.json").write_text(json.dumps(dict(RESULTS[3], budget=longer)))
    publish("full", runs, order, order, docs)
    assert "pretraining on 600000 training images" in (docs / "RESULTS.md").read_text()
    # and where the report is written
    report = tmp_path / "mixed.md"
    with pytest.raises(SystemExit) as status:
        write_report([RESULTS[0], dict(RESULTS[1], budget=longer)], report, tmp_path / "figures")
    err = capsys.readouterr().err
    assert status.value.code == 2 and f"mae seed 1 was measured with {longer}, mae seed 0 with {BUDGET}" in err
    assert not report.exists()


def test_a_result_cut_short_is_refused_in_one_line_and_nothing_is_collected(tmp_path, capsys):
    runs, docs = tmp_path / "runs", tmp_path / "docs"
    for r in RESULTS[:2]:
        _finished_run(runs, r["entry"], r["seed"], r)
    cut = runs / "mae" / "seed1" / "result.json"
    cut.write_text(cut.read_text()[:40])
    with pytest.raises(SystemExit) as status:
        publish("full", runs, ["mae"], ["mae"], docs)
    err = capsys.readouterr().err
    assert status.value.code == 2 and len(err.splitlines()) == 1
    assert f"{cut} is not readable JSON (a write cut short): delete it and the entry reruns from its checkpoints" in err
    assert not (docs / "study").exists() and not (docs / "RESULTS.md").exists()


def test_summary_of_seeds_in_any_order_is_their_mean_min_and_max():
    # seeds 0, 1, 2 score 87, 85, 86: the range is not the first and last run, the centre is the mean
    runs = [_result("mae", 0, 70.0, 78.0, 87.0), _result("mae", 1, 70.0, 78.0, 85.0),
            _result("mae", 2, 70.0, 78.0, 86.0)]
    assert summarize(runs)["mae"]["finetune_top1"] == ((87.0 + 85.0 + 86.0) / 3, 85.0, 87.0, 3)
    skewed = [_result("mae", s, 70.0, 78.0, v) for s, v in enumerate((80.0, 86.0, 86.0))]
    assert summarize(skewed)["mae"]["finetune_top1"][0] == pytest.approx((80.0 + 86.0 + 86.0) / 3)  # not the median 86


def test_the_topk_claim_is_judged_on_this_studys_runs_before_the_ablation_presets(tmp_path):
    # mixedae in both: rising TopK accuracy here, flat (at chance) in the ablation preset's runs
    rising = [{"step": i, "topk_acc": 0.3 + 0.01 * i} for i in range(20)]
    flat = [{"step": i, "topk_acc": 0.24 + 0.02 * (i % 2)} for i in range(20)]
    full_budget = dict(BUDGET, pretrain_samples=600000)
    full = [dict(_result("mixedae", 0, 71.0, 79.0, 90.0, metrics=rising), budget=full_budget)]
    ablation = [_result("mixedae", 0, 60.0, 70.0, 80.0, metrics=flat)]
    report = tmp_path / "RESULTS.md"
    write_report(full, report, tmp_path / "figures", ablation=ablation, expected=["mixedae"])
    topk = [line for line in report.read_text().splitlines() if "TopK sampling accuracy rises" in line]
    # first / last 5 of the rising curve: means 0.32 and 0.47 (test_claims: noise 0.020)
    assert len(topk) == 1 and "provisional, one seed: holds (0.320 -> 0.470" in topk[0]


class _Ax:
    """An Axes that records what each figure draws: plot's x and y, bar's heights and yerr."""

    def __init__(self, drawn):
        self.drawn = drawn

    def plot(self, x, y, **kwargs):
        self.drawn.append(("plot", kwargs.get("label"), list(x), list(y)))

    def bar(self, x, heights, width, yerr=None, **kwargs):
        self.drawn.append(("bar", kwargs.get("label"), list(heights), yerr))

    def __getattr__(self, name):  # set, legend, axhline, set_xticks: nothing the tests read
        return lambda *args, **kwargs: None


class _Fig:
    def tight_layout(self):
        pass

    def savefig(self, *args, **kwargs):
        pass


class _Plt:
    """pyplot without matplotlib (not part of the test install): plots.py's calls, recorded."""

    def __init__(self):
        self.drawn = []

    def subplots(self, *args, **kwargs):
        return _Fig(), ([_Ax(self.drawn), _Ax(self.drawn)] if args[:2] == (1, 2) else _Ax(self.drawn))

    def close(self, fig):
        pass


@pytest.fixture
def fake_plt(monkeypatch):
    from experiments.fashion_mnist import plots

    plt = _Plt()
    monkeypatch.setattr(plots, "pyplot", lambda: plt)  # _save closes each figure through pyplot()
    return plt


def test_loss_curves_draw_each_entrys_first_seed(tmp_path, fake_plt):
    from experiments.fashion_mnist import plots

    # seed 1 listed first; the figure draws seed 0, the lowest (plots.py: "Seed: the first")
    runs = [_result("mae", s, 70.0, 78.0, 85.0, loss_curve=[(1, 2.0 + s), (2, 1.0 + s)]) for s in (1, 0, 2)]
    assert plots.loss_curves(fake_plt, runs, tmp_path) == "loss_curves.png"
    assert fake_plt.drawn == [("plot", "MAE", [1, 2], [2.0, 1.0])]


def test_accuracy_bars_are_the_mean_with_the_seed_range_as_error_bars(tmp_path, fake_plt):
    from experiments.fashion_mnist import plots

    # (mean, min, max, seeds), the range lopsided about the mean: below 1, above 4
    summary = {"mae": {"label": "MAE", "knn_top1": (71.0, 70.0, 75.0, 2), "linear_probe_top1": (80.0, 78.0, 81.0, 2)}}
    assert plots.accuracy_bars(fake_plt, summary, tmp_path) == "accuracy.png"
    knn, linear, finetune = fake_plt.drawn
    assert knn == ("bar", "kNN", [71.0], [[71.0 - 70.0], [75.0 - 71.0]])  # yerr: [below], [above]
    assert linear == ("bar", "linear", [80.0], [[80.0 - 78.0], [81.0 - 80.0]])
    assert finetune == ("bar", "fine-tune", [0.0], [[0.0], [0.0]])  # not measured: no bar


def test_accuracy_against_pretraining_is_drawn_from_random_init_at_zero_images(tmp_path, fake_plt):
    from experiments.fashion_mnist import plots

    curves = epoch_curves(summarize(RESULTS))
    assert plots.accuracy_vs_images(fake_plt, curves, tmp_path) == "accuracy_vs_images.png"
    for (_, label, x, y), key in zip(fake_plt.drawn, ("knn_top1", "linear_probe_top1")):
        assert label == "MAE" and list(zip(x, y)) == curves["MAE"][key] and x[0] == 0


def test_an_adversarys_offsets_are_drawn_as_a_fraction_of_its_epsilon(tmp_path, fake_plt):
    from experiments.fashion_mnist import plots

    adv = [{"step": s, "adv_rpe_0": v} for s, v in ((1, 0.5), (2, 1.5))]
    runs = [_result("adpe", 0, 70.0, 78.0, 85.0, metrics=adv)]
    assert plots.over_training(fake_plt, runs, tmp_path, r"adv_.*", "offset / eps", "a.png", {"adpe": 2.0}) == "a.png"
    assert fake_plt.drawn == [("plot", "ADPE", [1, 2], [0.5 / 2.0, 1.5 / 2.0])]


def test_pretraining_minutes_are_the_runs_compute_before_its_wall_clock():
    # collect's pretrain_minutes (median step time x steps: 3.0) over the wall-clock (600 s = 10 min)
    both = _result("mae", 0, 70.0, 78.0, 85.0, pretrain_minutes=3.0, pretrain_seconds=600.0)
    assert "| MAE | 70.00 | 78.00 | 85.00 | 3.0 | 500 | 0.5 |" in table(summarize([both]))
    wall_clock = _result("mae", 0, 70.0, 78.0, 85.0, pretrain_seconds=600.0)  # a summary without the step times
    assert "| MAE | 70.00 | 78.00 | 85.00 | 10.0 | 500 | 0.5 |" in table(summarize([wall_clock]))


def test_the_adversarys_reach_is_a_share_of_the_adpe_runs_own_epsilon(tmp_path):
    adv = [{"step": 1, "adv_rpe_0": 0.5}]
    run = _result("adpe", 0, 70.0, 78.0, 85.0, metrics=adv, objective_config={"adv_eps": 2.0})
    report = tmp_path / "RESULTS.md"
    write_report([run], report, tmp_path / "figures", expected=["adpe"])
    assert "| largest logged offset at the end | 0.5 (eps 2): 0.250 of eps |" in report.read_text()  # 0.5 / 2


def test_the_full_report_judges_and_tables_the_reduced_budget_on_the_ablation_runs(tmp_path):
    full_budget = dict(BUDGET, pretrain_samples=600000)
    full = [dict(_result("mae", 0, 70.0, 78.0, 85.0), budget=full_budget),
            dict(_result("mixedae", 0, 71.0, 79.0, 88.0), budget=full_budget)]
    ablation = [_result("mae", 0, 60.0, 70.0, 80.0), _result("mixedae", 0, 61.0, 71.0, 81.0),
                _result("mixedae_no_segment", 0, 55.0, 65.0, 75.0)]
    report = tmp_path / "RESULTS.md"
    write_report(full, report, tmp_path / "figures", ablation=ablation, expected=["mae", "mixedae"])
    reduced = report.read_text().split("At a reduced budget")[1]
    # Table A4c on the ablation runs: 81 vs 75, one seed each: 2 SE of the difference on 10,000 images
    noise = 2 * ((81.0 * 19.0 + 75.0 * 25.0) / 10000) ** 0.5
    assert ("| MixedAE Table A4c: without segment embeddings is worse than MixedAE | fine-tune | provisional, one "
            f"seed: holds (81.00 vs 75.00: +6.00, test-set noise {noise:.2f}) |") in reduced
    # the table below those claims: the ablation preset's runs, not the full study's 85 / 88
    assert "| MAE | 60.00 | 70.00 | 80.00 |" in reduced and "| MIXEDAE | 61.00 | 71.00 | 81.00 |" in reduced
    assert "| MIXEDAE_NO_SEGMENT | 55.00 | 65.00 | 75.00 |" in reduced


def test_a_methods_figures_are_listed_under_it_not_under_a_method_whose_name_it_extends(tmp_path, monkeypatch):
    from experiments.fashion_mnist import plots

    monkeypatch.setattr(plots, "pyplot", lambda: None)  # only the methods' own PNGs
    (tmp_path / "mixedae_recon.png").write_bytes(b"mixedae")
    (tmp_path / "mixedae_naive_recon.png").write_bytes(b"mixedae_naive")  # also matches mixedae_*.png
    summary = summarize([_result("mixedae", 0, 71.0, 79.0, 90.0), _result("mixedae_naive", 0, 70.0, 78.0, 85.0)])
    captions = [line for line in figure_lines([], summary, tmp_path, "figures", summary) if line.startswith("**")]
    assert captions == ["**MIXEDAE: recon**", "**MIXEDAE_NAIVE: recon**"]


def test_energy_run_in_the_full_study_keeps_its_own_row_over_the_ablation_presets():
    # reduced_budget_rows stands in for an entry of AT_ABLATION_BUDGET only when the full study lacks it
    full = summarize([dict(_result("energy", 0, 66.0, 70.0, 75.0), budget=dict(BUDGET, pretrain_samples=600000))])
    reduced = summarize([_result("energy", 0, 40.0, 50.0, 60.0)])
    curves = full | reduced_budget_rows(full, reduced)  # as write_report draws them
    assert curves["energy"] == full["energy"] and curves["energy"]["knn_top1"] == (66.0, 66.0, 66.0, 1)
    assert reduced_budget_rows({}, reduced)["energy"]["knn_top1@3"] == (40.0, 40.0, 40.0, 1)


def test_each_reports_hand_written_discussion_sits_beside_it():
    for preset in ("full", "ablation", "quick"):
        where = paths(preset)
        assert where["discussion"] == where["report"].with_name(f"{where['report'].stem}_discussion.md")
    assert paths("ablation")["discussion"].name == "RESULTS_ablation_discussion.md"
    assert paths("full")["discussion"].is_file()  # the committed one


def test_report_main_lists_the_methods_then_the_controls(monkeypatch):
    from experiments.fashion_mnist import report
    from experiments.fashion_mnist.entries import ENTRIES

    orders = []
    monkeypatch.setattr(report, "publish", lambda preset, runs, order, *rest: orders.append(list(order)))
    report.main(["--preset", "ablation"])
    methods = [name for name, e in ENTRIES.items() if e.method]
    controls = [name for name, e in ENTRIES.items() if not e.method]
    assert controls == ["random_init", "supervised"]
    assert orders == [methods + controls]  # the table rows: every method in ENTRIES' order, the controls last
