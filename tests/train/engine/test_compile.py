"""run.compile: every ViT block compiled as one graph per block shape, static in every dimension
(model/vit.py `Block.compile_static`), with no graph break, nothing compiled after the first step
(mask draws, steps, evaluation and figures, which run the blocks eagerly), and the eager blocks'
losses (fp32, 1e-5 relative: inductor reorders float sums); on a GPU with replicated weights the
blocks replay as CUDA graphs (asked for and marked per micro-batch here; replayed on the GPU only).
Two ranks: tests/distributed/test_engines.py."""
import json

import pytest
import torch
from conftest import CPU_DS, REPO

from model.objectives import build_objective
from model.objectives.mae import MAEConfig
from model.registry import create_model
from model.vit import Block
from train.pretrain import main
from train.run import compile_watch
from train.run.cli import cli
from train.run.folder import read_metrics


def test_each_block_shape_gets_one_graph_static_in_every_dimension(monkeypatch):
    """The graphs dynamo hands the compiler (recorded by a backend that runs them as they are): the
    encoder's and the decoder's, each with its batch, token count and width as numbers, so inductor
    tiles and fuses for known sizes; new masks reuse them, a batch of another size gets its own."""
    seen = []

    def recording(gm, example_inputs):
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        x = next(v for v in values if isinstance(v, torch.Tensor) and v.dim() == 3)  # the tokens (B, N, D), as traced
        seen.append(tuple(x.shape))
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": recording, "mode": None}))
    torch.manual_seed(0)
    objective = build_objective("mae", create_model("vit_debug_patch4", in_chans=1), MAEConfig(decoder_dim=24, decoder_depth=2,
                                                                                   decoder_heads=2))
    torch._dynamo.reset()
    for block in objective.modules():
        if isinstance(block, Block):
            block.compile_static()
    breaks = compile_watch.graph_breaks()
    for batch in (8, 8, 8, 5):  # new masks every call; then a batch of another size
        objective({"image": torch.randn(batch, 1, 28, 28)})["loss"].backward()
    assert seen == [(8, 13, 32), (8, 50, 24), (5, 13, 32), (5, 50, 24)]  # 12 kept patches + cls; 49 patches + cls
    assert all(type(d) is int for shape in seen for d in shape)
    assert compile_watch.graph_breaks() == breaks


def test_blocks_of_different_stochastic_depth_rates_share_a_graph(monkeypatch):
    """The linear rule gives each block its own drop_path rate (fine-tuning's 0.1 over 12 blocks): a
    rate dynamo took as a constant compiled a graph per block, and the ninth failed fullgraph at
    dynamo's recompile limit (8). Block 0 (rate 0: no drop path) and the rest: two graphs."""
    traced = []

    def recording(gm, example_inputs):  # one backend for every block, as inductor is
        traced.append(gm)
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": recording, "mode": None}))
    torch._dynamo.reset()
    blocks = [Block(32, 2, drop_path=rate) for rate in torch.linspace(0, 0.1, 12).tolist()]
    for block in blocks:
        block.compile_static()
    x = torch.randn(4, 17, 32, requires_grad=True)
    for _ in range(2):
        y = x
        for block in blocks:
            y = block(y)
        y.sum().backward()
    assert len(traced) == 2


def test_cuda_graphs_are_asked_for_on_cuda_with_replicated_weights_only(monkeypatch):
    """run.compile on a GPU replays the compiled blocks as CUDA graphs ("reduce-overhead") on one
    rank and on ZeRO-0; FSDP2's sharded stages compile without graphs; nothing without run.compile
    or on a CPU; and the loop starts a new generation of replays before every micro-batch."""
    from train.config.parsing import parse_args
    from train.engine.execution import apply_execution_options, uses_cuda_graphs

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    on = parse_args(["--ds_config", str(CPU_DS), "--config", "train/configs/mae/debug.json", "--run.compile", "true"])
    off = parse_args(["--ds_config", str(CPU_DS), "--config", "train/configs/mae/debug.json"])
    stage = {s: {"zero_optimization": {"stage": s}} for s in (0, 1, 3)}
    assert uses_cuda_graphs(on, stage[1], cuda, world=1) and uses_cuda_graphs(on, stage[0], cuda, world=8)
    assert not uses_cuda_graphs(on, stage[1], cuda, world=2) and not uses_cuda_graphs(on, stage[3], cuda, world=8)
    assert not uses_cuda_graphs(on, stage[0], cpu, world=1) and not uses_cuda_graphs(off, stage[0], cuda, world=1)
    modes = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: modes.append(kw) or fn)
    objective = build_objective("mae", create_model("vit_debug_patch4"), MAEConfig(decoder_depth=1))
    apply_execution_options(objective, recompute=False, compile_blocks=True, cuda_graphs=True)
    assert len(modes) == 3 and all(kw == {"dynamic": False, "fullgraph": True, "mode": "reduce-overhead"}
                                   for kw in modes)


