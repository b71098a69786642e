"""The dry run over every shipped ds_config, for the methods each serves, and what it rejects."""
import json
import math
import re
import sys

import pytest
from conftest import REPO

from train.config.parsing import parse_args
from train.estimate.dry_run import check
from train.estimate.gpus import gpu_in_filename, gpu_named

DS = REPO / "ds_configs"
PRESETS = REPO / "train" / "configs"
MODELS = {"b": "vit_base_patch16", "l": "vit_large_patch16", "h": "vit_huge_patch14"}


def methods_for(name: str) -> list[list[str]]:
    """The option sets (method presets) a shipped file is meant for: for the 4096 matrix MAE+ (every
    token of 4 crops in the encoder: the most memory) everywhere, MAE and MixedAE on ZeRO-1."""
    if name.startswith("vit_"):
        model = ["--model.name", MODELS[name[4]]]
        cell = ["--mixedae.cell_size", "28"] if name[4] == "h" else []  # 2 x 2 patches of 14 px
        others = [model, ["--config", str(PRESETS / "mixedae/vit_b.json"), *model, *cell]] if "zero1" in name else []
        return [["--config", str(PRESETS / "maeplus/vit_b.json"), *model], *others]
    if name.startswith(("mlomae_", "energy_")):
        return [["--config", str(PRESETS / name.split('_')[0] / "vit_b.json")]]
    if name.startswith("finetune_"):
        from train.finetune import RECIPE

        return [[*RECIPE, "--model.name", MODELS[name.split("_")[2]], "--finetune.num_classes", "1000"]]
    if name.startswith("linprobe_"):
        from train.linprobe import RECIPE

        return [[*RECIPE, "--model.name", "vit_base_patch16", "--linprobe.num_classes", "1000"]]
    if name == "cpu_linprobe.json":  # the linear probe's CPU recipe and the MAE recipe (LARS: ZeRO 0), debug model
        from train.linprobe import RECIPE

        probe = [*RECIPE, "--linprobe.num_classes", "10", "--data.epoch_size", "60000"]  # Fashion-MNIST's train split
        return [[*probe, "--config", str(PRESETS / "mae/debug.json")],
                [*probe, "--config", str(PRESETS / "linprobe/cpu_recipe.json"), "--model.name", "vit_debug_patch4",
                 "--data.num_classes", "10"]]
    if name == "cpu_demo.json":
        return [["--config", str(PRESETS / "mae/demo.json"), "--data.epoch_size", "60000"]]  # Fashion-MNIST's train split
    return [["--config", str(PRESETS / "mae/debug.json")]]  # the tests' config


@pytest.mark.parametrize("path", sorted(DS.glob("*.json")), ids=lambda p: p.stem)
def test_every_shipped_ds_config_passes_the_dry_run_for_its_methods(path):
    gpu = gpu_named(gpu_in_filename(path.name) or "a100")
    world = 8 if gpu_in_filename(path.name) else 1
    for options in methods_for(path.name):
        cfg = parse_args(["--ds_config", str(path), "--data.source", "synthetic", *options])
        run = check(cfg, world, gpu)
        assert run.ok, f"{path.name} {options}: {run.problems}"
        assert run.memory is not None and run.memory.fits(gpu)
        # the file's activation_checkpointing section (its presence) switches recomputation on
        said = "on" if "activation_checkpointing" in json.loads(path.read_text()) else "off"
        assert run.lines[0].endswith(f"activation checkpointing {said}"), run.lines[0]


