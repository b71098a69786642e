"""tools/gpu_check.py: every phase's CPU smoke mode in one call (the start-up is paid once), and the
JSON each phase writes; the plain-PyTorch MAE baseline is the same model as ours."""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

PHASES = ("compile", "tests", "bench", "methods", "loader", "study")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "GPU_CHECK_COMMIT": ""}
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", *PHASES, "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    jsons = {json.loads((out / f).read_text())["phase"]: json.loads((out / f).read_text())
             for f in files if f.endswith(".json")}
    return {"files": files, **jsons}


def test_one_json_per_phase_one_log_one_trace_at_most_eight_files(records):
    files = records["files"]
    assert len(files) == len(PHASES) + 2 <= 8  # what comes back from the device: 8 files at most
    assert sum(f.endswith(".log") for f in files) == 1 and sum(f.endswith("_trace.json.gz") for f in files) == 1
    for phase in PHASES:
        r = records[phase]
        assert r["mode"] == "smoke" and r["commit"] and r["versions"]["torch"] == torch.__version__
        assert "cores" in r["device"] and r["seconds"] > 0 and r["items"] and "phase_error" not in r
        assert not [k for k, v in r["items"].items() if "error" in v], r["items"]


def test_compile_phase_times_the_attention_kernels_and_the_step_and_skips_gpu_parts_with_reasons(records):
    from kernels.attention_choice import KERNELS

    items, summary = records["compile"]["items"], records["compile"]["summary"]
    for name in ("equality_bf16_micro64", "equality_fp32_micro32_accum2", "methods_compiled_micro128"):
        assert "GPU only" in items[name]["skipped"]
    entries = items["attention_choice"]["entries"]
    assert {(e["heads"], e["tokens"], e["head_dim"]) for e in entries} == {(12, 50, 64), (16, 197, 32)}
    for e in entries:
        assert e["capability"] == "cpu" and e["kernel"] in KERNELS and isinstance(e["ms"]["pytorch"], float)
    run = items["debug_eager_r0"]
    assert run["micro_batch"] == 8 and run["images_per_s"] == pytest.approx(8 / run["step_time_s"], rel=1e-6)
    assert summary["throughput"]["debug_eager"]["images_per_s"] == run["images_per_s"]
    assert summary["targets"]["compile_over_eager_vit_b_128"] == ">= 1.2"


