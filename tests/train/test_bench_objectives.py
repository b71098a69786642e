import json
from types import SimpleNamespace

import pytest
import torch

from train.bench_objectives import main


def test_cpu_pairs_record_step_times_and_their_ratio(tmp_path):
    path = main(["--device", "cpu", "--dtype", "fp32", "--pairs", "mixedae", "adpe", "--model", "vit_mini_patch4",
                 "--batch", "4", "--iters", "1", "--warmup", "0", "--out_dir", str(tmp_path)])
    record = json.loads(path.read_text())
    assert record["dtype"] == "fp32" and set(record["e2e"]) == {"mixedae", "adpe"}
    mixed = record["e2e"]["mixedae"]
    assert mixed["images"] == [4, 3, 32, 32] and record["e2e"]["adpe"]["images"] == [4, 4, 3, 16, 16]
    ms = {k: v["ms"] for k, v in mixed["results"].items() if isinstance(v, dict)}
    assert set(ms) == {"mae", "mixedae"} and all(t > 0 for t in ms.values())
    assert mixed["results"]["mixedae_over_mae"] == pytest.approx(ms["mixedae"] / ms["mae"])


class _CountingObjective(torch.nn.Module):
    """One weight; counts the forwards and the after_optimizer_step calls the timing makes."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.steps = self.after = 0

    def forward(self, batch):
        self.steps += 1
        return {"loss": (self.w * batch["image"]).sum()}

    def after_optimizer_step(self, lr, batches):
        self.after += 1


def test_step_time_is_the_mean_over_the_timed_steps_of_whole_steps(monkeypatch):
    """Warm-up steps run untimed; each step ends with after_optimizer_step (AdPE's PGD step) as in the loop."""
    import train.bench_objectives as bench

    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=iter([0.0, 4.0]).__next__))  # 4 s around the timed
    objective = _CountingObjective()
    ms = bench.time_training_step(objective, torch.ones(2), torch.float32, torch.device("cpu"), iters=4, warmup=2)
    assert ms == pytest.approx(4.0 * 1000 / 4)
    assert objective.steps == objective.after == 2 + 4


def test_the_pairs_compare_the_method_with_its_baseline():
    """adpe: MAE+ with iRPE and no adversary against the same with AdPE's RPE-coord adversary; mixedae: MAE
    against MixedAE."""
    from train.bench_objectives import pair_runs

    runs, _ = pair_runs("adpe", "vit_mini_patch4", 2, "meta")
    assert {label: (name, cfg.rpe, cfg.adversary) for label, (name, cfg, _) in runs.items()} == {
        "maeplus_rpe": ("maeplus", True, "none"), "adpe_rpe_coord": ("maeplus", True, "rpe_coord")}
    runs, _ = pair_runs("mixedae", "vit_mini_patch4", 2, "meta")
    assert [name for name, _, _ in runs.values()] == ["mae", "mixedae"]