def test_the_loop_marks_each_micro_batch_for_cuda_graphs(monkeypatch):
    from train.run.loop import LoopSettings, LoopState, run

    marks, calls = [], []

    class Engine:
        accum, cuda_graphs = 3, True
        health = type("Health", (), {"window_read": lambda self: None})()
        module = torch.nn.Linear(1, 1)

        def __call__(self, batch):
            calls.append(len(marks))  # the marks before this forward
            return {"loss": torch.zeros(())}

        def backward(self, loss): pass
        def step(self): pass
        def get_lr(self): return 0.0
        def after_optimizer_step(self, lr, batches): return {}

        def device_state(self):
            return {"skipped_steps": torch.zeros(()), "nonfinite_streak": torch.zeros(()),
                    "nonfinite_worst": torch.zeros(()), "loss_scale_collapsed": torch.zeros(())}

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    data = iter(lambda: {"image": torch.zeros(1)}, None)
    run(Engine(), data, LoopSettings(stop_step=2, log_every=2, ckpt_every=100, global_batch=3), LoopState(),
        torch.device("cpu"), torch.float32, lambda step, m: None, lambda step: None)
    assert calls == [1, 2, 3, 4, 5, 6]  # two optimizer steps of three micro-batches, each marked first


def pretrain(out, *options, ds_config=CPU_DS):
    argv = ["--ds_config", str(ds_config), "--output_dir", str(out), "--run.max_steps", "4", "--run.log_every", "1",
            "--run.tensorboard", "false", "--run.progress", "false", *options]
    try:
        cli(lambda: main(argv))
    except SystemExit as e:
        raise AssertionError(f"the run exited with status {e.code}") from None
    return [m for m in read_metrics(out) if "loss" in m and "top1" not in m]


RUNS = {  # objective -> its options beyond the debug preset (every objective run.compile takes)
    "mae": ["--config", "train/configs/mae/debug.json", "--run.vis_every", "2"],
    "mixedae": ["--config", "train/configs/mixedae/debug.json"],
    "adpe": ["--config", "train/configs/maeplus/debug.json", "--maeplus.rpe", "true", "--maeplus.adversary",
             "rpe_coord", "--maeplus.adv_eps", "20.0"],
    "mlomae": ["--config", "train/configs/mlomae/debug.json"],
}


@pytest.mark.parametrize("name", list(RUNS))
def test_a_compiled_run_takes_the_eager_steps_and_compiles_nothing_after_its_first(tmp_path, monkeypatch, name):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", "1")
    eager = pretrain(tmp_path / "eager", *RUNS[name])
    compiled = pretrain(tmp_path / "compiled", *RUNS[name], "--run.compile", "true")
    assert [m["loss"] for m in compiled] == pytest.approx([m["loss"] for m in eager], rel=1e-5)
    assert len({m["loss"] for m in eager}) > 1  # the steps changed the model
    graphs = [m["compiled_graphs"] for m in compiled]
    assert len(graphs) == 4 and graphs[0] >= 1 and set(graphs) == {graphs[0]}, graphs
    assert "compiled_graphs" not in eager[0]
    if name == "mae":  # the figures of steps 2 and 4 ran the blocks eagerly: no graph of their own
        assert sorted(p.name for p in (tmp_path / "compiled" / "vis").iterdir())


