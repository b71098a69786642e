"""Kernel launches and host-device syncs per training step (tools/census.py, train/estimate/counting.py):
each objective's ViT-B preset at ViT-B depth and heads with narrow widths, through the real
engine and loop with a shipped A100 ds_config (bf16, ZeRO-1) at a CPU-sized micro-batch. The
ceilings are the counts of the lean step; a change that adds launches or a sync fails here. With
run.compile, the blocks' fused kernels count as launches and the step must launch fewer than eager.
docs/PERFORMANCE.md has the same census at ViT-B/16 widths and the numbers before the engine."""
from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import REPO

from tools.census import LAUNCHES_COMPILED, LAUNCHES_EAGER, census
from train.engine import distributed
from train.estimate.counting import Tally, counting, kernels_profiled

CONFIGS = REPO / "train" / "configs"
WIDTH = 48  # ViT-B's 12 blocks and heads, its 252 trained tensors (MAE), negligible compute
PRESETS = {
    "mae": ["--model.name", "vit_base_patch16"],
    "mixedae": ["--config", str(CONFIGS / "mixedae/vit_b.json")],
    "maeplus": ["--config", str(CONFIGS / "maeplus/vit_b.json")],
    "adpe": ["--config", str(CONFIGS / "maeplus/vit_b.json"), "--config", str(CONFIGS / "maeplus/variants/rpe_coord.json")],
    # the official code's coordinate lookup (every patch row through the continuous lookup): under AdPE's ceiling
    "adpe_official": ["--config", str(CONFIGS / "maeplus/vit_b.json"), "--config",
                      str(CONFIGS / "maeplus/variants/rpe_coord.json"), "--maeplus.coord_lookup", "official"],
    "mlomae": ["--config", str(CONFIGS / "mlomae/vit_b.json")],
    "energy": ["--config", str(CONFIGS / "energy/vit_b.json"), "--model.img_size", "64"],
    "finetune": ["--objective", "finetune", "--model.name", "vit_base_patch16", "--finetune.num_classes", "10",
                 "--optim.layer_decay", "0.65", "--data.num_classes", "10"],
}
# launches per optimizer step (the worst reported step, all phases); syncs: none
CEILINGS = {"mae": 681, "mixedae": 1239, "maeplus": 676, "adpe": 2138, "adpe_official": 2138, "mlomae": 5020,
            "energy": 6965, "finetune": 502}
# with --run.compile true (every ViT block one inductor graph): inductor kernels + extern aten ops per step,
# the counts these censuses measured (`python -m tools.census --ds_config ds_configs/vit_b_8xa100_bf16_zero1.json
# --micro 4 <preset> --width 48 --run.compile true`, torch 2.14.1+cu130 on CPU: inductor's C++ kernels). Unlike
# the eager counts they depend on the shapes (inductor fuses by size: MAE at ViT-B/16's own width launches 589)
COMPILED_CEILINGS = {"mae": 601, "mixedae": 871}


@pytest.fixture(scope="module")
def ds_config(tmp_path_factory):
    """ds_configs/vit_b_8xa100_bf16_zero1.json with a global batch of 4 (one rank, no accumulation)."""
    ds = json.loads((REPO / "ds_configs" / "vit_b_8xa100_bf16_zero1.json").read_text())
    ds.update(train_batch_size=4, train_micro_batch_size_per_gpu=4)
    path = tmp_path_factory.mktemp("census") / "ds.json"
    path.write_text(json.dumps(ds))
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread_one_process_group():
    """One thread (narrow widths: a second one only contends); the process group the censuses
    share (a world of 1) ends with this module, and the environment it set goes back."""
    env, threads = dict(os.environ), torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


def run_census(ds_config, name: str, baseline: str = "none", *extra: str) -> dict:
    return census(["--ds_config", str(ds_config), *PRESETS[name], "--width", str(WIDTH), "--steps", "3",
                   "--baseline", baseline, *extra])


@pytest.mark.parametrize("name", PRESETS)
def test_launches_and_syncs_per_step_stay_under_the_ceiling(ds_config, name):
    record = run_census(ds_config, name)
    ours = record["counts"]["ours"]
    total = ours["per_phase"]["total"]
    assert total["syncs"] == 0 and not ours["syncs"], ours["syncs"]  # nothing waits for the device in a step
    assert total["launches"] <= CEILINGS[name], (total, ours["top_ops"])
    # one rank: no collective but the hooks' own
    assert total["comm"] == 0 or name in ("adpe", "adpe_official", "mlomae")
    # the optimizer step: 3 kernels per parameter group (torch's fused AdamW: step counts up, update,
    # step count back where the step is skipped) and 15 for the whole step; the loop adds none
    assert ours["per_phase"]["step"]["launches"] <= 15 + 3 * record["optimizer_groups"]
    assert ours["per_phase"]["loop"]["launches"] == 0
    # the log step reads its window once: one .tolist() in train/run/loop.py
    log = ours["log_step_syncs"]
    assert [s["what"] for s in log] == ["Tensor.tolist"] and log[0]["where"].startswith("train/run/loop.py:"), log


