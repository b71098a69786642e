"""tools/gpu_check.py's plan for one call on a GPU: each phase's share of the call's budget, items
skipped once they no longer fit, each item on disk as soon as it is measured, the phases' GPU
branches run in their order on this CPU (the measurements stood in), refusals before any phase,
and the commit the records name. Whether docs/GPU.md's one call reaches every target:
test_gpu_check_one_call.py."""
import json
import sys
from pathlib import Path

import pytest
from compile_stand_ins import compile_stand_ins


def test_a_phase_can_be_given_its_share_of_the_call(tmp_path, monkeypatch):
    """PHASE:SECONDS caps one phase inside --budget_s, so one call runs several phases each with its share."""
    import argparse

    from tools import gpu_check
    from tools.phases import loader, methods

    assert gpu_check.phase_and_cap("methods") == ("methods", None)
    assert gpu_check.phase_and_cap("methods:150") == ("methods", 150.0)
    for bad, said in (("method:10", "unknown phase 'method'"), ("loader:ten", "must be seconds"),
                      ("loader:0", "must be > 0")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            gpu_check.phase_and_cap(bad)
    left = {}
    monkeypatch.setattr(methods, "run", lambda check, a: left.setdefault("methods", check.remaining()))
    monkeypatch.setattr(loader, "run", lambda check, a: left.setdefault("loader", check.remaining()))
    gpu_check.main(["methods:30", "loader", "--smoke", "--budget_s", "300", "--out", str(tmp_path)])
    assert 0 < left["methods"] <= 30 < left["loader"] <= 300  # capped; the rest of the call's budget


def _gpu_branch_check(tmp_path, phase: str):
    """A Check that takes the phase's GPU branch (check.cuda) on this CPU, with a budget that never
    runs out: with the measurements stood in, what runs is the phase's own order, names and sums."""
    from tools.gpu_check import Check

    check = Check(phase, tmp_path, smoke=False, deadline=float("inf"), work=tmp_path / "work", log=tmp_path / "log")
    check.work.mkdir()
    check.cuda = True
    return check


def test_methods_phase_gpu_branch_runs_its_items_in_order_and_sums_them(tmp_path, monkeypatch):
    """The GPU branch is what a GPU run executes: its order, its arguments (micro-batch 128,
    the ViT-B presets) and its summary, with train/bench.py, kernels/bench.py and
    tools/method_time.py stood in by made-up timings."""
    import json
    import types

    import kernels.bench
    import tools.gpu_check
    from tools import method_time
    from tools.phases import methods

    seen = []
    step = {"mae": 0.040, "mixedae": 0.042, "maeplus": 0.090, "mlomae": 0.400, "energy": 0.300}

    def bench(check, argv, torch_topk=False):
        ds = json.loads(open(argv[argv.index("--ds_config") + 1]).read())
        name = next((m for m in ("mixedae", "mlomae", "energy") if any(f"{m}/" in a for a in argv)), None)
        name = name or ("maeplus" if any("maeplus/" in a for a in argv) else "mae")
        adpe = any("rpe_coord" in a for a in argv)
        # 3 untimed steps (the allocator, cuBLAS's heuristics, Triton's autotuning), then 10 timed
        assert (argv[argv.index("--warmup") + 1], argv[argv.index("--steps") + 1]) == ("3", "10")
        seen.append((name, ds["train_micro_batch_size_per_gpu"], torch_topk))
        return {"step_time_s": step[name] * (1.01 if adpe else 1.0) * (2 if torch_topk else 1), "objective": name}

    def kbench(argv):
        path = tmp_path / f"kernels_{argv[argv.index('--dtype') + 1]}.json"
        shape = {"results": {"dense_sdpa": {"ms": 0.4}, "topk_fused": {"ms": 2.4}, "topk_masked_sdpa": {"ms": 1.9}},
                 "ratios": {"topk_fused_over_dense": 6.0, "topk_masked_sdpa_speedup_vs_topk_fused": 2.4 / 1.9}}
        path.write_text(json.dumps({"dtype": "bf16", "triton": "3.6", "shapes": {"vit_b": shape}}))
        return str(path)

    def times(argv):
        assert argv[:2] == ["--micro", "64"] and "--device" not in argv  # the GPU's default device
        ms = {"forward": 10.0, "backward": 20.0, "optimizer": 2.0, "after_step": 0.0}
        rows = {m: {"ms": dict(ms, after_step=300.0 if m == "mlomae" else 0.0), "micro_batch": 64,
                    "step_ms": 32.0 + (300.0 if m == "mlomae" else 0.0),
                    "gflop_per_image": {"forward": 20.0, "backward": 40.0, "after_step": 390.0 if m == "mlomae" else 0.0},
                    "step_gflop_per_image": 450.0 if m == "mlomae" else 60.0}
                for m in argv[argv.index("--methods") + 1:]}
        return method_time.with_floors(rows, 989.0)

    monkeypatch.setattr(methods, "our_bench", bench)
    monkeypatch.setattr(kernels.bench, "main", kbench)
    monkeypatch.setattr(method_time, "main", times)
    for module in (tools.gpu_check, methods):  # its gc.collect per item: nothing to free here
        monkeypatch.setattr(module, "free_memory", lambda: None)
    check = _gpu_branch_check(tmp_path, "methods")
    methods.run(check, types.SimpleNamespace())
    items, summary = check.record["items"], check.record["summary"]
    assert not [k for k, v in items.items() if "error" in v or "skipped" in v], items
    # the targets' methods and kernels first, each pair of rounds reversed
    targets, others = ["mae", "mixedae", "maeplus", "adpe"], ["mixedae_torch_topk", "mlomae", "energy"]
    assert list(items) == ([f"{m}_r0" for m in targets] + ["kernels_bf16"] + [f"{m}_r1" for m in targets[::-1]]
                           + ["phase_times"] + [f"{m}_r0" for m in others] + [f"{m}_r1" for m in others[::-1]]
                           + ["kernels_fp16"])
    assert {micro for _, micro, _ in seen} == {128} and sum(t for _, _, t in seen) == 2  # the composition: one per round
    ratios = summary["step_ratios"]
    assert ratios["mixedae_over_mae"] == pytest.approx(1.05) and ratios["adpe_over_maeplus"] == pytest.approx(1.01)
    assert ratios["mixedae_torch_topk_over_mixedae"] == pytest.approx(2.0)
    assert summary["kernels_bf16"]["vit_b"]["topk_masked_sdpa_speedup_vs_topk_fused"] == pytest.approx(2.4 / 1.9)
    assert set(summary["phase_times"]) == set(method_time.METHODS)
    assert summary["phase_times"]["mlomae"]["over_mae_measured"] == pytest.approx(332 / 32)
    assert summary["phase_times"]["mlomae"]["over_mae_counted"] == pytest.approx(7.5)


def test_compile_phase_gpu_branch_runs_every_item_in_its_order(tmp_path, monkeypatch):
    """The compile phase's GPU items, in the order a short call should learn them, with the
    measurements stood in: names, arguments (micro-batches, models, compile and float8 switches,
    warm-up) and the summary."""
    import types

    import tools.gpu_check
    from tools.phases import compile as phase

    monkeypatch.setattr(tools.gpu_check, "free_memory", lambda: None)  # its gc.collect per item: nothing to free
    runs = []
    compile_stand_ins(monkeypatch, runs, tmp_path / "attention_choices.json")
    check = _gpu_branch_check(tmp_path, "compile")
    phase.run(check, types.SimpleNamespace())
    items, summary = check.record["items"], check.record["summary"]
    assert not [k for k, v in items.items() if "error" in v or "skipped" in v], items
    names = list(items)
    # the targets first: ViT-B at 128 eager then compiled, the methods compiled, the second round reversed
    assert names[:7] == ["vit_b_128_eager_r0", "vit_b_128_compiled_r0", "method_mixedae_compiled_r0",
                         "method_maeplus_compiled_r0", "method_adpe_compiled_r0", "vit_b_128_compiled_r1",
                         "vit_b_128_eager_r1"]
    assert names[7:10] == ["method_adpe_compiled_r1", "method_maeplus_compiled_r1", "method_mixedae_compiled_r1"]
    assert names.index("vit_b_64_compiled_r0") < names.index("attention_choice") < names.index("vit_b_512_eager_r0")
    assert names[-1] == "float8_curves_vit_l_micro64"
    assert {(m, c) for m, c, *_ in runs} >= {(128, False), (128, True), (64, True), (512, True)}
    # every train/bench.py run: 5 untimed steps (a compiled step's CUDA graphs replay from the third), 15 timed
    assert {(w, n) for *_, w, n in runs} == {("5", "15")}
    assert sum(f for _, _, f, *_ in runs) == 1 and items["attention_choice"]["entries"][0]["kernel"] == "cudnn"
    assert summary["ratios"]["compile_over_eager_vit_b_128"] == pytest.approx(1.3)
    assert summary["ratios"]["float8_over_compiled_vit_l_128"] == pytest.approx(1.2)
    assert summary["methods_compiled_micro128"]["mixedae_over_mae"] == pytest.approx(1.02)
    assert summary["equality_bf16_micro64"]["equal"] and summary["float8_curves_vit_l_micro64"]["within_bf16_noise"]
    # the table this call wrote, beside the records
    copy = tmp_path / items["attention_choice"]["table_copy"]
    assert copy.name.startswith("attention_choices_gpu_check_compile_") and "by this call" in copy.read_text()


@pytest.mark.parametrize("fate", ["failed", "skipped"])
def test_a_table_this_call_did_not_write_is_not_copied_beside_its_records(tmp_path, monkeypatch, fate):
    """kernels/attention_choices.json is always there (committed): when the item that measures it
    failed or was not run, the file is someone else's table, and no copy says it is this call's."""
    import time

    from kernels import attention_choice
    from tools import choose_attention
    from tools.phases import compile as phase

    table = tmp_path / "table" / "attention_choices.json"
    table.parent.mkdir()
    table.write_text('[{"written": "elsewhere"}]')
    compile_stand_ins(monkeypatch, [], None)
    monkeypatch.setattr(attention_choice, "TABLE", table)

    def refused(argv):
        raise RuntimeError("no SDPA kernel measured")

    monkeypatch.setattr(choose_attention, "main", refused)
    check = _gpu_branch_check(tmp_path, "compile")
    if fate == "skipped":
        check.deadline = time.monotonic() + 1  # nothing fits
    phase.attention_table(check)
    item = check.record["items"]["attention_choice"]
    assert ("skipped" in item, "error" in item) == (fate == "skipped", fate == "failed")
    assert not list(tmp_path.glob("attention_choices_*")) and "table_copy" not in item


def test_study_phase_gpu_branch_runs_one_entry_per_item_and_summarises_the_entries(tmp_path, monkeypatch):
    """Each study entry its own item (the budget can stop between them), summarised without the
    shards item; the study's runs stood in."""
    import types

    import data.write_shards
    import experiments.fashion_mnist.study as study_module
    import tools.gpu_check
    from tools.phases import study

    def shards(argv):
        Path(argv[1]).mkdir()
        Path(argv[1], "train.json").write_text(json.dumps({"num_samples": 60000}))

    def entry(argv):
        e = argv[argv.index("--only") + 1]
        return [{"entry": e, "knn_top1": float(len(e)), "loss_curve": [2.0, 1.5, 1.0]}]

    monkeypatch.setattr(data.write_shards, "main", shards)
    monkeypatch.setattr(study_module, "main", entry)
    monkeypatch.setattr(tools.gpu_check, "free_memory", lambda: None)  # its gc.collect per item: slow, nothing to free
    (tmp_path / "fmnist").mkdir()
    (tmp_path / "fmnist" / "train-images-idx3-ubyte.gz").write_bytes(b"")
    check = _gpu_branch_check(tmp_path, "study")
    study.run(check, types.SimpleNamespace(fashion_mnist=tmp_path / "fmnist", study_pretrain_samples=60000))
    entries = ["mae", "mixedae", "maeplus", "adpe", "mlomae", "energy", "random_init"]
    items, summary = check.record["items"], check.record["summary"]
    assert list(items) == ["shards", *entries] and items["shards"]["train"] == 60000
    assert items["mae"]["loss_first_last"] == [2.0, 1.0] and "loss_curve" not in items["mae"]
    assert list(summary["entries"]) == entries and summary["pretrain_samples"] == 60000
    assert all(summary["entries"][e]["knn_top1"] == len(e) for e in entries)


def test_an_entry_point_s_refusal_inside_a_phase_is_recorded_and_the_next_phase_runs(tmp_path, monkeypatch):
    """A refusal exits (SystemExit), which passed the handlers of Exception and ended the call:
    the later phases never ran and the phase's JSON held no word of it."""
    from tools import gpu_check
    from tools.phases import loader, methods

    def refusing(check, a):
        check.item("refused_item", 0, lambda: sys.exit("error: --pretrain_samples 200: give whole epochs"))
        raise SystemExit(2)

    monkeypatch.setattr(methods, "run", refusing)
    monkeypatch.setattr(loader, "run", lambda check, a: check.item("after", 0, lambda: {"ran": True}))
    paths = gpu_check.main(["methods", "loader", "--smoke", "--budget_s", "60", "--out", str(tmp_path)])
    first, second = (json.loads(p.read_text()) for p in paths)
    assert first["items"]["refused_item"]["error"] == "SystemExit: error: --pretrain_samples 200: give whole epochs"
    assert "SystemExit: 2" in first["phase_error"]
    assert second["items"]["after"]["ran"] is True


@pytest.mark.parametrize("argv, says", [
    (["methods:30", "methods:30"], "a phase is named twice (methods methods)"),
    (["study", "--study_pretrain_samples", "0"], "--study_pretrain_samples must be >= 1, got 0"),
    # --out beside --record: which folder was meant (the committed records or not) is not guessed
    (["loader", "--record"], "give --out or --record, not both"),
])
def test_a_call_that_cannot_run_as_asked_is_refused_before_any_phase(tmp_path, monkeypatch, capsys, argv, says):
    from tools import gpu_check
    from tools.phases import loader, methods, study

    ran = []
    for phase in (loader, methods, study):  # a call let through runs a stand-in, never the phase
        monkeypatch.setattr(phase, "run", lambda check, a: ran.append(check.phase))
    with pytest.raises(SystemExit) as e:
        gpu_check.main([*argv, "--smoke", "--out", str(tmp_path)])
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert not list(tmp_path.iterdir()) and ran == []


def test_the_attention_table_records_the_kit_s_commit_on_a_copy_without_git(monkeypatch):
    import subprocess as sp

    import kernels.bench

    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(sp, "run", no_git)
    monkeypatch.delenv("GPU_CHECK_COMMIT", raising=False)
    assert kernels.bench.commit() == "unknown"
    monkeypatch.setenv("GPU_CHECK_COMMIT", "abc1234")
    assert kernels.bench.commit() == "abc1234"


def test_a_phase_s_share_never_outlasts_the_call_s_budget(tmp_path, monkeypatch):
    """methods:600 under --budget_s 30: the phase gets what is left of the call (30 s), not its cap."""
    from tools import gpu_check
    from tools.phases import methods

    left = {}
    monkeypatch.setattr(methods, "run", lambda check, a: left.setdefault("methods", check.remaining()))
    gpu_check.main(["methods:600", "--smoke", "--budget_s", "30", "--out", str(tmp_path)])
    assert 0 < left["methods"] <= 30


def test_an_item_that_no_longer_fits_the_budget_is_skipped_without_running(tmp_path):
    import time

    from tools.gpu_check import Check

    check = Check("bench", tmp_path, smoke=False, deadline=time.monotonic() + 10, work=tmp_path, log=tmp_path / "log")
    ran = []
    assert check.item("big", 300, lambda: ran.append(1) or {"ran": True}) is None
    assert ran == [] and "budget" in check.record["items"]["big"]["skipped"]
    assert "skipped" in json.loads(check.path.read_text())["items"]["big"]


def test_smoke_mode_runs_every_item_whatever_its_gpu_estimate(tmp_path):
    """The estimates are seconds on the GPU: in smoke mode (the test suite's) they say nothing of the
    CPU's tiny runs, so `--smoke --budget_s 10` still runs an item estimated at 300 s."""
    import time

    from tools.gpu_check import Check

    check = Check("bench", tmp_path, smoke=True, deadline=time.monotonic() + 10, work=tmp_path, log=tmp_path / "log")
    ran = []
    assert check.item("big", 300, lambda: ran.append(1) or {"ran": True})["ran"] is True
    assert ran == [1] and "skipped" not in json.loads(check.path.read_text())["items"]["big"]


def test_each_item_is_on_disk_as_soon_as_it_is_measured(tmp_path):
    """A phase cut short (timeout, crash) keeps what it measured: the JSON is written after each item."""
    import time

    from tools.gpu_check import Check

    check = Check("bench", tmp_path, smoke=True, deadline=time.monotonic() + 10, work=tmp_path, log=tmp_path / "log")
    check.item("first", 0, lambda: {"images_per_s": 1.0})
    assert json.loads(check.path.read_text())["items"]["first"]["images_per_s"] == 1.0


def test_the_record_s_commit_says_when_the_tree_was_dirty(monkeypatch):
    import train.run.folder
    from tools import gpu_check

    monkeypatch.delenv("GPU_CHECK_COMMIT", raising=False)
    monkeypatch.setattr(train.run.folder, "git_commit", lambda: {"commit": "0123abc", "dirty": True})
    assert gpu_check.commit() == "0123abc+dirty"
    monkeypatch.setattr(train.run.folder, "git_commit", lambda: {"commit": "0123abc", "dirty": False})
    assert gpu_check.commit() == "0123abc"


def test_the_kit_s_commit_variable_names_the_commit_on_a_copy_without_git(monkeypatch):
    """The device machine gets a copy of the tree without .git: the commit comes from $GPU_CHECK_COMMIT."""
    import train.run.folder
    from tools import gpu_check

    monkeypatch.setattr(train.run.folder, "git_commit", lambda: {"commit": "unknown"})  # what no git gives
    monkeypatch.setenv("GPU_CHECK_COMMIT", "abc1234")
    assert gpu_check.commit() == "abc1234"
    monkeypatch.setenv("GPU_CHECK_COMMIT", "")  # set but empty: git's answer
    assert gpu_check.commit() == "unknown"


def test_the_record_says_whether_it_was_measured_on_the_gpu_or_in_smoke_mode(tmp_path, monkeypatch):
    from tools.gpu_check import Check

    monkeypatch.setenv("GPU_CHECK_COMMIT", "abc1234")
    for smoke, mode in ((False, "gpu"), (True, "smoke")):
        check = Check("bench", tmp_path, smoke=smoke, deadline=0.0, work=tmp_path, log=tmp_path / "log")
        assert check.record["mode"] == mode


def test_a_smoke_check_on_a_machine_with_a_gpu_stays_on_the_cpu(tmp_path):
    """--smoke takes each phase's CPU branch (tiny models) wherever it runs: with CUDA present the
    Check still says CPU, and its record and file name say smoke."""
    from fake_gpu import fake_gpu

    from tools.gpu_check import Check

    with fake_gpu("h100"):
        check = Check("bench", tmp_path, smoke=True, deadline=0.0, work=tmp_path, log=tmp_path / "log")
    assert check.cuda is False and check.device.type == "cpu" and "cpu_smoke" in check.path.name
    assert "H100" not in check.record["device"] and check.record["mode"] == "smoke"


def test_a_smoke_call_on_a_machine_with_a_gpu_runs_ours_and_the_baseline_on_the_cpu(tmp_path, monkeypatch):
    """train/bench.py and train/pretrain.py take CUDA wherever torch finds it, the baseline the
    Check's device (the CPU in smoke mode): a smoke ratio of the two was a GPU's rate over a CPU's.
    During the call this process and its children see no GPU; after it, the machine's is back."""
    import os

    from fake_gpu import fake_gpu

    import torch
    from tools import gpu_check
    from tools.phases import bench

    seen = {}

    def phase(check, a):
        seen.update(cuda=check.cuda, device=check.device.type, torch_sees=torch.cuda.is_available(),
                    gpus=torch.cuda.device_count())
        child = "import os; print('child sees', repr(os.environ['CUDA_VISIBLE_DEVICES']))"
        proc = check.run([sys.executable, "-c", child], 30)
        seen["child_rc"] = proc.returncode

    monkeypatch.setattr(bench, "run", phase)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with fake_gpu("h100"):
        gpu_check.main(["bench", "--smoke", "--out", str(tmp_path)])
        after = torch.cuda.is_available(), os.environ["CUDA_VISIBLE_DEVICES"]
    assert (seen["cuda"], seen["device"], seen["torch_sees"], seen["gpus"]) == (False, "cpu", False, 0)
    (log,) = tmp_path.glob("gpu_check_bench_cpu_smoke_*.log")
    assert seen["child_rc"] == 0 and "child sees ''" in log.read_text()
    assert after == (True, "0")
