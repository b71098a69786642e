"""entries.py: the reports' row order, the same whichever command writes the report."""
from experiments.fashion_mnist import report, study
from experiments.fashion_mnist.entries import ENTRIES, REPORT_ORDER, STUDY
from study_shards import fake_shards


def test_the_reports_list_every_entry_with_the_controls_last_in_the_designs_order():
    methods = [name for name in ENTRIES if ENTRIES[name].method]
    assert REPORT_ORDER == [*methods, "random_init", "supervised"]
    assert REPORT_ORDER[:len(STUDY) - 2] == list(STUDY)[:-2]  # the study's methods first, as it lists them


def test_study_and_report_publish_in_the_same_order(tmp_path, monkeypatch):
    """A report written by study.py at the end of its runs, and one rewritten later by report.py
    from the same summaries, have the same rows in the same order."""
    orders = {}
    monkeypatch.setattr(report, "publish", lambda preset, runs, order, *rest: orders.setdefault("report", order))
    report.main(["--preset", "ablation", "--docs", str(tmp_path)])
    shards = fake_shards(tmp_path, monkeypatch)
    monkeypatch.setattr(study, "check_figures", lambda docs: None)  # docs/ is not written: publish is stubbed
    monkeypatch.setattr(study, "run_entry", lambda name, seed, *args: {"entry": name, "seed": seed})
    monkeypatch.setattr(study, "publish", lambda preset, runs, order, *rest: orders.setdefault("study", order) and
                        tmp_path / "RESULTS.md")
    study.main(["--preset", "ablation", "--shards", str(shards), "--only", "mae", "--out", str(tmp_path / "runs")])
    assert orders["study"] == orders["report"] == REPORT_ORDER