def test_the_mae_step_launches_fewer_kernels_than_the_plain_pytorch_loop(ds_config):
    """tools/mae_baseline.py at the same shapes, fused AdamW (its fewest): ours launches fewer in
    every phase but the optimizer step, fewer in all, and has no sync where the baseline reads its loss."""
    record = run_census(ds_config, "mae", baseline="fused")
    ours, base = (record["counts"][k]["per_phase"] for k in ("ours", "baseline (fused AdamW)"))
    assert record["tensors"] == 252  # ViT-B's encoder and MAE's decoder, as at full width
    for phase in ("forward", "backward"):
        assert ours[phase]["launches"] < base[phase]["launches"], phase
    assert ours["total"]["launches"] < base["total"]["launches"]
    assert ours["total"]["syncs"] == 0 and base["total"]["syncs"] == 1


def test_the_counter_sees_kernels_collectives_and_syncs_by_phase():
    tally = Tally()
    x = torch.arange(6.0)
    with counting(tally) as syncs:
        with tally("data"):
            y = x.view(2, 3).t()  # views: no kernel
            z = torch.empty(4)  # an allocation: no kernel
        with tally("forward"):
            y = y * 2 + 1  # two kernels
            torch._foreach_add_([x, z], 1.0)  # one multi-tensor op
        with tally("step"):
            bool(x.sum() > 0)  # a kernel each for sum and gt, and a sync
            x[x > 2]  # a kernel (gt), a boolean-mask index (sync) and its kernels
    counts = tally.per_step(1)
    assert counts["data"] == {"launches": 0, "comm": 0, "syncs": 0}
    assert counts["forward"]["launches"] == 3
    assert counts["step"]["syncs"] == 2 and counts["step"]["launches"] >= 3
    assert [s.what for s in syncs.records] == ["Tensor.__bool__", "Tensor.__getitem__"]
    assert syncs.records[0].where.startswith("test_census.py:")  # outside the library: the file's name


def test_a_step_begins_at_every_accum_th_data_phase():
    """With 2 micro-batches per optimizer step, 4 data phases are 2 steps of 2 forwards each
    (tools/census.py sets the tally's accum from the subject's)."""
    tally = Tally()
    tally.accum = 2
    steps = []
    for _ in range(4):
        with tally("data"):
            steps.append(tally.step)
        with tally("forward"):
            tally.add("launches")
    assert steps == [1, 1, 2, 2]
    assert [tally.per_step(s)["forward"]["launches"] for s in (1, 2)] == [2, 2]


def test_the_counter_sees_a_compiled_graphs_kernels_and_its_aten_calls_by_phase():
    """mm((x * 2).relu(), w): inductor fuses the mul and the relu into one C++ kernel and calls the
    matmul as an aten op (an extern kernel): 2 launches where eager runs 3, in the phase the graph
    ran in (a call outside every phase is the loop's), before a collective issued after them."""
    def f(x, w):
        return torch.mm((x * 2).relu(), w)

    distributed.init()  # a world of 1, for the collective
    compiled = torch.compile(f, dynamic=False, fullgraph=True)
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    tally, eager = Tally(), Tally()
    with kernels_profiled(), counting(tally, compiled=True):
        with tally("forward"):
            y = compiled(x, w)  # compiled here, with the counter off; then run with it on
        with tally("data"):  # the next step
            pass
        with tally("forward"):
            torch.distributed.all_reduce(compiled(x, w))
        compiled(x, w)
    with counting(eager):
        with eager("forward"):
            f(x, w)
    torch.testing.assert_close(y, f(x, w))
    assert eager.per_step(0)["forward"]["launches"] == 3
    for step, phase in ((0, "forward"), (1, "forward"), (1, "loop")):
        launched = {op: n for op, n in tally.ops[step, phase].items() if not op.startswith("c10d::")}
        assert launched == {"aten::mm.out": 1, "inductor::cpp_fused_mul_relu_0": 1}, (step, phase)
        assert tally.per_step(step)[phase]["launches"] == 2
    [collective] = tally.collectives
    assert (collective.step, collective.phase, collective.launches_before) == (1, "forward", 2)


