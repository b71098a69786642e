"""tools/phases/bench.py's GPU branch on this CPU, its measurements stood in (as
tests/tools/test_gpu_check_plan.py does for the other phases): what reaches the baseline, and the
summary's arithmetic (peak memory, the dry run's estimate against it, the largest micro-batch)."""
import json
import types
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def no_collection(monkeypatch):
    """free_memory's gc.collect after every item (~0.4 s each in the suite's heap) frees nothing here."""
    import tools.gpu_check
    from tools.phases import bench

    for module in (tools.gpu_check, bench):
        monkeypatch.setattr(module, "free_memory", lambda: None)


def _gpu_branch_check(tmp_path, phase: str = "bench"):
    from tools.gpu_check import Check

    check = Check(phase, tmp_path, smoke=False, deadline=float("inf"), work=tmp_path / "work", log=tmp_path / "log")
    check.work.mkdir(parents=True)
    check.cuda = True
    return check


def _micro(argv) -> int:
    return json.loads(Path(argv[argv.index("--ds_config") + 1]).read_text())["train_micro_batch_size_per_gpu"]


def test_bench_gpu_branch_sums_peak_memory_and_the_estimate_and_times_the_baseline_as_ours(tmp_path, monkeypatch):
    import train.estimate.dry_run
    import train.estimate.gpus
    from tools.phases import bench

    ours_runs = []

    def ours(check, argv, patch_torch_topk=False):
        i = len(ours_runs)
        ours_runs.append(argv)
        return {"images_per_s": 1000.0 + 100 * i, "tflops_per_gpu": 100.0 + i, "mfu": 0.30 + 0.01 * i,
                "peak_allocated_gib": 10.0 + i}

    baseline_calls = []

    def baseline(check, argv, steps, warmup, dtype):
        baseline_calls.append((steps, warmup, dtype))
        return {"images_per_s": 800.0}

    gpu = types.SimpleNamespace(name="H100")
    memory = types.SimpleNamespace(total=20 * 2**30, largest_micro=lambda g: 300)
    monkeypatch.setattr(bench, "our_bench", ours)
    monkeypatch.setattr(bench, "baseline_run", baseline)
    monkeypatch.setattr(bench, "attribution_items", lambda check: None)
    monkeypatch.setattr(bench, "largest_micro", lambda *a: {})
    monkeypatch.setattr(train.estimate.gpus, "current_gpu", lambda: gpu)
    monkeypatch.setattr(train.estimate.dry_run, "check", lambda cfg, world, g: types.SimpleNamespace(memory=memory))
    check = _gpu_branch_check(tmp_path)
    bench.run(check, types.SimpleNamespace())
    items, summary = check.record["items"], check.record["summary"]
    assert not [k for k, v in items.items() if "error" in v], items
    # the baseline runs ours' timed steps and warm-up (train/bench.py's --steps 15 --warmup 5)
    assert ours_runs[0][ours_runs[0].index("--steps") + 1:][:3] == ["15", "--warmup", "5"]
    assert [(s, w) for s, w, _ in baseline_calls] == [(15, 5)] * 5  # 2 rounds x 2 models, then fp16
    assert [d for *_, d in baseline_calls] == [torch.bfloat16] * 4 + [torch.float16]
    for key, first in (("vit_b", 0), ("vit_l", 2)):  # ours' rounds of each model: calls first, first + 1
        row = summary[key]
        rounds = [items[f"{key}_ours_r{r}"] for r in range(2)]
        assert row["ours_images_per_s"] == pytest.approx(1000.0 + 100 * first + 50)
        # MFU is TFLOP/s over the peak: the same mean over the rounds as the TFLOP/s beside it
        assert row["tflops_per_gpu"] == pytest.approx(100.0 + first + 0.5)
        assert row["mfu"] == pytest.approx(0.30 + 0.01 * first + 0.005)
        assert row["peak_gib"] == max(r["peak_allocated_gib"] for r in rounds) == 10.0 + first + 1
        assert row["estimate_gib"] == pytest.approx(20.0) and row["estimate_largest_micro"] == 300
        assert row["estimate_over_peak"] == pytest.approx(20.0 / row["peak_gib"])  # the dry run over what was measured
        assert row["ours_over_baseline"] == pytest.approx(row["ours_images_per_s"] / 800.0)
        checkpointed = items[f"{key}_ours_activation_checkpointing"]["images_per_s"]
        assert row["activation_checkpointing_over_eager"] == pytest.approx(checkpointed / row["ours_images_per_s"])


def test_the_baseline_trains_with_fused_adamw_on_the_gpu(tmp_path, monkeypatch):
    """The plain loop's fastest optimizer on the GPU (as the engine's): fused AdamW; on the CPU the default."""
    import tools.census
    import tools.mae_baseline
    from tools.phases import bench
    from tools.phases.common import CPU_DEBUG_DS, DEBUG_PRESET

    seen = []
    monkeypatch.setattr(tools.census, "baseline_model", lambda cfg, x, micro, dev: (torch.nn.Linear(1, 1), None))
    monkeypatch.setattr(tools.mae_baseline, "time_training",
                        lambda model, data, steps, warmup, dtype, dev, fused: seen.append((steps, warmup, fused)) or {})
    argv = ["--ds_config", str(CPU_DEBUG_DS), "--config", str(DEBUG_PRESET)]
    for cuda in (True, False):
        check = _gpu_branch_check(tmp_path / str(cuda))
        check.cuda = cuda
        out = bench.baseline_run(check, argv, 15, 5, torch.bfloat16)
        assert out["micro_batch"] == 8  # cpu_debug.json's
    assert seen == [(15, 5, True), (15, 5, None)]


def test_the_largest_micro_batch_is_the_one_the_memory_slope_predicts_to_fill_90_percent(tmp_path, monkeypatch):
    """Peak memory linear in the micro-batch (4 GiB + 0.1 GiB a sample) on an 80 GiB device: the
    micro-batch that fills 90% of it is (0.9 * 80 - 4) / 0.1, and that one is run."""
    from tools.phases import bench

    runs = []

    def ours(check, argv, patch_torch_topk=False):
        runs.append(_micro(argv))
        return {"peak_allocated_gib": 4.0 + 0.1 * _micro(argv), "images_per_s": 1.0, "mfu": 0.1}

    monkeypatch.setattr(bench, "our_bench", ours)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 2**30))
    summary = {}
    out = bench.largest_micro(_gpu_branch_check(tmp_path), "vit_b", "vit_base_patch16", 128, summary)
    expected = (0.9 * 80 - 4) / 0.1
    assert out["gib_per_sample"] == pytest.approx(0.1)
    assert abs(out["predicted_largest_micro"] - expected) <= 1 and runs == [128, 256, out["predicted_largest_micro"]]
    assert out["fits"] and out["peak_gib_at_predicted"] <= 0.9 * 80 + 1e-9
    assert summary["vit_b"]["measured_largest_micro"] == out["predicted_largest_micro"]
