"""train/estimate/step_flops.py counts an objective's step by phase on the meta device with torch's
FLOP formulas; tools/method_costs.py tabulates it for the shipped ViT-B presets."""
import pytest
import torch

from tools.method_costs import costs, markdown
from train.config.ds_config import resolve
from train.config.parsing import parse_args
from train.estimate.costs import profile_config
from train.estimate.step_flops import PHASES, FlopCount

DS = "ds_configs/vit_b_8xh100_bf16_zero1.json"


def test_the_counter_takes_torchs_formulas_forward_and_backward():
    lin = torch.nn.Linear(6, 5)
    x = torch.randn(4, 6, requires_grad=True)
    with FlopCount() as fwd:
        y = lin(x)
    with FlopCount() as bwd:
        y.sum().backward()
    assert fwd.flops == 2 * 4 * 6 * 5  # (4 x 6) @ (6 x 5)
    assert bwd.flops == 2 * fwd.flops  # the input's gradient and the weight's
    with FlopCount() as none:
        torch.relu(torch.randn(100)).sum()
    assert none.flops == 0  # elementwise work is not counted


@pytest.fixture(scope="module")
def rows():
    return costs(micro=4)


def test_mae_counts_what_the_dry_run_models(rows):
    """MAE's step by the counter against costs.py's convention (3 x the forward's matmuls): the
    same within 1%, and the backward twice the forward."""
    cfg = parse_args(["--ds_config", DS, "--model.name", "vit_base_patch16", "--data.source", "synthetic"])
    _, prof = profile_config(cfg, resolve(cfg, 1)[0], 4, fused_kernels=True)
    modelled = prof.train_flops / 4 / 1e9
    mae = rows["mae"]
    assert mae["total"] == pytest.approx(modelled, rel=0.01)
    assert mae["backward"] / mae["forward"] == pytest.approx(2.0, rel=0.02)
    assert mae["after_step"] == 0 and mae["over_baseline"] == 1.0


def test_each_method_costs_what_its_extra_passes_add(rows):
    # MixedAE: MAE's encoder and decoder plus the contrastive head and per-source decodings
    assert 1.0 < rows["mixedae"]["over_baseline"] < 1.03
    # AdPE's adversary learns from the step's own backward: no pass of its own
    assert rows["adpe"]["over_baseline"] == pytest.approx(1.0, abs=1e-3)
    # MLO-MAE: levels II and III run every step in the ViT-B preset, in the after-step hook
    assert rows["mlomae"]["after_step"] > 5 * rows["mae"]["total"]
    # energy: restoration steps in the forward, differentiated twice
    assert rows["energy"]["forward"] > 3 * rows["mae"]["forward"] and rows["energy"]["after_step"] == 0
    table = markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| adpe |" in table and "x maeplus |" in table


def test_a_methods_total_is_every_phase_and_its_ratio_is_to_its_baseline(rows):
    """The total adds the after-step hook (MLO-MAE's levels II and III) to the forward and the
    backward; the ratio divides by MAE's total, AdPE's by MAE+'s."""
    for method, row in rows.items():
        assert row["total"] == pytest.approx(sum(row[p] for p in PHASES)), method
        baseline = rows["maeplus" if method == "adpe" else "mae"]
        assert row["over_baseline"] == pytest.approx(row["total"] / sum(baseline[p] for p in PHASES)), method
    assert rows["mlomae"]["over_baseline"] > 5  # its hook is most of its step


def test_counting_more_steps_gives_the_flops_of_one_step_not_their_sum():
    """MAE's steps all cost the same: the average over 2 steps is the one step's count, per phase."""
    from conftest import CPU_DS, DEBUG_PRESET

    from train.estimate.step_flops import flops_by_step, step_flops

    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET)])
    one, two = step_flops(cfg, 2, steps=1), step_flops(cfg, 2, steps=2)
    assert one["forward"] > 0 and one["backward"] > 0
    assert two == pytest.approx(one)
    each = flops_by_step(cfg, 2, steps=2)
    assert two == pytest.approx({p: (each[0][p] + each[1][p]) / 2 for p in PHASES})
