"""The papers' claims judged from per-run results (experiments/fashion_mnist/claims.py)."""
import pytest

from experiments.fashion_mnist.claims import (
    ABLATION,
    MAIN,
    Comparison,
    adversary_reach,
    judge,
    restoration_by_steps,
    restoration_curve,
    sampling_noise,
    topk_rises,
)
from experiments.fashion_mnist.report import summarize


def _r(entry, seed, **metrics):
    return {"entry": entry, "label": entry, "seed": seed, **metrics}


TWO_SEEDS = [_r("mae", 0, finetune_top1=85.0), _r("mae", 1, finetune_top1=87.0),
             _r("mixedae", 0, finetune_top1=90.0), _r("mixedae", 1, finetune_top1=91.0),
             _r("naive", 0, finetune_top1=86.0), _r("naive", 1, finetune_top1=86.5),
             _r("mlomae", 0, finetune_top1=78.0), _r("mlomae", 1, finetune_top1=80.0)]


def test_comparisons_against_the_spread():
    s = summarize(TWO_SEEDS)
    assert judge(s, Comparison("", "mixedae", "mae", "finetune_top1")) == \
        "holds (90.50 vs 86.00: +4.50, spread 2.00)"  # gap 4.5 > spread 2
    assert judge(s, Comparison("", "mae", "naive", "finetune_top1")) == \
        "within the spread (86.00 vs 86.25: -0.25, spread 2.00)"
    assert judge(s, Comparison("", "mlomae", "mae", "finetune_top1")) == \
        "contradicted (79.00 vs 86.00: -7.00, spread 2.00)"  # reversed by more than the spread
    assert judge(s, Comparison("", "adpe", "mae", "finetune_top1")) == "not measured"
    # "about equal" holds inside the spread and fails outside it
    assert judge(s, Comparison("", "naive", "mae", "finetune_top1", equal=True)) == \
        "holds (86.25 vs 86.00: +0.25, spread 2.00)"
    assert judge(s, Comparison("", "mixedae", "mae", "finetune_top1", equal=True)) == \
        "contradicted (90.50 vs 86.00: +4.50, spread 2.00)"
    # and outside it below as well: |gap| is what counts, a negative gap is no closer to equal
    assert judge(s, Comparison("", "mae", "mixedae", "finetune_top1", equal=True)) == \
        "contradicted (86.00 vs 90.50: -4.50, spread 2.00)"
    one = summarize(TWO_SEEDS[::2])
    # one seed: judged provisionally against the test set's sampling noise (2 SE of the difference)
    assert sampling_noise(90.0, 85.0) == pytest.approx(0.9327, abs=1e-4)  # 2 sqrt((900 + 1275) / 10000)
    assert judge(one, Comparison("", "mixedae", "mae", "finetune_top1")) == \
        "provisional, one seed: holds (90.00 vs 85.00: +5.00, test-set noise 0.93)"
    assert judge(one, Comparison("", "mae", "mixedae", "finetune_top1")) == \
        "provisional, one seed: contradicted (85.00 vs 90.00: -5.00, test-set noise 0.93)"
    close = summarize([_r("mae", 0, finetune_top1=82.0), _r("mixedae", 0, finetune_top1=82.5)])
    assert judge(close, Comparison("", "mixedae", "mae", "finetune_top1")) == \
        "provisional, one seed: within the test-set noise (82.50 vs 82.00: +0.50, test-set noise 1.08)"
    assert judge(close, Comparison("", "mixedae", "mae", "finetune_top1", equal=True)) == \
        "provisional, one seed: holds (82.50 vs 82.00: +0.50, test-set noise 1.08)"


def test_every_claim_names_study_entries():
    from experiments.fashion_mnist.entries import ENTRIES

    for c in (*MAIN, *ABLATION):
        assert {c.better, c.worse} <= set(ENTRIES), c.claim


def test_restoration_curve_from_the_last_logged_steps():
    rows = [{"step": 1, "corrupted_l1": 1.0, "loss_step1": 0.9, "loss_step2": 0.8}] * 3 + \
        [{"step": 9, "corrupted_l1": 0.5, "loss_step1": 0.45, "loss_step2": 0.4}] * 5 + [{"step": 10}]
    assert restoration_curve(rows) == [0.5, 0.45, 0.4]
    assert restoration_curve([{"loss": 1.0}]) == []
    improving = [_r("energy", s, metrics=rows) for s in (0, 1)]
    assert restoration_by_steps(improving).startswith("holds (N=0: 0.5000 > N=1: 0.4500 > N=2: 0.4000;")
    flat = [{"corrupted_l1": 0.5, "loss_step1": 0.45, "loss_step2": 0.45}]  # the second step gains nothing
    assert restoration_by_steps([improving[0], _r("energy", 1, metrics=flat)]).startswith("contradicted")
    assert restoration_by_steps(improving[:1]).startswith("provisional, one seed: holds (N=0: 0.5000")
    assert restoration_by_steps([_r("energy", 0)]) == "not measured"


