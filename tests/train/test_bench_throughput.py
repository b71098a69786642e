"""train/bench.py: throughput through the real engine and loop, FLOPs from the token counts, MFU,
the loader alone; JSON records with device, versions and commit."""
import json
import os
import subprocess
import sys

import pytest
from conftest import CHILD_EXIT, CPU_DS, DEBUG_PRESET, REPO

from train.engine.execution import apply_execution_options


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Two benches in one process (the start-up is paid once): the debug MAE with activation
    checkpointing switched on, MFU against an A100's peak; the loader alone on JPEG shards."""
    import numpy as np
    from PIL import Image

    from data.write_shards import main as write_shards

    tmp = tmp_path_factory.mktemp("bench")
    src = tmp / "src" / "c0"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(24):
        Image.fromarray(rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)).save(src / f"{i}.jpg", quality=90)
    write_shards(["imagefolder", str(tmp / "src"), str(tmp / "s"), "--samples_per_shard", "6"])
    out = tmp / "results"
    common = ["--ds_config", str(CPU_DS), "--steps", "3", "--warmup", "1", "--out_dir", str(out)]
    calls = [
        [*common, "--config", str(DEBUG_PRESET), "--activation_checkpointing", "on", "--gpu", "a100"],
        [*common, "--config", str(DEBUG_PRESET), "--loader_only", "--data.source", "shards", "--data.train_index",
         str(tmp / "s" / "train.json"), "--data.num_workers", "2", "--model.in_chans", "3", "--data.decode",
         "cpu_draft"],
        # energy: its restoration gradients are counted, not modelled (train/estimate/step_flops.py)
        ["--ds_config", str(CPU_DS), "--steps", "1", "--warmup", "0", "--out_dir", str(tmp / "energy"),
         "--config", str(DEBUG_PRESET), "--config", str(REPO / "train/configs/energy/debug.json")],
    ]
    code = "import json, sys\nfrom train.bench import main\nfor argv in json.loads(sys.argv[1]):\n    main(argv)\n" + CHILD_EXIT
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(calls)], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = sorted(out.glob("*.json"))
    (energy,) = (tmp / "energy").glob("*.json")
    return {("loader" if "loader" in f.name else "train"): json.loads(f.read_text()) for f in files} | {
        "energy": json.loads(energy.read_text())}


def test_training_bench_reports_throughput_flops_and_mfu(records):
    r = records["train"]
    res = r["results"]
    # the debug MAE's hand count (tests/train/estimate/test_costs.py): 2,359,040 forward FLOPs per image
    assert res["train_flops_per_image"] == 3 * 2_359_040
    assert res["images_per_s"] == pytest.approx(8 / res["step_time_s"], rel=1e-6)  # cpu_debug: global batch 8 x 1
    assert res["tflops_per_gpu"] == pytest.approx(res["train_flops_per_image"] * 8 / res["step_time_s"] / 1e12)
    assert res["mfu"] == pytest.approx(res["tflops_per_gpu"] / 312)  # the A100's dense bf16 peak
    assert res["peak_rss_gib"] > 0.1
    assert r["ds_config"]["activation_checkpointing"] == {}  # the switch reached the engine's config
    assert r["git"]["commit"] and r["versions"]["deepspeed"] and r["world_size"] == 1 and "cores" in r["device"]


def test_energys_flops_are_its_counted_step_not_three_forwards(records):
    """Energy differentiates inside its forward (the restoration), which forward hooks do not
    see: its FLOPs per image are the counted optimizer step's, more than twice the 3 x forward model."""
    from train.config.ds_config import resolve
    from train.config.parsing import parse_args
    from train.estimate.costs import profile_config
    from train.estimate.step_flops import optimizer_step_flops

    res = records["energy"]["results"]
    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET),
                      "--config", str(REPO / "train/configs/energy/debug.json")])
    plan = records["energy"]["batch"]
    counted = sum(optimizer_step_flops(cfg, plan["micro"], plan["accum"]).values()) / (plan["micro"] * plan["accum"])
    assert res["train_flops_per_image"] == pytest.approx(counted)
    _, prof = profile_config(cfg, resolve(cfg, 1)[0], plan["micro"], fused_kernels=False)
    assert res["train_flops_per_image"] > 2 * prof.train_flops / plan["micro"]
    assert res["tflops_per_gpu"] == pytest.approx(counted * plan["micro"] * plan["accum"] / res["step_time_s"] / 1e12)


