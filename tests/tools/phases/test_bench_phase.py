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


def _largest(tmp_path, monkeypatch, ours, summary=None):
    from tools.phases import bench

    monkeypatch.setattr(bench, "our_bench", ours)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 2**30))
    summary = {} if summary is None else summary
    return bench.largest_micro(_gpu_branch_check(tmp_path), "vit_b", "vit_base_patch16", 128, summary), summary


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported"),
                                   RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")])
def test_a_predicted_micro_batch_that_runs_out_of_memory_is_recorded_as_not_fitting(tmp_path, monkeypatch, error):
    """However CUDA says it (the allocator's OutOfMemoryError, or a RuntimeError from a launch or
    cuBLAS), the predicted micro-batch that ran out of memory is no measured largest micro-batch."""
    def ours(check, argv, patch_torch_topk=False):
        if _micro(argv) > 256:
            raise error
        return {"peak_allocated_gib": 4.0 + 0.1 * _micro(argv), "images_per_s": 1.0, "mfu": 0.1}

    out, summary = _largest(tmp_path, monkeypatch, ours)
    assert out["predicted_largest_micro"] > 256 and out["fits"] is False and str(error)[:20] in out["oom"]
    assert summary["vit_b"]["measured_largest_micro"] is None


def test_an_error_other_than_out_of_memory_is_not_taken_for_one(tmp_path, monkeypatch):
    def ours(check, argv, patch_torch_topk=False):
        if _micro(argv) > 256:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"peak_allocated_gib": 4.0 + 0.1 * _micro(argv)}

    with pytest.raises(RuntimeError, match="illegal memory access"):
        _largest(tmp_path, monkeypatch, ours)


@pytest.mark.parametrize("peak_at_256", [7.0, 6.0])  # no growth with the batch, or less at 256 than at 128
def test_no_largest_micro_batch_is_predicted_or_run_without_a_positive_memory_slope(tmp_path, monkeypatch,
                                                                                   peak_at_256):
    runs = []

    def ours(check, argv, patch_torch_topk=False):
        runs.append(_micro(argv))
        return {"peak_allocated_gib": 7.0 if _micro(argv) == 128 else peak_at_256}

    out, summary = _largest(tmp_path, monkeypatch, ours)
    assert runs == [128, 256]  # nothing run at a micro-batch of zero, below, or at infinity
    assert out["predicted_largest_micro"] is None and "no memory per sample" in out["not_predicted"]
    assert summary["vit_b"]["measured_largest_micro"] is None


def test_peaks_are_each_run_s_own_whatever_earlier_items_left_allocated(tmp_path, monkeypatch):
    """The run at 256 starts with 5 GiB left allocated by earlier items: its peak, taken as it
    comes, would make the slope 0.14 GiB a sample instead of 0.1 and the prediction too small."""
    runs = []

    def ours(check, argv, patch_torch_topk=False):
        micro = _micro(argv)
        resident = {128: 0.0, 256: 5.0}.get(micro, 1.0)
        runs.append(micro)
        return {"peak_allocated_gib": resident + 4.0 + 0.1 * micro, "resident_gib_before": resident,
                "images_per_s": 1.0, "mfu": 0.1}

    out, summary = _largest(tmp_path, monkeypatch, ours)
    assert out["gib_per_sample"] == pytest.approx(0.1) and out["peak_gib_at"] == {128: 16.8, 256: pytest.approx(29.6)}
    assert abs(out["predicted_largest_micro"] - (0.9 * 80 - 4) / 0.1) <= 1
    assert out["peak_gib_at_predicted"] == pytest.approx(4.0 + 0.1 * out["predicted_largest_micro"])
    assert out["resident_gib_before"] == 1.0 and summary["vit_b"]["measured_largest_micro"] == runs[-1]


def test_the_summary_compares_the_dry_run_with_each_run_s_own_peak(tmp_path, monkeypatch):
    """3 GiB left allocated before each of ours' runs: the estimate is read against the 10 GiB the
    run itself took, not the 13 GiB allocated at its peak (both recorded)."""
    import train.estimate.dry_run
    import train.estimate.gpus
    from tools.phases import bench

    def ours(check, argv, patch_torch_topk=False):
        return {"images_per_s": 1000.0, "tflops_per_gpu": 100.0, "mfu": 0.3, "peak_allocated_gib": 13.0,
                "resident_gib_before": 3.0}

    memory = types.SimpleNamespace(total=20 * 2**30, largest_micro=lambda g: 300)
    monkeypatch.setattr(bench, "our_bench", ours)
    monkeypatch.setattr(bench, "baseline_run", lambda *a: {"images_per_s": 800.0})
    monkeypatch.setattr(bench, "attribution_items", lambda check: None)
    monkeypatch.setattr(bench, "largest_micro", lambda *a: {})
    monkeypatch.setattr(train.estimate.gpus, "current_gpu", lambda: types.SimpleNamespace(name="H100"))
    monkeypatch.setattr(train.estimate.dry_run, "check", lambda cfg, world, g: types.SimpleNamespace(memory=memory))
    check = _gpu_branch_check(tmp_path)
    bench.run(check, types.SimpleNamespace())
    row = check.record["summary"]["vit_b"]
    assert (row["peak_gib"], row["peak_allocated_gib"], row["resident_gib_before"]) == (10.0, 13.0, 3.0)
    assert row["estimate_over_peak"] == pytest.approx(2.0)


def test_the_compiled_step_s_attribution_warms_its_cuda_graphs_up_first(tmp_path, monkeypatch):
    """Every variant is profiled after its warm-up; the compiled one's (run.compile) is long enough
    for its CUDA graphs to replay (tools/profile_step.py COMPILED_WARMUP_STEPS)."""
    import tools.census
    import tools.profile_step
    from tools.phases import bench

    profiled = []

    def attribution(subject, steps, device, trace=None, compiled=False):
        profiled.append((subject, compiled))
        return {"steps": steps}

    def subject(name):  # each census subject stood in: its name and whether its config compiles the blocks
        return lambda cfg, *a, **k: (name, cfg.run.compile)

    monkeypatch.setattr(tools.census, "our_subject", lambda cfg, arch: (subject("ours")(cfg), {}))
    monkeypatch.setattr(tools.census, "baseline_subject", subject("baseline"))
    monkeypatch.setattr(tools.census, "deepspeed_subject", subject("deepspeed"))
    monkeypatch.setattr(tools.profile_step, "attribution", attribution)
    bench.attribution_items(_gpu_branch_check(tmp_path))
    assert profiled == [(("ours", False), False)] * 3 + [(("baseline", False), False), (("deepspeed", False), False),
                                                         (("ours", True), True)]