def test_shipped_micro_batches_are_the_largest_the_memory_estimate_allows_with_a_margin(tmp_path):
    """ds_configs/generate.py's rule: the largest power of two at most MARGIN x the largest micro-batch
    the estimate fits for the group's hungriest method, and at most the global batch over 16 GPUs
    (MLO-MAE: over 8, so that its levels II and III see the whole global batch on one node)."""
    sys.path.insert(0, str(DS))
    try:
        from generate import GLOBAL, HUNGRIEST, MARGIN, RANKS, SERVED, config, matrix
    finally:
        sys.path.remove(str(DS))
    for name in matrix():
        group = "pretrain" if name.startswith("vit_") else name.split("_vit_")[0]
        group = "pretrain_actckpt" if "actckpt" in name else group
        model, gpu = name.split("vit_")[1][0], gpu_in_filename(name)
        stage = int(name.split("zero")[1][0])
        probe = tmp_path / "probe.json"  # any micro-batch: the estimate scales the activations per sample
        probe.write_text(json.dumps(config(group, model, gpu, stage, micro=8)))
        options = [*(str(REPO / o) if o.endswith(".json") else o for o in HUNGRIEST[group]), "--model.name",
                   MODELS[model], *(["--model.img_size", "112"] if group.startswith("pretrain") else [])]
        run = check(parse_args(["--ds_config", str(probe), "--data.source", "synthetic", *options]), 8, gpu_named(gpu))
        largest = run.memory.largest_micro(gpu_named(gpu))
        want = min(GLOBAL[group] // RANKS.get(group, SERVED), 2 ** int(math.log2(MARGIN * largest)))
        assert json.loads((DS / name).read_text())["train_micro_batch_size_per_gpu"] == want, (name, largest)


def test_the_generator_rewrites_only_what_differs_and_its_help_writes_nothing(tmp_path, monkeypatch, capsys):
    """`--help` printed nothing and rewrote all 33 files (an edited one lost its edit silently);
    now it is argparse's help, `--check` lists what differs, and a write names what it replaced."""
    import shutil

    sys.path.insert(0, str(DS))
    try:
        import generate
    finally:
        sys.path.remove(str(DS))
    for f in DS.glob("*.json"):
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr(generate, "HERE", tmp_path)
    edited = tmp_path / "vit_b_8xa100_bf16_zero1.json"
    edited.write_text(edited.read_text().replace('"gradient_clipping": 0.0', '"gradient_clipping": 1.0'))
    with pytest.raises(SystemExit) as helped:
        generate.main(["--help"])
    assert helped.value.code == 0 and "--check" in capsys.readouterr().out and "1.0" in edited.read_text()
    assert generate.main(["--check"]) == 1 and "1 of 33 files differ" in capsys.readouterr().out
    assert "1.0" in edited.read_text()
    assert generate.main([]) == 0
    assert "wrote 1 of 33 files to" in capsys.readouterr().out and "1.0" not in edited.read_text()
    assert generate.main(["--check"]) == 0


def test_matrix_files_are_the_generators_output():
    sys.path.insert(0, str(DS))
    try:
        from generate import matrix, render
    finally:
        sys.path.remove(str(DS))
    files = matrix()
    for name, cfg in files.items():
        assert (DS / name).read_text() == render(cfg), f"{name} differs: run python ds_configs/generate.py"
    assert len([f for f in files if f.startswith("vit_")]) == 21  # B/L/H x 3 GPUs x ZeRO 1, 2 (+ ZeRO-3 for H)
    for name, cfg in files.items():
        if name.startswith("vit_"):
            assert cfg["train_batch_size"] == 4096 and "gradient_accumulation_steps" not in cfg
            assert ("activation_checkpointing" in cfg) == ("zero3" in name)


def _check(ds: str, *options: str, world: int = 8, gpu: str = "a100"):
    return check(parse_args(["--ds_config", str(DS / ds), "--data.source", "synthetic", *options]), world,
                 gpu_named(gpu))


def test_rejections_name_the_problem():
    assert "V100 has none" in _check("vit_b_8xa100_bf16_zero1.json", gpu="v100").problems[0]
    assert "not divisible by micro batch 256 x 24 ranks" in _check("vit_b_8xa100_bf16_zero1.json", world=24).problems[0]
    zero3 = "vit_h_8xa100_bf16_zero3_actckpt.json"  # every objective and the figures run under ZeRO-3
    assert _check(zero3, "--config", str(PRESETS / "mlomae/vit_b.json")).ok
    assert _check(zero3, "--model.name", "vit_huge_patch14", "--run.vis_every", "100").ok


def test_memory_estimate_reacts_to_zero_stage_checkpointing_and_micro_batch(tmp_path):
    base = json.loads((DS / "vit_h_8xv100_fp16_zero1.json").read_text())
    h = ["--model.name", "vit_huge_patch14"]

    def estimate(**changes):
        cfg = {**base, **changes}
        (tmp_path / "ds.json").write_text(json.dumps(cfg))
        return check(parse_args(["--ds_config", str(tmp_path / "ds.json"), "--data.source", "synthetic", *h]), 8,
                     gpu_named("v100"))

    z1 = estimate()
    z2 = estimate(zero_optimization={**base["zero_optimization"], "stage": 2})
    z3 = estimate(zero_optimization={"stage": 3}, activation_checkpointing={})
    # ZeRO-1 sums the micro-batches' gradients whole (in the reduce dtype), ZeRO-2 reduces each
    # micro-batch and keeps its shard only (train/estimate/memory.py)
    assert z2.memory.gradients < z1.memory.gradients and z2.memory.fixed < z1.memory.fixed
    # ZeRO-3 partitions the fp32 weights, gathering one block (and the next) at a time
    assert z3.memory.weights == pytest.approx(4 * z1.memory.params / 8 + 2 * 2 * z1.memory.largest_layer)
    assert z3.memory.activations < z1.memory.activations / 5  # checkpointing keeps block inputs only
    big = estimate(train_micro_batch_size_per_gpu=512)
    assert not big.ok and "exceeds" in big.problems[0] and f"at most {big.memory.largest_micro(gpu_named('v100'))}" \
        in big.problems[0]
    assert big.memory.activations == pytest.approx(z1.memory.activations * 16)  # linear in the micro-batch


def test_cli_exit_codes(capsys):
    from train.pretrain import main

    def run(*args):
        with pytest.raises(SystemExit) as exit_:
            main(["--dry-run", *args])
        return exit_.value.code, capsys.readouterr().out

    code, out = run("--ds_config", str(DS / "vit_l_8xa100_bf16_zero2.json"), "--model.name", "vit_large_patch16",
                    "--data.source", "synthetic", "--world_size", "16")
    assert code == 0, out
    assert "16 x A100 SXM4 80GB: global batch 4096 = micro 256 x accumulation 1 x 16 ranks" in out
    code, out = run("--ds_config", str(DS / "vit_l_8xa100_bf16_zero2.json"), "--data.source", "synthetic",
                    "--gpu", "v100")
    assert code == 2 and "PROBLEM: ds_config enables bf16, which this GPU lacks" in out


def test_the_world_size_checked_is_said_with_where_it_comes_from(capsys, monkeypatch):
    from train.pretrain import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def first_line(*args):
        with pytest.raises(SystemExit):
            main(["--dry-run", "--data.source", "synthetic", *args])
        return capsys.readouterr().out.splitlines()[0]

    preset = str(REPO / "train" / "configs" / "mae" / "debug.json")
    # a CPU file with no GPU named: one process, not a node of 8
    assert first_line("--ds_config", str(DS / "cpu_debug.json"), "--config", preset, "--gpu", "cpu").endswith(
        "world size 1 (assumed: one CPU process; pass --world_size N to check N ranks)")
    assert first_line("--ds_config", str(DS / "vit_b_8xa100_bf16_zero1.json"), "--model.name",
                      "vit_base_patch16").endswith("world size 8 (assumed: one node of 8 A100 SXM4 80GBs; pass "
                                                   "--world_size N to check another)")
    assert first_line("--ds_config", str(DS / "cpu_debug.json"), "--config", preset, "--world_size", "2").endswith(
        "world size 2 (--world_size)")


def test_tensors_that_cannot_be_allocated_are_a_problem_before_any_estimate(monkeypatch):
    """An image size whose batch or position table alone exceeds the GPU (or, for CPU ranks, this
    machine's memory) is refused from the model's geometry, where the meta-device estimate cannot
    even allocate its tensors."""
    huge = _check("vit_b_8xa100_bf16_zero1.json", "--model.name", "vit_base_patch16", "--model.img_size", "160000")
    assert not huge.ok and huge.memory is None
    assert re.match(r"a step needs at least [\d,.]+ GiB per rank \(images [\d,.]+, patch embeddings [\d,.]+, position "
                    r"table [\d,.]+, block weights [\d,.]+ GiB at micro-batch 256, image size 160000\), more than the "
                    r"80\.0 GiB of A100 SXM4 80GB: lower model.img_size", huge.problems[0]), huge.problems
    monkeypatch.setattr("train.estimate.memory.os.sysconf", lambda name: {"SC_PHYS_PAGES": 2**18, "SC_PAGE_SIZE": 4096}[name])
    cpu = check(parse_args(["--ds_config", str(DS / "cpu_debug.json"), "--config", str(PRESETS / "mae/debug.json"),
                            "--model.img_size", "4096"]), 1, None)
    assert "more than the 1.0 GiB of this machine's memory" in cpu.problems[0]
    assert check(parse_args(["--ds_config", str(DS / "cpu_debug.json"), "--config", str(PRESETS / "mae/debug.json")]),
                 1, None).ok


def test_the_dry_run_says_how_the_blocks_execute_and_where_compile_loses_its_graphs(capsys):
    """CUDA graphs need weights at fixed addresses: one rank or ZeRO-0 keep them, FSDP2's stages do
    not, and the dry run says what that cost on a GPU; eager blocks say how to compile them."""
    from train.engine.execution import replicated_weights
    from train.pretrain import main

    def blocks(*args):
        with pytest.raises(SystemExit) as exit_:
            main(["--dry-run", "--data.source", "synthetic", "--model.name", "vit_base_patch16", *args])
        out = capsys.readouterr().out
        assert exit_.value.code == 0, out
        return [line.strip() for line in out.splitlines() if line.strip().startswith("blocks:")]

    zero1 = str(DS / "vit_b_8xh100_bf16_zero1.json")
    assert blocks("--ds_config", zero1)[0].startswith("blocks: eager (run.compile false; with one rank or ZeRO-0")
    sharded = blocks("--ds_config", zero1, "--run.compile", "true")[0]
    assert "without CUDA graphs: ZeRO-1 on FSDP2" in sharded and "slower than eager" in sharded
    assert blocks("--ds_config", zero1, "--run.compile", "true", "--world_size", "1")[0].endswith(
        "replayed as CUDA graphs (replicated weights)")
    assert blocks("--ds_config", str(DS / "cpu_debug.json"), "--run.compile", "true", "--gpu", "cpu")[0].endswith(
        "(no CUDA graphs off the GPU)")
    assert replicated_weights({"zero_optimization": {"stage": 0}}, 8)
    assert not replicated_weights({"zero_optimization": {"stage": 2}}, 2) and replicated_weights({}, 1)


def test_the_printed_numbers_follow_from_the_ds_config_the_built_objective_and_the_estimate(capsys, monkeypatch):
    """ViT-B MAE on 8 A100s (ds_configs/vit_b_8xa100_bf16_zero1.json), each printed number against
    its source: the file's batch numbers, the objective built for one sample, MAE's lr scaling rule
    (blr x global batch / 256), ZeRO-1's per-rank model states (train/estimate/memory.py's docstring)
    and 90% of the GPU's 80 GiB; the step's communication is printed for several ranks only."""
    from train.estimate.costs import profile_config
    from train.estimate.memory import GIB
    from train.pretrain import main

    path = DS / "vit_b_8xa100_bf16_zero1.json"
    ds = json.loads(path.read_text())
    tb, micro = ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]
    options = ["--ds_config", str(path), "--data.source", "synthetic", "--model.name", "vit_base_patch16"]
    cfg = parse_args(options)
    run = check(cfg, 8, gpu_named("a100"))
    assert run.ok, run.problems
    lines, mem = run.lines, run.memory

    assert lines[0] == (f"8 x A100 SXM4 80GB: global batch {tb} = micro {micro} x accumulation {tb // (micro * 8)} x 8 "
                        f"ranks; bf16; ZeRO 1; offload none; activation checkpointing off")
    schedule, = [x for x in lines if x.startswith("schedule:")]
    peak, blr, batch = re.search(r"peak lr ([\d.e-]+) \(blr ([\d.e-]+) x (\d+) / 256\)$", schedule).groups()
    assert float(blr) == cfg.optim.blr and int(batch) == tb
    assert float(peak) == pytest.approx(cfg.optim.blr * tb / 256, rel=1e-3)

    objective, one = profile_config(cfg, ds, 1, True)  # one sample
    params = sum(p.numel() for p in objective.parameters())
    trained = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    assert trained < params  # the fixed position tables: the two counts differ
    counts, = [x for x in lines if x.startswith("parameters:")]
    assert counts.startswith(f"parameters: {params / 1e6:.1f}M ({trained / 1e6:.1f}M trained); per sample: "
                             f"{one.tokens()} block tokens, ") and "outside" not in counts
    gflops = float(re.search(r", ([\d.]+) training GFLOPs", counts).group(1))
    assert gflops == pytest.approx(one.train_flops / 1e9, abs=0.1)

    # ZeRO-1, bf16, 8 ranks, 2 micro-batches: fp32 master shards + whole bf16 weights; fp32 gradient
    # shards + the unsynced bf16 sum; Adam's two fp32 moments sharded
    assert (mem.params, mem.trainable) == (params, trained)
    assert mem.weights == pytest.approx(4 * params / 8 + 2 * params)
    assert mem.gradients == pytest.approx(4 * trained / 8 + 2 * trained)
    assert mem.optimizer == pytest.approx(8 * trained / 8)
    memory, = [x for x in lines if x.startswith("memory per GPU")]
    assert f"total {round(mem.total / GIB, 2)} of 80 (limit {0.9 * 80:.1f}); " in memory
    states = (mem.weights + mem.gradients + mem.optimizer) / GIB
    assert any(x.startswith(f"model states {states:.2f} GiB: weights + gradient buffers + optimizer") for x in lines)

    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def printed(world):
        with pytest.raises(SystemExit) as exit_:
            main(["--dry-run", *options, "--world_size", str(world)])
        out = capsys.readouterr().out
        assert exit_.value.code == 0, out
        return out

    assert "communication per step on paper" in printed(8)
    assert "communication per step" not in printed(1)  # one rank sends nothing