def test_compile_phase_summary_takes_the_means_and_ratios_the_targets_name(tmp_path):
    """The GPU items' names as the phase gives them, with made-up results: the summary's arithmetic."""
    from tools.gpu_check import Check
    from tools.phases.compile import summarise

    check = Check("compile", tmp_path, smoke=True, deadline=0.0, work=tmp_path, log=tmp_path / "log")
    def bench(images_per_s, micro):
        return {"images_per_s": images_per_s, "step_time_s": micro / images_per_s, "mfu": images_per_s / 10000}
    check.record["items"] = {
        "vit_b_128_eager_r0": bench(3000, 128), "vit_b_128_compiled_r0": bench(4000, 128),
        "vit_b_128_compiled_r1": bench(4400, 128), "vit_b_128_eager_r1": bench(3200, 128),
        "vit_b_64_eager_r0": bench(1600, 64), "vit_b_64_compiled_r0": bench(3600, 64),
        "vit_b_512_compiled_r0": bench(5100, 512),
        "vit_l_128_eager_r0": {"skipped": "budget"}, "vit_l_128_compiled_r0": bench(2000, 128),
        "vit_l_128_float8_r0": bench(2500, 128),
        # the methods' items are train/bench.py records too (images/s, MFU): they stay out of the throughput rows
        "method_mixedae_compiled_r0": bench(128 / 0.033, 128), "method_mixedae_compiled_r1": {"step_time_s": 0.034},
        "method_maeplus_compiled_r0": {"step_time_s": 0.070}, "method_adpe_compiled_r0": {"step_time_s": 0.0707},
        "method_adpe_compiled_r1": {"error": "x"}}
    summarise(check)
    summary = check.record["summary"]
    b128 = summary["throughput"]["vit_b_128_compiled"]
    assert b128["images_per_s"] == 4200 and b128["rounds"] == 2 and b128["mfu"] == pytest.approx(0.42)
    assert set(summary["throughput"]) == {"vit_b_128_eager", "vit_b_128_compiled", "vit_b_64_eager",
                                          "vit_b_64_compiled", "vit_b_512_compiled", "vit_l_128_compiled",
                                          "vit_l_128_float8"}
    best = summary["vit_b_best"]
    assert best["run"] == "vit_b_512_compiled" and best["images_per_s"] == 5100 and best["mfu"] == pytest.approx(0.51)
    ratios = summary["ratios"]
    assert ratios["compile_over_eager_vit_b_128"] == pytest.approx(4200 / 3100)
    assert ratios["compile_over_eager_vit_b_64"] == pytest.approx(3600 / 1600)
    # step times are averaged as step times (not as the inverse of averaged images/s)
    assert ratios["step_64_over_step_128_compiled"] == pytest.approx((64 / 3600) / ((128 / 4000 + 128 / 4400) / 2))
    assert "compile_over_eager_vit_l_128" not in ratios  # its eager item was skipped
    assert ratios["float8_over_compiled_vit_l_128"] == pytest.approx(1.25)
    methods = summary["methods_compiled_micro128"]
    # MAE's compiled step at 128: the ViT-B compiled rounds (the same run), before and after the methods'
    mae = (128 / 4000 + 128 / 4400) / 2
    assert methods["step_time_s"]["mae"] == pytest.approx(mae)
    assert methods["step_time_s"]["mixedae"] == pytest.approx((0.033 + 0.034) / 2)  # the mean of its two rounds
    assert methods["mixedae_over_mae"] == pytest.approx(0.0335 / mae)  # MixedAE's over MAE's (target <= 1.03)
    # AdPE over MAE+ (the target: <= 1.015), from AdPE's one measured round (its second failed)
    assert methods["adpe_over_maeplus"] == pytest.approx(0.0707 / 0.070)


def test_tests_phase_runs_the_engine_and_resume_checks_and_skips_gpu_parts_with_reasons(records):
    items, summary = records["tests"]["items"], records["tests"]["summary"]
    for name in ("engine_fp16_zero2", "engine_bf16_zero1", "engine_bf16_zero2"):
        assert "CUDA" in items[name]["skipped"]
    engine = items["engine_fp32_cpu"]
    assert engine["steps"] == 6 and engine["finite"] and engine["ok"] == (engine["decreasing"] and engine["finite"])
    resume = items["resume_equality"]
    assert resume["compared_steps"] == 2 and resume["max_rel_loss_diff"] < 1e-6 and resume["ok"]
    pytest_gpu = items["pytest_gpu"]
    assert pytest_gpu["skipped"] > 0 and pytest_gpu["passed"] == pytest_gpu["failed"] == pytest_gpu["errors"] == 0
    assert pytest_gpu["skip_reasons"] == {"needs a CUDA GPU": pytest_gpu["skipped"]}
    assert summary["resume_equality"]["ok"] and summary["pytest_gpu"]["skipped"] == pytest_gpu["skipped"]


def test_bench_phase_alternates_ours_and_the_baseline_and_reports_their_ratio(records):
    items, row = records["bench"]["items"], records["bench"]["summary"]["debug"]
    order = list(items)
    assert order[:4] == ["debug_ours_r0", "debug_baseline_r0", "debug_ours_r1", "debug_baseline_r1"]
    for name in order[:4]:
        r = items[name]
        assert r["images_per_s"] > 0 and r["micro_batch"] == 8
        assert r["images_per_s"] == pytest.approx(8 / r["step_time_s"], rel=1e-6)
    assert row["ours_images_per_s"] == pytest.approx((items["debug_ours_r0"]["images_per_s"]
                                                      + items["debug_ours_r1"]["images_per_s"]) / 2)
    assert row["ours_over_baseline"] == pytest.approx(row["ours_images_per_s"] / row["baseline_images_per_s"])
    assert items["debug_ours_activation_checkpointing"]["images_per_s"] > 0
    assert row["activation_checkpointing_over_eager"] == pytest.approx(
        items["debug_ours_activation_checkpointing"]["images_per_s"] / row["ours_images_per_s"])
    assert "CUDA" in items["debug_largest_micro"]["skipped"] and "GPU" in items["debug_ours_compile"]["skipped"]
    assert items["debug_baseline_r0"]["dtype"] == "float32" and row["tflops_per_gpu"] > 0


