"""docs/RESULTS.md from per-run results: mean and range over seeds, the claims judged against the
spread, each method's own figures copied (experiments/fashion_mnist/report.py)."""
import pytest

from experiments.fashion_mnist.report import judge, judge_restoration, summarize, write_report
from experiments.fashion_mnist.study import restoration


def _result(entry, seed, knn, linear, finetune, **extra):
    return {"entry": entry, "label": entry.upper(), "seed": seed, "knn_top1": knn, "linear_probe_top1": linear,
            "finetune_top1": finetune, "pretrain_seconds": 100.0 + seed, "pretrain_images_per_s": 500.0,
            "finetune_seconds": 10.0, "loss_curve": [(1, 1.0), (2, 0.5)], "device": "cpu", "torch_threads": 2,
            "budget": {"pretrain_samples": 20000, "finetune_epochs": 1, "finetune_samples": 10000}, **extra}


RESULTS = [
    _result("mae", 0, 70.0, 78.0, 85.0), _result("mae", 1, 72.0, 80.0, 87.0),
    _result("mixedae", 0, 71.0, 79.0, 90.0), _result("mixedae", 1, 71.0, 79.0, 91.0),  # fine-tune: clearly above
    _result("mixedae_naive", 0, 60.0, 70.0, 86.0), _result("mixedae_naive", 1, 60.0, 70.0, 86.5),  # inside MAE's range
    _result("mlomae", 0, 60.0, 70.0, 80.0, level2_head_top1=75.0), _result("mlomae", 1, 60.0, 72.0, 80.0),
    _result("energy", 0, 50.0, 60.0, 70.0, corrupted_l1=0.5, restored_l1=0.4),
    _result("energy", 1, 50.0, 60.0, 70.0, corrupted_l1=0.5, restored_l1=0.45),
]


def test_summary_means_and_ranges_over_seeds():
    s = summarize(RESULTS)
    assert list(s) == ["mae", "mixedae", "mixedae_naive", "mlomae", "energy"]  # first-seen order
    assert s["mae"]["knn_top1"] == (71.0, 70.0, 72.0, 2)
    assert s["mae"]["pretrain_seconds"] == (100.5, 100.0, 101.0, 2)
    assert s["mlomae"]["level2_head_top1"] == (75.0, 75.0, 75.0, 1)  # only where it was measured


def test_claims_are_judged_against_the_spread():
    s = summarize(RESULTS)
    assert judge(s, "mixedae", "mae", "finetune_top1") == "holds"  # 90.5 vs 86: gap 4.5 > spread 2
    assert judge(s, "mae", "mixedae_naive", "finetune_top1") == "within the spread"  # 86 vs 86.25
    assert judge(s, "mlomae", "mae", "linear_probe_top1") == "contradicted"  # 71 vs 79: reversed by 8 > 2
    assert judge(s, "adpe", "maeplus", "finetune_top1") == "not measured"
    one_seed = summarize([r for r in RESULTS if r["seed"] == 0])
    assert judge(one_seed, "mixedae", "mae", "finetune_top1") == "one seed only (90.00 vs 85.00): not judged"


def test_energy_restoration_from_the_last_logged_steps_and_its_verdict():
    rows = [{"corrupted_l1": 1.0, "loss_step1": 0.9, "loss_step2": 0.9, "loss": 0.9}] * 3 + \
        [{"corrupted_l1": 0.5, "loss_step1": 0.45, "loss_step2": 0.4, "loss": 0.425}] * 5
    assert restoration(rows) == {"corrupted_l1": 0.5, "restored_l1": 0.4}  # the last 5 rows, the last step
    energy = [r for r in RESULTS if r["entry"] == "energy"]
    assert judge_restoration(energy) == "holds (restored / corrupted smooth-L1 per seed: 0.800, 0.900)"
    worse = [dict(energy[0], restored_l1=0.55), energy[1]]
    assert judge_restoration(worse).startswith("contradicted")
    assert judge_restoration(RESULTS[:2]) == "not measured"


def test_report_table_claims_and_method_figures(tmp_path):
    out = tmp_path / "runs"
    vis = out / "mae" / "seed0" / "pretrain" / "vis"
    vis.mkdir(parents=True)
    for step in (100, 200):
        (vis / f"mae_reconstruction_step{step:08d}.png").write_bytes(f"png {step}".encode())
    report = tmp_path / "docs" / "RESULTS.md"
    discussion = tmp_path / "study_discussion.md"
    discussion.write_text("## Discussion\n\nWritten by hand.\n")
    write_report(RESULTS, out, report, discussion)
    text = report.read_text()
    assert "| MAE | 71.00 (70.00-72.00) | 79.00 (78.00-80.00) | 86.00 (85.00-87.00) | 100 (100-101) | 500 (500-500) |" \
        in text
    assert "| raw pixels (logistic regression) | - | 84.5 |" in text and "| raw pixels (5-NN) | 85.5 | - |" in text
    assert "| MixedAE paper: MixedAE improves on MAE | fine-tune | holds |" in text
    assert "| MLO-MAE paper: learned masks give better linear accuracy than MAE | linear | contradicted |" in text
    assert "seeds [0, 1]" in text and "device cpu" in text and "pretraining on 20000 of the 60k" in text
    assert "gradient descent on the learned energy restores corrupted images" in text and "| holds (" in text
    assert text.index("## Discussion\n\nWritten by hand.") > text.index("## The papers' claims")
    copied = tmp_path / "docs" / "figures" / "mae_mae_reconstruction.png"
    assert copied.read_bytes() == b"png 200"  # the last step's figure
    assert "![MAE: mae reconstruction](figures/mae_mae_reconstruction.png)" in text


def test_report_needs_no_plotting_library(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    write_report(RESULTS, tmp_path / "runs", tmp_path / "RESULTS.md")
    assert "loss_curves.png" not in (tmp_path / "RESULTS.md").read_text()


def test_plots_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")  # the `study` extra; not part of the test install
    from PIL import Image

    write_report(RESULTS, tmp_path / "runs", tmp_path / "RESULTS.md")
    for name in ("loss_curves.png", "accuracy.png"):
        assert Image.open(tmp_path / "figures" / name).size[0] > 500
        assert f"![{name}](figures/{name})" in (tmp_path / "RESULTS.md").read_text()
