"""tools/gpu_check.py's `scale` phase in its CPU smoke mode (2 gloo ranks, the debug model, fp32,
a step per ZeRO stage, one torchrun launch per rank count) and what its JSON holds."""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

STAGES = ("zero0", "zero1", "zero2", "zero3")


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_scale")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "GPU_CHECK_COMMIT": ""}
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "scale", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("gpu_check_scale_*.json")
    (log,) = out.glob("gpu_check_scale_*.log")
    return json.loads(path.read_text()), log.read_text()


def test_the_record_says_device_dtype_shapes_commit_and_versions(record):
    r, _ = record
    assert r["phase"] == "scale" and r["mode"] == "smoke" and r["commit"] and "cores" in r["device"]
    assert r["versions"]["torch"] == torch.__version__ and "phase_error" not in r
    config = r["summary"]["config"]
    assert config == {"model": "vit_debug_patch4", "objective": "mae", "micro_batch": 8, "accumulation": 2,
                      "dtype": "fp32", "image_shape": [8, 1, 28, 28], "gloo_ranks": 2}


def test_every_stage_runs_on_one_and_two_ranks_through_the_bench_entry_point(record):
    r, log = record
    items = r["items"]
    for ranks in (1, 2):
        item = items[f"gpus{ranks}"]
        assert item["returncode"] == 0 and f"--nproc_per_node {ranks} -m tools.phases.scale_ranks" in log
        for stage in STAGES:
            run = item[stage]
            assert run["world_size"] == ranks and run["batch"] == {"micro": 8, "accum": 2, "world": ranks,
                                                                   "global": 16 * ranks}
            assert run["dtype"] == "float32" and run["loss"] > 0
            assert run["images_per_s_per_gpu"] == pytest.approx(run["images_per_s"] / ranks)
    for count in (4, 8):
        assert "not measured" in items[f"gpus{count}"]["skipped"]
    assert r["summary"]["multi_gpu"] == "measured"


def test_efficiency_is_per_gpu_throughput_against_one_rank_with_the_models_prediction_beside(record):
    r, _ = record
    items, summary = r["items"], r["summary"]
    assert set(summary["targets"]) == {"efficiency_8_gpus_of_a_node", "efficiency_4_nodes_by_the_model"}
    for stage in STAGES:
        one, two = (items[f"gpus{k}"][stage]["images_per_s_per_gpu"] for k in (1, 2))
        assert summary[stage]["images_per_s_per_gpu"] == {"1": one, "2": two}
        assert summary[stage]["efficiency"] == {"2": pytest.approx(two / one)}
        model = items["model"][stage]
        assert set(model["by_world_size"]) == {"8", "32"} and model["mfu"] == 0.4  # none measured on the CPU
        for world, engines in model["by_world_size"].items():
            assert set(engines) == {"before", "after"}
            assert 0 < engines["after"]["efficiency"] <= 1 and engines["after"]["sent_gb_per_rank"] > 0
            assert summary[stage]["model_efficiency_after"][world] == engines["after"]["efficiency"]


def test_the_gpu_counts_are_those_present():
    from tools.phases.scale import gpu_counts

    assert gpu_counts(1) == [1] and gpu_counts(2) == [1, 2] and gpu_counts(6) == [1, 2, 4]
    assert gpu_counts(16) == [1, 2, 4, 8]


def test_a_stage_s_ds_config_keeps_micro_batch_and_accumulation_and_lets_the_global_batch_follow_the_ranks(tmp_path):
    from tools.phases.scale import SHIPPED, stage_config

    ds = json.loads(stage_config(tmp_path, 3, 256, 2, SHIPPED).read_text())
    assert ds["train_micro_batch_size_per_gpu"] == 256 and ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"]["stage"] == 3 and "train_batch_size" not in ds and ds["bf16"]["enabled"]


def test_the_model_s_prediction_computes_at_the_mfu_measured_on_one_gpu_and_the_gpu_s_peak(tmp_path):
    """Compute faster (a higher MFU, a higher peak) leaves the same communication less to hide
    behind: the predicted efficiency on 4 nodes falls below the defaults' (40% of an H100's 989)."""
    from train.estimate.comm_model import Compute
    from tools.phases.scale import SHIPPED, predicted, stage_config

    argv = ["--model.name", "vit_base_patch16", "--data.source", "synthetic"]
    configs = [stage_config(tmp_path, 1, 256, 2, SHIPPED)]

    def zero1(measured, peak):
        row = predicted(argv, configs, measured, peak)["zero1"]
        return row, row["by_world_size"]["32"]["after"]["efficiency"]

    default, default_eff = zero1({}, None)
    assert (default["mfu"], default["peak_tflops"]) == (Compute.mfu, Compute.peak_tflops)
    measured, measured_eff = zero1({"zero1": {"mfu": 0.6}}, 2250.0)
    assert (measured["mfu"], measured["peak_tflops"]) == (0.6, 2250.0) and measured_eff < default_eff