def test_loader_bench_reports_per_worker_throughput(records):
    r = records["loader"]["loader"]
    assert r["num_workers"] == 2 and r["decode"] == "cpu_draft" and r["micro_batch"] == 8
    assert r["images_per_s"] > 0 and r["images_per_s_per_worker"] == pytest.approx(r["images_per_s"] / 2)


def test_compile_switch_compiles_every_block():
    from model.objectives import build_objective
    from model.objectives.mae import MAEConfig
    from model.registry import create_model
    from model.vit import Block

    objective = build_objective("mae", create_model("vit_debug_patch4"), MAEConfig(decoder_depth=2))
    apply_execution_options(objective, recompute=True, compile_blocks=True)
    blocks = [m for m in objective.modules() if isinstance(m, Block)]
    assert len(blocks) == 4 and all(b.compiled_forward is not None for b in blocks)
    assert objective.encoder.grad_checkpointing and objective.decoder.grad_checkpointing


def test_a_compiled_block_computes_what_the_eager_block_does():
    import torch

    from model.vit import Block

    torch.manual_seed(0)
    block = Block(32, 2)
    x = torch.randn(2, 13, 32, requires_grad=True)
    eager = block(x)
    eager.sum().backward()
    grads = (x.grad.clone(), block.mlp.fc1.weight.grad.clone())
    x.grad = None
    block.zero_grad()
    block.compile_static()  # what run.compile does to every block (inductor, CPU here)
    compiled = block(x)
    compiled.sum().backward()
    assert torch.allclose(compiled, eager, atol=1e-5)
    assert torch.allclose(x.grad, grads[0], atol=1e-5) and torch.allclose(block.mlp.fc1.weight.grad, grads[1], atol=1e-5)


def test_the_record_times_the_whole_window_of_timed_steps(tmp_path):
    """The timed call logged at every multiple of --steps: with --warmup 2 --steps 3 at steps 3 and 5,
    so the record held the last 2 steps' time (and a host sync fell among the timed steps)."""
    code = (
        "import json, sys\nimport train.bench as bench\nlogged = []\nreal = bench.run\n"
        "def run(engine, data, settings, state, device, dtype, on_log, *a, **k):\n"
        "    start = state.step\n"
        "    out = real(engine, data, settings, state, device, dtype,\n"
        "               lambda step, m: (logged.append([start, step]), on_log(step, m)), *a, **k)\n"
        "    return out\n"
        "bench.run = run\nbench.main(json.loads(sys.argv[1]))\nprint(json.dumps(logged))\n")
    argv = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--steps", "3", "--warmup", "2",
            "--out_dir", str(tmp_path)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[0, 2], [2, 5]]  # one window per call, all its steps