def test_mlomaes_networks_trained_outside_the_engine_are_counted_apart():
    from train.estimate.costs import profile_config

    path = DS / "mlomae_vit_b_8xa100_bf16_zero1.json"
    cfg = parse_args(["--ds_config", str(path), "--data.source", "synthetic", "--config",
                      str(PRESETS / "mlomae/vit_b.json")])
    objective, _ = profile_config(cfg, json.loads(path.read_text()), 1, True)
    outside = sum(p.numel() for p in objective.outside_parameters())
    assert outside > 0
    counts, = [x for x in check(cfg, 8, gpu_named("a100")).lines if x.startswith("parameters:")]
    assert f"trained) + {outside / 1e6:.1f}M trained outside the engine; per sample" in counts


def test_the_world_size_a_ds_config_implies_counts_its_accumulation(tmp_path, monkeypatch):
    from train.estimate.dry_run import default_world

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    linprobe = DS / "linprobe_8xa100_fp32_zero0.json"
    ds = json.loads(linprobe.read_text())
    world, why = default_world(str(linprobe), gpu_named("a100"))
    assert world == ds["train_batch_size"] // (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"])
    assert why == "train_batch_size / (micro-batch x accumulation) of the ds_config"
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                                                  "gradient_accumulation_steps": 2}))
    assert default_world(str(tmp_path / "ds.json"), gpu_named("a100"))[0] == 64 // (4 * 2)