def test_compiled_blocks_recomputed_in_the_backward_take_the_eager_steps(tmp_path, monkeypatch):
    """run.compile with the ds_config's activation checkpointing: the compiled block runs again in
    the backward (torch.utils.checkpoint), with no graph of its own."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", "1")
    ds = json.loads(CPU_DS.read_text()) | {"activation_checkpointing": {}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    runs = {mode: pretrain(tmp_path / mode, "--config", "train/configs/mae/debug.json", "--run.compile",
                           str(mode == "compiled").lower(), ds_config=tmp_path / "ds.json")
            for mode in ("eager", "compiled")}
    assert [m["loss"] for m in runs["compiled"]] == pytest.approx([m["loss"] for m in runs["eager"]], rel=1e-5)
    assert {m["compiled_graphs"] for m in runs["compiled"]} == {2}  # the encoder's and the decoder's


def test_evaluation_with_a_short_last_batch_compiles_nothing(tmp_path, monkeypatch, rgb_shards, rgb_test_shards):
    """Fine-tuning with an evaluation after step 2 of 4 on shards whose 24 samples leave a short
    last batch: the log lines after the evaluation count the graphs of the first step."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", "1")
    metrics = pretrain(tmp_path / "run", "--objective", "finetune", "--model.name", "vit_debug_patch4",
                       "--finetune.num_classes", "3", "--data.train_index", str(rgb_shards), "--data.eval_index",
                       str(rgb_test_shards), "--run.eval_every", "2", "--data.num_workers", "0", "--optim.epochs", "2",
                       "--optim.warmup_epochs", "1", "--run.compile", "true")
    graphs = [m["compiled_graphs"] for m in metrics]
    assert graphs[0] >= 1 and set(graphs) == {graphs[0]}, graphs
    evaluations = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                   if "top1" in line]
    assert evaluations and evaluations[0]["step"] == 2


def _compiled_objectives() -> dict[str, list[str]]:
    """Every debug method whose objective run.compile takes (energy's double backward is refused), and
    the classifiers (fine-tuning, linear probe)."""
    from model.objectives.base import OBJECTIVES
    from tools.method_costs import DEBUG_METHODS
    from train.config.parsing import parse_args

    debug = {m: argv for m, argv in DEBUG_METHODS.items()
             if not OBJECTIVES[parse_args(["--ds_config", str(CPU_DS), *argv]).objective][1].double_backward}
    heads = {name: ["--objective", name, "--model.name", "vit_debug_patch4", f"--{name}.num_classes", "3",
                    "--data.source", "synthetic", "--data.num_classes", "3", "--data.epoch_size", "64"]
             for name in ("finetune", "linprobe")}
    return debug | heads


@pytest.mark.parametrize("method", list(_compiled_objectives()))
def test_no_logged_value_is_a_compiled_block_graphs_own_output(monkeypatch, method):
    """On one GPU the compiled blocks replay as CUDA graphs, whose outputs live in the graphs' memory
    pool and are overwritten by the next micro-batch's replay; the loop keeps the logged 0-dim values
    of a window until its log step, so none may share storage with a block graph's output (a backend
    that runs each graph as traced records its outputs). The forward's values and the hook's."""
    from train.config.options import section
    from train.config.parsing import parse_args
    from train.config.plan import build_encoder
    from train.engine.execution import apply_execution_options

    graph_outputs: list[torch.Tensor] = []

    def recording(gm, example_inputs):
        def run(*args):
            out = gm(*args)
            graph_outputs.extend(o for o in (out if isinstance(out, (tuple, list)) else (out,))
                                 if isinstance(o, torch.Tensor))
            return out
        return run

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": recording, "mode": None}))
    monkeypatch.chdir(REPO)
    cfg = parse_args(["--ds_config", str(CPU_DS), *_compiled_objectives()[method]])
    torch.manual_seed(0)
    objective = build_objective(cfg.objective, build_encoder(cfg), section(cfg))
    apply_execution_options(objective, recompute=False, compile_blocks=True)
    size, chans = objective.encoder.patch_embed.img_size, cfg.model.in_chans

    def batch():  # labels and a validation batch for the objectives that read them (MLO-MAE's levels II-III)
        return {"image": torch.randn(8, chans, size, size), "label": torch.randint(0, 3, (8,)),
                "val_image": torch.randn(8, chans, size, size), "val_label": torch.randint(0, 3, (8,))}

    for _ in range(2):  # the step that compiles and one that reuses the graphs
        graph_outputs.clear()
        batches = [batch()]
        out = objective(batches[0])
        out["loss"].backward()
        logged = {k: v for k, v in out.items() if v.ndim == 0} | objective.after_optimizer_step(1e-4, batches)
        assert graph_outputs, "no compiled block ran"
        storages = {t.untyped_storage().data_ptr() for t in graph_outputs}
        aliased = sorted(k for k, v in logged.items() if v.untyped_storage().data_ptr() in storages)
        assert not aliased, f"{method}: logged values stored in a compiled block graph's output: {aliased}"