def test_bench_phase_attributes_each_variant_of_the_step(records):
    items, rows = records["bench"]["items"], records["bench"]["summary"]["attribution"]
    assert set(rows) == {"ours_micro8", "baseline_micro8"}
    for name in rows:
        r = items[f"attribution_{name}"]
        assert r["steps"] == 2 and r["micro_batch"] == 8 and r["kernels_per_step"] > 100
        assert 0 < r["host_ms_per_step"] <= r["wall_ms_per_step"] * 1.01
        assert set(r["host_ms_per_phase"]) >= {"data", "forward", "backward", "step"}
        assert 0 < len(r["top_kernels"]) <= 15 and r["top_kernels"][0]["ms"] >= r["top_kernels"][-1]["ms"]
        assert r["device_busy_fraction"] is None  # measured on a GPU only
    trace = items["attribution_ours_micro8"]["trace"]
    assert trace["written"] and trace["file"] in records["files"] and trace["bytes"] < 16 * 2**20
    assert "GPU only" in items["attribution_deepspeed_old_defaults_micro8"]["skipped"]


def test_methods_phase_reports_every_step_ratio_from_its_own_timings(records):
    r = records["methods"]
    steps, ratios = r["summary"]["step_time_s"], r["summary"]["step_ratios"]
    assert set(steps) == {"mae", "mixedae", "mixedae_torch_topk", "maeplus", "adpe", "mlomae", "energy"}
    assert {r["items"][f"{m}_r0"]["objective"] for m in steps} == {"mae", "mixedae", "maeplus", "mlomae", "energy"}
    for name, value in ratios.items():
        method, ref = name.split("_over_")
        assert value == pytest.approx(steps[method] / steps[ref])
    assert {"mixedae_over_mae", "adpe_over_maeplus", "mlomae_over_mae", "energy_over_mae",
            "mixedae_torch_topk_over_mixedae"} <= set(ratios)
    kernels = r["summary"]["kernels_fp32"]["2,2,17,16"]
    assert kernels["topk_torch_over_dense"] > 0 and "topk_fused_over_dense" not in kernels  # no Triton on CPU
    # where each method's step goes, by phase, beside its counted arithmetic (tools/method_time.py)
    times = r["summary"]["phase_times"]
    assert set(times) == set(steps) - {"mixedae_torch_topk"} and times["mae"]["over_mae_measured"] == 1.0
    assert times["mlomae"]["ms"]["after_step"] > 0 and times["mae"]["over_mae_counted"] == 1.0
    assert r["items"]["phase_times"]["markdown"].count("\n") == len(times) + 1


def test_loader_phase_makes_jpeg_shards_and_times_every_decode_path(records):
    items, summary = records["loader"]["items"], records["loader"]["summary"]
    assert items["make_shards"]["images"] == 16 and items["make_shards"]["shards"] == 4
    for decode in ("cpu", "cpu_draft", "nvjpeg"):
        assert summary[f"{decode}_images_per_s"] > 0
    assert items["decode_cpu_draft"]["decode"] == "cpu_draft" and items["decode_cpu"]["num_workers"] == 2
    assert items["decode_nvjpeg"]["batch_shape"] == [8, 3, 224, 224] and "smoke" in items["decode_nvjpeg"]["decoder"]
    # end to end: the debug model trained from the shards and from synthetic images, alternating
    assert [k for k in items if k.startswith("end_to_end")] == [
        "end_to_end_synthetic_r0", "end_to_end_shards_r0", "end_to_end_shards_r1", "end_to_end_synthetic_r1"]
    row = summary["end_to_end"]
    assert row["workers"] == 2 and row["decode"] == "cpu"
    assert row["shards_over_synthetic"] == pytest.approx(row["shards_images_per_s"] / row["synthetic_images_per_s"])