@pytest.mark.parametrize("name", COMPILED_CEILINGS)
def test_a_compiled_step_launches_fewer_kernels_than_eager_without_a_sync(ds_config, name):
    """--run.compile true against the eager census of the same configuration: the blocks' fused
    kernels cut the forward and the backward, the rest of the step launches what it did, nothing
    waits for the device, and the step stays under its ceiling."""
    compiled = run_census(ds_config, name, "none", "--run.compile", "true")
    eager = run_census(ds_config, name)
    assert (compiled["launches"], eager["launches"]) == (LAUNCHES_COMPILED, LAUNCHES_EAGER)
    ours, before = compiled["counts"]["ours"], eager["counts"]["ours"]["per_phase"]
    counts = ours["per_phase"]
    assert counts["total"]["syncs"] == 0 and not ours["syncs"], ours["syncs"]
    assert [s["what"] for s in ours["log_step_syncs"]] == ["Tensor.tolist"]
    for phase in ("forward", "backward"):
        assert counts[phase]["launches"] < before[phase]["launches"], (phase, ours["top_ops"][phase])
        assert any(op.startswith("inductor::") for op, _ in ours["top_ops"][phase]), ours["top_ops"][phase]
    for phase in ("data", "step", "hook", "loop"):
        assert counts[phase] == before[phase], phase
    assert counts["total"]["launches"] <= COMPILED_CEILINGS[name], (counts["total"], ours["top_ops"])


def test_the_record_reports_the_worst_of_the_reported_steps():
    """A fake loop whose s-th step launches s kernels: of steps 2 and 3 (1 warms up, 4 logs) the
    record is step 3's, the most launches of those reported."""
    from tools.census import Subject, count

    done = [0]

    def run(phase, n):
        for _ in range(n):
            done[0] += 1
            with phase("data"):
                pass
            with phase("forward"):
                x = torch.ones(4)
                for _ in range(done[0]):
                    x = x + 1  # one kernel each

    record = count(Subject("fake", run, 1), 4)
    assert set(record["steps"]) == {2, 3}
    most = max(s["launches"] for s in record["steps"].values())
    assert record["step"] == 3 and record["per_phase"]["total"]["launches"] == most
    assert record["steps"][3]["launches"] > record["steps"][2]["launches"]


def debug_mae(*extra: str):
    from train.bench import NOT_READ
    from train.config.parsing import parse_args

    return parse_args(["--ds_config", str(REPO / "ds_configs" / "cpu_debug.json"), "--data.source", "synthetic",
                       "--config", str(CONFIGS / "mae/debug.json"), *extra], NOT_READ)


@pytest.mark.parametrize("fused", [True, False])
def test_the_baseline_runs_the_adamw_it_is_named_for(monkeypatch, fused):
    """--baseline fused hands fused=True to the baseline's AdamW; foreach leaves torch's default."""
    import tools.mae_baseline as mae_baseline
    from tools.census import baseline_subject

    made = []

    class Spy(mae_baseline.BaselineStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.opt)

    monkeypatch.setattr(mae_baseline, "BaselineStep", Spy)
    subject = baseline_subject(debug_mae(), {}, 2, torch.float32, torch.device("cpu"), fused=fused)
    [opt] = made
    assert opt.defaults["fused"] is (True if fused else None)
    assert subject.name == f"baseline ({'fused' if fused else 'foreach'} AdamW)"


@pytest.mark.parametrize("name", ["mae", "mixedae"])
def test_a_narrowed_baseline_has_our_narrowed_maes_widths_and_parameters(name):
    """--width 48 narrows the baseline's decoder with its encoder, as narrowed() does our MAE's:
    the same decoder width and the same trained parameter count as our MAE at that width; also
    beside another objective, whose narrowing leaves the mae section's decoder_dim (512) as it was."""
    from model.objectives import build_objective
    from tools.census import baseline_model, narrowed
    from train.config.options import section
    from train.config.plan import build_encoder

    def config(preset):
        return narrowed(["--ds_config", str(REPO / "ds_configs" / "cpu_debug.json"), "--data.source", "synthetic",
                         *PRESETS[preset]], WIDTH)

    cfg, arch = config(name)
    baseline, _ = baseline_model(cfg, arch, 1, torch.device("cpu"))
    mae_cfg, mae_arch = config("mae")
    ours = build_objective("mae", build_encoder(mae_cfg, mae_arch), section(mae_cfg))
    assert baseline.decoder_embed.out_features == WIDTH == mae_cfg.mae.decoder_dim
    # ours keeps its fixed positions as frozen parameters, the baseline as buffers: trained ones compared
    trained = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    assert sum(p.numel() for p in baseline.parameters()) == trained