def test_a_micro_batch_one_past_the_largest_that_fits_is_refused_against_90_percent_of_the_gpu(tmp_path):
    """ViT-H on 8 V100s (32 GiB), fp16, ZeRO-1: the largest micro-batch the estimate allows passes, one
    more exceeds 90% of the GPU's memory (though not all of it) and is refused, naming that limit."""
    from train.estimate.memory import GIB

    base = json.loads((DS / "vit_h_8xv100_fp16_zero1.json").read_text())
    v100 = gpu_named("v100")

    def run(micro):
        (tmp_path / "ds.json").write_text(json.dumps({**base, "train_micro_batch_size_per_gpu": micro,
                                                      "train_batch_size": micro * 8}))
        return check(parse_args(["--ds_config", str(tmp_path / "ds.json"), "--data.source", "synthetic",
                                 "--model.name", "vit_huge_patch14"]), 8, v100)

    largest = run(8).memory.largest_micro(v100)
    fits, over = run(largest), run(largest + 1)
    limit = 0.9 * 32 * GIB
    assert fits.memory.total <= limit and fits.ok, fits.problems
    assert limit < over.memory.total < 32 * GIB
    assert not over.ok and f"exceeds {0.9 * 32:.1f} GiB of V100 SXM2 32GB" in over.problems[0], over.problems