def test_study_phase_writes_shards_runs_an_entry_and_summarises_it(records):
    r = records["study"]
    assert r["items"]["shards"]["train"] == 160
    entry = r["summary"]["entries"]["random_init"]
    assert 0 <= entry["knn_top1"] <= 100 and 0 <= entry["linear_probe_top1"] <= 100
    assert 0 <= entry["finetune_top1"] <= 100
    assert r["items"]["random_init"]["budget"]["pretrain_samples"] == r["summary"]["pretrain_samples"] == 128


def test_without_cuda_a_gpu_phase_refuses_to_start(monkeypatch, tmp_path, capsys):
    from tools.gpu_check import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--smoke" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_without_out_the_records_go_to_runs_and_with_record_to_benchmarks_results(monkeypatch, tmp_path):
    """A smoke call must not land in the committed benchmarks/results/: only --record writes there
    (the repository stood in by tmp_path, the phase by a no-op)."""
    from tools import gpu_check
    from tools.phases import loader

    monkeypatch.setattr(gpu_check, "REPO", tmp_path)
    monkeypatch.setattr(gpu_check, "cutlass_dsl_on_path", lambda: None)
    monkeypatch.setattr(loader, "run", lambda check, a: None)
    monkeypatch.setenv("GPU_CHECK_COMMIT", "abc1234")
    [path] = gpu_check.main(["loader", "--smoke"])
    assert path.parent == tmp_path / "runs" / "gpu_check" and path.is_file()
    [path] = gpu_check.main(["loader", "--smoke", "--record"])
    assert path.parent == tmp_path / "benchmarks" / "results" and path.is_file()


def test_the_call_puts_the_cutlass_dsl_on_the_path_before_any_phase(monkeypatch, tmp_path, capsys):
    """A `pip --target` install of flash-attn-4 imports only once its DSL folder is on the path
    (tests/tools/test_gpu_check_cutlass_path.py); the phases and their subprocesses need it first."""
    from tools import gpu_check
    from tools.phases import loader

    calls = []
    monkeypatch.setattr(gpu_check, "cutlass_dsl_on_path", lambda: calls.append("dsl") or tmp_path / "dsl_packages")
    monkeypatch.setattr(loader, "run", lambda check, a: calls.append("loader"))
    monkeypatch.setenv("GPU_CHECK_COMMIT", "abc1234")
    gpu_check.main(["loader", "--smoke", "--out", str(tmp_path)])
    assert calls == ["dsl", "loader"]
    assert f"put on the path from {tmp_path / 'dsl_packages'}" in capsys.readouterr().out


def test_a_command_the_kit_runs_does_not_inherit_an_in_process_run_s_process_group(monkeypatch, tmp_path):
    """An in-process train/bench.py run leaves RANK ... MASTER_PORT set; a child (`pytest -m gpu`)
    inheriting them would join that world of one and bind its port."""
    import time

    from conftest import PROCESS_GROUP_ENV

    from tools.gpu_check import Check

    for key in PROCESS_GROUP_ENV:
        monkeypatch.setenv(key, "1")
    check = Check("tests", tmp_path, smoke=True, deadline=time.monotonic() + 60, work=tmp_path, log=tmp_path / "log")
    names = ", ".join(repr(k) for k in PROCESS_GROUP_ENV)
    proc = check.run([sys.executable, "-c", f"import os; print(sorted(set(({names})) & set(os.environ)))"], 30)
    assert proc.returncode == 0 and check.log.read_text().splitlines()[-1] == "[]"


def test_the_baseline_is_the_same_model_as_ours_and_learns():
    from model.objectives import build_objective
    from model.objectives.mae import MAEConfig
    from model.registry import create_model
    from tools.mae_baseline import BaselineMAE, optimizer

    ours = build_objective("mae", create_model("vit_debug_patch4", in_chans=1),
                           MAEConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2))
    torch.manual_seed(0)
    base = BaselineMAE(28, 4, 1, 32, 2, 2, 32, 1, 2)
    assert sum(p.numel() for p in base.parameters()) == sum(p.numel() for p in ours.parameters() if p.requires_grad)
    images = torch.randn(4, 1, 28, 28)
    opt = optimizer(base, lr=1e-2)
    losses = []
    for _ in range(15):
        torch.manual_seed(1)  # the same masking every step: the loss on one batch must fall
        loss = base(images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