def test_the_bench_refuses_before_start_what_training_refuses(tmp_path):
    """The bench skipped the checks a training command makes before start: an objective that does
    not fit the model ended in a traceback from its constructor, an image size no machine holds in
    an allocation error, shards too few for the readers in the loader's traceback, and a mask ratio
    that keeps no patch wrote a record of a step that trains nothing. Each is one line, exit 2,
    and no record."""
    import numpy as np
    from PIL import Image

    from data.write_shards import main as write_shards

    (tmp_path / "src" / "c0").mkdir(parents=True)
    for i in range(4):
        Image.fromarray(np.full((8, 8, 3), i, dtype=np.uint8)).save(tmp_path / "src" / "c0" / f"{i}.png")
    write_shards(["imagefolder", str(tmp_path / "src"), str(tmp_path / "s"), "--samples_per_shard", "2"])
    out = tmp_path / "results"
    common = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--steps", "1", "--warmup", "0",
              "--out_dir", str(out)]
    cases = {
        "mixedae.cell_size 5 px must be a multiple of the patch size 4": ["--objective", "mixedae",
                                                                           "--mixedae.cell_size", "5"],
        "a step needs at least": ["--model.img_size", "100000"],
        "2 shards cannot feed 1 ranks x 3 workers": ["--loader_only", "--data.source", "shards", "--data.train_index",
                                                     str(tmp_path / "s" / "train.json"), "--data.num_workers", "3"],
        "mae.mask_ratio 0.99 keeps no patch of the 49": ["--mae.mask_ratio", "0.99"],
    }
    code = ("import json, sys\nfrom train.bench import main\nfrom train.run.cli import cli\n"
            "for argv in json.loads(sys.argv[1]):\n    try:\n        cli(lambda: main(argv))\n"
            "    except SystemExit as e:\n        print('exit', e.code, flush=True)\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([[*common, *c] for c in cases.values()])], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.stdout.split() == ["exit", "2"] * len(cases), proc.stderr[-3000:]
    refusals = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(refusals) == len(cases) and all(said in line for said, line in zip(cases, refusals)), refusals
    assert "Traceback" not in proc.stderr and not list(out.glob("*.json"))


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    """One bench in process, as rank 0 of a world of 2 (the engine itself trains as one rank): micro-batch
    4 x 2 accumulated, 1 warm-up + 1 timed step, a ds_config holding activation checkpointing that
    --activation_checkpointing off takes out. Returns the record and the metrics of every logged window."""
    import torch

    import train.bench as bench

    tmp = tmp_path_factory.mktemp("accumulated")
    ds = {**json.loads(CPU_DS.read_text()), "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "activation_checkpointing": {}}
    (tmp / "ds.json").write_text(json.dumps(ds))
    windows = []
    real = bench.run

    def run(engine, data, settings, state, device, dtype, on_log, *a, **k):
        return real(engine, data, settings, state, device, dtype, lambda step, m: (windows.append(m), on_log(step, m)),
                    *a, **k)

    with pytest.MonkeyPatch.context() as mp, torch.random.fork_rng():  # the engine's build seeds the global RNG
        mp.setattr(bench.distributed, "init", lambda: (0, 2, torch.device("cpu")))
        mp.setattr(bench.distributed, "world_size_from_env", lambda: 2)
        mp.setattr(bench, "run", run)
        path = bench.main(["--ds_config", str(tmp / "ds.json"), "--config", str(DEBUG_PRESET), "--steps", "1",
                           "--warmup", "1", "--activation_checkpointing", "off", "--gpu", "a100",
                           "--out_dir", str(tmp / "out")])
    return json.loads(path.read_text()), windows


def test_flops_per_step_count_every_accumulated_micro_batch(accumulated):
    """Micro-batch 4 x 2 accumulated: a step trains 8 images, so its FLOPs (and the TFLOP/s and MFU
    from them) are the per-image count x 8, not x the micro-batch."""
    res = accumulated[0]["results"]
    assert res["tflops_per_gpu"] == pytest.approx(res["train_flops_per_image"] * 4 * 2 / res["step_time_s"] / 1e12)
    assert res["mfu"] == pytest.approx(res["tflops_per_gpu"] / 312)


def test_the_record_holds_the_timed_window_not_the_warm_up(accumulated):
    record, windows = accumulated
    assert len(windows) == 2  # the warm-up's window, then the timed steps'
    res, timed = record["results"], windows[-1]
    assert (res["step_time_s"], res["images_per_s"]) == (timed["step_time"], timed["images_per_s"])
    assert res["loss"] == timed["loss"] != windows[0]["loss"]  # another step, another loss: the window is told apart


def test_block_tokens_are_counted_per_image_not_per_micro_batch(accumulated):
    # the debug MAE's hand count: 2 encoder blocks of cls + 12 visible patches, 1 decoder block of cls + 49
    assert accumulated[0]["results"]["block_tokens_per_image"] == 2 * 13 + 50


def test_per_gpu_throughput_divides_by_the_world(accumulated):
    record = accumulated[0]
    res = record["results"]
    assert record["world_size"] == 2 and record["batch"]["global"] == 4 * 2 * 2
    assert res["images_per_s"] == pytest.approx(16 / res["step_time_s"])  # the global batch per step
    assert res["images_per_s_per_gpu"] == pytest.approx(res["images_per_s"] / 2)


def test_activation_checkpointing_off_takes_the_section_out_of_the_ds_config(accumulated):
    assert "activation_checkpointing" not in accumulated[0]["ds_config"]


def test_peak_rss_is_read_in_gib_from_the_kernels_kib():
    import resource

    import torch

    from train.bench import peak_memory_gib

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB; the peak only grows
    assert peak_memory_gib(torch.device("cpu"))["peak_rss_gib"] == pytest.approx(kib * 1024 / 2**30, rel=0.05)


def test_loader_throughput_counts_every_image_of_the_timed_batches(monkeypatch):
    """Images / s of the source alone: timed batches x micro-batch over the time between the clock's two reads."""
    from types import SimpleNamespace

    import train.bench as bench
    from train.config.parsing import parse_args

    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET)])
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=iter([10.0, 12.0]).__next__))  # 2 s
    r = bench.loader_throughput(cfg, {"warmup": 1, "steps": 4}, 28, 0, 1)
    assert r["micro_batch"] == 8 and r["batches"] == 4
    assert r["images_per_s"] == pytest.approx(4 * 8 / 2) and r["images_per_s_per_worker"] == pytest.approx(4 * 8 / 2)