def test_host_time_is_the_median_ms_per_step_over_rounds(monkeypatch):
    """A stood-in clock: each round of 10 steps takes the seconds listed (one slow round, a
    hiccup); the figure is the median of the per-step milliseconds, not the mean."""
    import tools.census as census_module

    seconds = {"a": [5.0, 0.1, 0.2], "b": [0.3, 0.3, 0.9]}
    now = [0.0]

    def subject(name):
        rounds = iter(seconds[name])

        def run(phase, n):
            assert n == census_module.HOST_TIME_STEPS
            now[0] += next(rounds)

        return census_module.Subject(name, run, 1)

    monkeypatch.setattr(census_module.time, "perf_counter", lambda: now[0])
    times = census_module.host_time([subject("a"), subject("b")], 3)
    per_step = {n: [s / census_module.HOST_TIME_STEPS * 1e3 for s in v] for n, v in seconds.items()}
    assert times["rounds"] == 3
    for name, ms in per_step.items():
        assert times[name] == pytest.approx(sorted(ms)[1])  # the middle of three


def test_a_gpu_only_fp16_file_is_counted_on_cpu_as_on_its_gpu(tmp_path):
    """On a CPU the census counts a GPU's configuration as if the machine had one: the V100 file's
    fp16 (which training refuses without CUDA) builds a float16 engine here."""
    from tools.census import narrowed, our_subject, split_argv

    ds = json.loads((REPO / "ds_configs" / "vit_b_8xv100_fp16_zero1.json").read_text())
    assert ds["fp16"]["enabled"] and not ds["bf16"]["enabled"]
    ds.update(train_batch_size=2, train_micro_batch_size_per_gpu=2)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    _, rest = split_argv(["--ds_config", str(path), "--config", str(CONFIGS / "mae/debug.json")])
    _, run_info = our_subject(*narrowed(rest, 0))
    assert run_info["dtype"] == "float16" and run_info["ds_config"]["fp16"]["enabled"]


def test_overlap_counts_the_step_phases_reduction_after_the_backward():
    """Stand-in collectives of one step: a forward all-gather (not a reduction), a reduce-scatter
    inside the backward, and the step's 1-element all-reduce of the gradient norm's sum of squares
    (sharded stages) after the backward returned; another step's reduction is not this step's."""
    from tools.census import overlap
    from train.estimate.counting import Collective

    tally = Tally()
    tally.collectives = [Collective(2, "forward", "c10d::_allgather_base_", 100, False),
                         Collective(2, "backward", "c10d::_reduce_scatter_base_", 200, True),
                         Collective(2, "step", "c10d::allreduce_", 1, False),
                         Collective(3, "step", "c10d::allreduce_", 1, False)]
    o = overlap(tally, 2)
    assert {k: v for k, v in o.items() if k != "collectives"} == \
        {"reductions_in_backward": 1, "reductions_after_backward": 1, "elements_reduced_after_backward": 1}
    assert [c["op"] for c in o["collectives"]] == [c.op for c in tally.collectives[:3]]


def written(argv: list[str]) -> dict:
    """The ds_config file an argv's --ds_config points at."""
    return json.loads(open(argv[argv.index("--ds_config") + 1]).read())


def test_micro_drops_the_files_accumulation_for_micro_x_ranks(tmp_path, monkeypatch):
    """--micro 4 on a file that accumulates (the linear probe's, 512 x 4 per rank): the copy's
    micro-batch is 4 and its global batch 4 x ranks, with no accumulation left to contradict them."""
    import tempfile

    from tools.census import with_micro

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    given = REPO / "ds_configs" / "linprobe_8xa100_fp32_zero0.json"
    assert json.loads(given.read_text())["gradient_accumulation_steps"] == 4
    argv = with_micro(["--x", "1", "--ds_config", str(given), "--y", "2"], 4)
    ds = written(argv)
    assert "gradient_accumulation_steps" not in ds
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (4, 4 * 2)
    assert ds["zero_optimization"] == {"stage": 0}  # the stage as given
    assert argv[:3] == ["--x", "1", "--ds_config"] and argv[4:] == ["--y", "2"]


@pytest.mark.parametrize("extra,stage,micro", [(["--zero_stage", "0", "--micro", "4"], 0, 4),
                                               (["--zero_stage", "2"], 2, 256)])
def test_zero_stage_sets_the_files_stage_with_or_without_micro(tmp_path, monkeypatch, extra, stage, micro):
    """--zero_stage 0 on the ZeRO-1 A100 file is stage 0 (not "as given"), and --zero_stage alone
    changes the stage and leaves the file's batch (256 per rank) as it was."""
    import tempfile

    from tools.census import split_argv

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    given = REPO / "ds_configs" / "vit_b_8xa100_bf16_zero1.json"
    assert json.loads(given.read_text())["zero_optimization"]["stage"] == 1
    opts, rest = split_argv(["--ds_config", str(given), *extra])
    ds = written(rest)
    assert opts["zero_stage"] == stage and ds["zero_optimization"]["stage"] == stage
    assert ds["train_micro_batch_size_per_gpu"] == micro