def test_a_stage_whose_run_raises_is_reported_and_the_next_still_runs(tmp_path, monkeypatch, capsys):
    import train.bench
    import train.run.cli
    from tools.phases import scale_ranks

    ran, ended = [], []

    def bench(argv):
        ran.append(argv[argv.index("--out_dir") + 1])
        if argv[argv.index("--ds_config") + 1] == "a.json":
            raise ValueError("bad ds_config")

    monkeypatch.setattr(train.bench, "main", bench)
    monkeypatch.setattr(train.run.cli, "end_process_group", lambda: ended.append(1) or 1)  # one rank
    out = tmp_path / "o"
    assert scale_ranks.main([str(out), "a.json", "b.json", "--", "--steps", "1"]) == 1
    assert ran == [str(out / "a"), str(out / "b")]
    printed = capsys.readouterr().out
    assert "[scale_ranks] a.json failed" in printed and "ValueError: bad ds_config" in printed
    assert scale_ranks.main([str(out), "b.json", "--", "--steps", "1"]) == 0 and ended == [1]


def test_on_several_ranks_a_good_end_leaves_before_the_interpreters_teardown(monkeypatch):
    import train.bench
    import train.run.cli
    from tools.phases import scale_ranks

    left = []

    def leave(status):
        left.append(status)
        raise SystemExit(status)  # os._exit in the product: nothing after it runs

    monkeypatch.setattr(train.bench, "main", lambda argv: None)
    monkeypatch.setattr(train.run.cli, "end_process_group", lambda: 2)  # it ended a group of 2 ranks
    monkeypatch.setattr(train.run.cli, "leave_before_teardown", leave)
    with pytest.raises(SystemExit) as ended:
        scale_ranks.main(["o", "b.json", "--", "--steps", "1"])
    assert ended.value.code == 0 and left == [0]
    monkeypatch.setattr(train.run.cli, "end_process_group", lambda: 1)  # one rank: the interpreter's own exit
    assert scale_ranks.main(["o", "b.json", "--", "--steps", "1"]) == 0 and left == [0]


def test_with_one_gpu_the_phase_measures_it_and_says_multi_gpu_is_absent(tmp_path, monkeypatch):
    import types

    import tools.gpu_check
    import train.estimate.gpus
    from tools.gpu_check import Check
    from tools.phases import scale

    seen = {}

    def launch(check, gpus, configs, bench_args, timeout):
        return {"gpus": gpus, **{p.stem: {"images_per_s_per_gpu": 1000.0, "mfu": 0.5} for p in configs}}

    check = Check("scale", tmp_path, smoke=False, deadline=float("inf"), work=tmp_path / "work", log=tmp_path / "log")
    check.work.mkdir()
    check.cuda = True
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # after the Check: is_available() may ask it
    monkeypatch.setattr(scale, "launch", launch)
    monkeypatch.setattr(scale, "predicted", lambda argv, configs, measured, peak: seen.update(
        measured=measured, peak=peak) or {})
    monkeypatch.setattr(tools.gpu_check, "free_memory", lambda: None)  # its gc.collect: slow, nothing to free
    monkeypatch.setattr(train.estimate.gpus, "current_gpu", lambda: types.SimpleNamespace(peak_tflops=989.0))
    scale.run(check, types.SimpleNamespace())
    items, summary = check.record["items"], check.record["summary"]
    assert summary["multi_gpu"].startswith("absent: 1 GPU present")
    assert summary["config"]["gpus_present"] == 1 and items["gpus1"]["gpus"] == 1
    for k in (2, 4, 8):
        assert "1 GPU present" in items[f"gpus{k}"]["skipped"]
    for stage in STAGES:
        assert summary[stage]["images_per_s_per_gpu"] == {"1": 1000.0} and summary[stage]["efficiency"] == {}
    # the model computes at the MFU measured on the one GPU, at the GPU's peak
    assert seen == {"measured": items["gpus1"], "peak": 989.0} and seen["measured"]["zero1"]["mfu"] == 0.5


def test_on_the_gpu_every_rank_count_times_10_steps_after_3_warm_up_steps(tmp_path, monkeypatch):
    """The GPU branch's arguments to train/bench.py under each launch (the launch and the model's
    prediction stood in): the allocator, NCCL's communicators and cuBLAS's heuristics settle in
    the untimed steps."""
    import types

    import train.estimate.gpus
    from tools.gpu_check import Check
    from tools.phases import scale

    launched = []
    monkeypatch.setattr(scale, "launch", lambda check, gpus, configs, bench_args, timeout: launched.append(
        (gpus, bench_args)) or {"gpus": gpus})
    monkeypatch.setattr(scale, "predicted", lambda *a: {})
    monkeypatch.setattr(train.estimate.gpus, "current_gpu", lambda: types.SimpleNamespace(peak_tflops=989.0))
    check = Check("scale", tmp_path, smoke=False, deadline=float("inf"), work=tmp_path / "work", log=tmp_path / "log")
    check.work.mkdir()
    check.cuda = True
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # after the Check: torch may read it as CUDA present
    scale.run(check, types.SimpleNamespace())
    assert [g for g, _ in launched] == [1, 2]
    for _, args in launched:
        assert args[args.index("--warmup") + 1] == "3" and args[args.index("--steps") + 1] == "10"