def test_topk_accuracy_rises_and_adversary_reach():
    rising = [{"step": i, "topk_acc": 0.3 + 0.01 * i} for i in range(20)]
    falling = [{"step": i, "topk_acc": 0.5 - 0.01 * i} for i in range(20)]
    # first / last 5: 0.30..0.34 and 0.45..0.49, sample variance 0.00025 each: noise 2 sqrt(0.0005 / 5) = 0.02
    assert topk_rises([_r("m", 0, metrics=rising), _r("m", 1, metrics=rising)]) == \
        "holds (0.320 -> 0.470, a rise beyond noise 0.020; 0.320 -> 0.470, a rise beyond noise 0.020)"
    assert topk_rises([_r("m", 0, metrics=rising), _r("m", 1, metrics=falling)]).startswith("contradicted")
    # at chance and flat: 0.24, 0.26 alternating; means 0.248 and 0.252, variance 1.2e-4 each:
    # noise 2 sqrt(2.4e-4 / 5) = 0.0139 > the gain 0.004
    flat = [{"step": i, "topk_acc": 0.24 + 0.02 * (i % 2)} for i in range(20)]
    at_chance = {**_r("m", 0, metrics=flat), "objective_config": {"mix_ratio": 0.25}}
    assert topk_rises([at_chance]) == ("provisional, one seed: contradicted (0.248 -> 0.252, no rise beyond noise "
                                       "0.014; chance about r = 0.25)")
    assert topk_rises([_r("m", 0, metrics=rising[:5])]) == "not measured"  # too few logged steps
    adv = [{"step": 1, "adv_rpe_0": 0.1, "adv_rpe_1": 0.2}, {"step": 2, "adv_rpe_0": 0.5, "adv_rpe_1": 2.0}]
    # the offset in its own units, then its share of eps (not "2 of eps")
    assert adversary_reach([_r("adpe", 0, metrics=adv)], 20.0) == "2 (eps 20): 0.100 of eps"
    assert adversary_reach([_r("adpe", 0, metrics=rising)], 20.0) == "not measured"


def test_a_gap_exactly_the_spread_is_within_it_in_both_directions():
    # mae 85/87 (mean 86, spread 2), mixedae 88/88 (mean 88): the gap 88 - 86 equals the spread 2
    s = summarize([_r("mae", 0, finetune_top1=85.0), _r("mae", 1, finetune_top1=87.0),
                   _r("mixedae", 0, finetune_top1=88.0), _r("mixedae", 1, finetune_top1=88.0)])
    assert judge(s, Comparison("", "mixedae", "mae", "finetune_top1")) == \
        "within the spread (88.00 vs 86.00: +2.00, spread 2.00)"  # not "holds": the gap must exceed it
    assert judge(s, Comparison("", "mae", "mixedae", "finetune_top1")) == \
        "within the spread (86.00 vs 88.00: -2.00, spread 2.00)"  # not "contradicted"
    # "about equal" holds up to and including the spread
    assert judge(s, Comparison("", "mixedae", "mae", "finetune_top1", equal=True)) == \
        "holds (88.00 vs 86.00: +2.00, spread 2.00)"


def test_one_seed_on_either_side_makes_the_verdict_provisional():
    # mae has one seed, mixedae two: no spread on mae's side, so the test set's noise is the margin
    s = summarize([_r("mae", 0, finetune_top1=85.0),
                   _r("mixedae", 0, finetune_top1=88.0), _r("mixedae", 1, finetune_top1=88.0)])
    noise = 2 * (88.0 * 12.0 / 10000 + 85.0 * 15.0 / 10000) ** 0.5
    verdict = judge(s, Comparison("", "mixedae", "mae", "finetune_top1"))
    assert verdict == f"provisional, one seed: holds (88.00 vs 85.00: +3.00, test-set noise {noise:.2f})"
    assert noise == pytest.approx(sampling_noise(88.0, 85.0))


def test_restoration_curve_orders_ten_or_more_steps_numerically():
    # loss_step10 sorts between loss_step1 and loss_step2 as text; the curve is N = 0, 1, 2, ..., 10
    row = {"corrupted_l1": 1.0, **{f"loss_step{n}": 1.0 / (n + 1) for n in range(1, 11)}}
    assert restoration_curve([row]) == [1.0 / (n + 1) for n in range(11)]


def test_topk_rises_is_judged_from_exactly_two_windows_of_logged_steps():
    # 10 logged steps fill the first and last window of 5 (no overlap): judged, not "not measured";
    # first 0.30..0.34 (mean 0.32), last 0.35..0.39 (mean 0.37), sample variance 0.00025 each:
    # noise 2 sqrt(0.0005 / 5) = 0.02 < the gain 0.05
    ten = [{"step": i, "topk_acc": 0.3 + 0.01 * i} for i in range(10)]
    assert topk_rises([_r("m", 0, metrics=ten)]) == \
        "provisional, one seed: holds (0.320 -> 0.370, a rise beyond noise 0.020)"
    assert topk_rises([_r("m", 0, metrics=ten[:9])]) == "not measured"  # the windows would overlap
