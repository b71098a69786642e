"""The memory estimate's model states (train/estimate/memory.py) against what the engine really allocates:
train/engine/ builds MAE on CPU and every tensor it holds is counted, for each precision on one
rank (whole weights); the sharded stages' shares follow FSDP2's layout."""
import json

import pytest
import torch
from conftest import REPO

from train.config.ds_config import resolve
from train.config.errors import ConfigError
from train.config.parsing import parse_args
from train.estimate.memory import largest_layer, model_states
from train.run.build import build_engine


def size(t) -> int:
    return t.numel() * t.element_size()


def engine_bytes(engine) -> dict[str, int]:
    """Bytes of what the engine holds: the module's parameters, the fp32 masters where separate,
    the gradient sums, the optimizer's state tensors."""
    module = sum(size(p) for p in engine.module.parameters())
    masters = sum(size(m) for m in engine.masters) if engine.low_precision else 0
    grads = sum(size(m.grad) for m in engine.masters if m.grad is not None)
    optimizer = sum(size(v) for t in engine.masters for v in engine.optimizer.state[t].values() if v.ndim)
    return {"weights": module + masters, "gradients": grads, "optimizer": optimizer}


@pytest.mark.parametrize("precision,stage", [("fp32", 0), ("bf16", 0), ("bf16", 2), ("fp32", 3)])
def test_model_states_are_what_the_engine_allocates_on_one_rank(tmp_path, precision, stage):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cfg = parse_args(["--ds_config", str(tmp_path / "ds.json"), "--config", str(REPO / "train/configs/mae/debug.json")])
    final, _ = resolve(cfg, 1)
    engine, objective, _ = build_engine(cfg, final, torch.device("cpu"), 1e-3, 1, 10)
    # one step: the gradients exist (fp32 trains in the parameters' own .grad)
    engine.backward(engine({"image": torch.randn(2, 1, 28, 28).to(engine.dtype)})["loss"])
    trained = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    params = sum(p.numel() for p in objective.parameters())
    want = model_states(params, trained, largest_layer(objective), precision, stage, 1)
    real = engine_bytes(engine)
    assert real == {"weights": want.weights, "gradients": want.gradients, "optimizer": want.optimizer}
    w = 2 if precision == "bf16" else 4
    assert want.extra_gradients == (w * trained if precision == "bf16" else 0)  # autograd's 16-bit ones


def test_sharded_stages_divide_what_they_shard():
    P, psi, L = 1000, 900, 100
    z0 = model_states(P, psi, L, "bf16", 0, 8)
    z1, z2, z3 = (model_states(P, psi, L, "bf16", s, 8) for s in (1, 2, 3))
    assert z0.optimizer == 8 * psi and z1.optimizer == z2.optimizer == z3.optimizer == 8 * psi / 8
    assert z0.weights == 2 * P + 4 * psi and z1.weights == z2.weights == 4 * P / 8 + 2 * P  # gathered through the step
    assert z3.weights == 4 * P / 8 + 2 * 2 * L  # a gathered unit and the prefetched next
    assert z1.gradients == z2.gradients == 4 * psi / 8
    assert model_states(P, psi, L, "bf16", 1, 8, accum=2).gradients == 4 * psi / 8 + 2 * psi  # unsynced sums, bf16
    assert model_states(P, psi, L, "bf16", 1, 8, accum=2, reduce="fp32").gradients == 4 * psi / 8 + 4 * psi
    summed_in_fp32 = model_states(P, psi, L, "bf16", 1, 8, accum=2, accumulate="fp32")
    assert summed_in_fp32.gradients == 4 * psi / 8 + 4 * psi  # data_types.grad_accum_dtype fp32
    assert summed_in_fp32.extra_gradients == (2 + 4 + 2) * L  # FSDP2's fp32 input and the bf16 copy it sends
    assert model_states(P, psi, L, "bf16", 2, 8, accum=2, accumulate="fp32") == z2  # ZeRO-2 sums shards in fp32
    assert model_states(P, psi, L, "bf16", 3, 1) == z0  # one rank: nothing to shard


def test_sharded_stages_hold_one_units_gradients_in_the_compute_and_the_reduce_dtype():
    """ZeRO 1-3: (w + r) L, a unit's gradients from autograd (w bytes) and in its reduce-scatter (r)."""
    P, psi, L = 1000, 900, 100
    for stage in (1, 2, 3):
        assert model_states(P, psi, L, "bf16", stage, 8).extra_gradients == (2 + 2) * L
        assert model_states(P, psi, L, "bf16", stage, 8, reduce="fp32").extra_gradients == (2 + 4) * L
        assert model_states(P, psi, L, "fp32", stage, 8).extra_gradients == (4 + 4) * L


def test_the_largest_unit_is_a_block_or_what_sits_outside_the_blocks():
    """A ViT block: qkv 3 D^2 + 3 D, proj D^2 + D, fc1 4 D^2 + 4 D, fc2 4 D^2 + D, two LayerNorms 4 D.
    ViT-B's root (patch embedding, cls, norm) is smaller than a block; a big head makes it the largest."""
    from model.registry import create_model

    with torch.device("meta"):
        vit_b = create_model("vit_base_patch16")
    D = 768
    assert largest_layer(vit_b) == 12 * D * D + 13 * D
    torch.manual_seed(0)
    debug = create_model("vit_debug_patch4")  # width 32, depth 2
    headed = torch.nn.ModuleDict({"encoder": debug, "head": torch.nn.Linear(32, 1000)})
    D = 32
    root = sum(p.numel() for p in headed.parameters()) - 2 * (12 * D * D + 13 * D)
    assert root > 12 * D * D + 13 * D and largest_layer(headed) == root


def test_the_largest_micro_batch_fits_beside_everything_that_does_not_grow_with_it():
    from train.estimate.gpus import GPU
    from train.estimate.memory import GIB, HEADROOM, OUTSIDE_BYTES, MemoryEstimate

    gpu = GPU("test", 16, bf16=True, sm80=True, peak_tflops=100, capability="8.0")
    parts = dict(weights=3 * GIB, gradients=GIB, optimizer=2 * GIB, extra_gradients=GIB, buffers=GIB // 2)
    outside_params, per_sample = 50_000_000, 100 * 2**20

    def mem(micro):
        return MemoryEstimate(1, 1, 1, **parts, outside_params=outside_params, activations=micro * per_sample,
                              activations_per_sample=per_sample, profile=None)

    fixed = sum(parts.values()) + OUTSIDE_BYTES * outside_params  # 7.5 GiB + 0.75 GiB, not only the 6 of model states
    n = mem(1).largest_micro(gpu)
    assert n == int((HEADROOM * 16 * GIB - fixed) // per_sample) > 0
    assert mem(n).fits(gpu) and not mem(n + 1).fits(gpu)


def test_buffers_are_the_modules_registered_buffers():
    """MAE+ with AdPE's relative positions (debug ViT: N = 49 patches, T = 50 tokens): each of the 3
    blocks' rpe holds its (T, T) int64 bucket ids and (N, N, 2) float offsets, the objective its
    (N, 2) float grid coordinates: the engines cast the float ones to the compute dtype (fp32 and
    bf16 here), the integer ones keep their size."""
    from train.estimate.gpus import gpu_named
    from train.estimate.memory import estimate

    cfg = parse_args(["--ds_config", str(REPO / "ds_configs/cpu_debug.json"),
                      "--config", str(REPO / "train/configs/maeplus/debug.json"),
                      "--config", str(REPO / "train/configs/maeplus/variants/rpe_coord.json")])
    final, plan = resolve(cfg, 1)
    N, T, blocks = 49, 50, 3  # 2 encoder blocks, 1 decoder block
    for prec, value_bytes in (("fp32", 4), ("bf16", 2)):
        ds = {**final, "bf16": {"enabled": prec == "bf16"}}
        assert estimate(cfg, ds, plan, gpu_named("a100")).buffers == (
            blocks * (8 * T * T + value_bytes * N * N * 2) + value_bytes * N * 2), prec


def test_a_steps_floor_is_what_the_debug_vit_certainly_holds(monkeypatch):
    from train.estimate.memory import check_floor, step_floor

    cfg = parse_args(["--ds_config", str(REPO / "ds_configs/cpu_debug.json"), "--config",
                      str(REPO / "train/configs/mae/debug.json")])  # 28 px, patch 4, width 32, depth 2, 1 channel
    assert step_floor(cfg, 8, "fp32") == {"images": 8 * 28 * 28 * 4, "patch embeddings": 8 * 49 * 32 * 4,
                                         "position table": 50 * 32 * 4, "block weights": 2 * 12 * 32 * 32 * 4}
    bf16 = step_floor(cfg, 8, "bf16")
    assert bf16["images"] == 8 * 28 * 28 * 2 and bf16["patch embeddings"] == 8 * 49 * 32 * 2
    # the optimizer's fp32 masters stay under bf16: the blocks' weight matrices (qkv, proj, fc1, fc2), 4 bytes each
    from model.registry import create_model

    vit = create_model(cfg.model.name, in_chans=1)
    matrices = sum(p.numel() for p in vit.blocks.parameters() if p.ndim == 2)  # 12 d^2 a block
    assert bf16["block weights"] == 4 * matrices and bf16["position table"] == (49 + 1) * 32 * 4
    cfg.model.img_size, cfg.data.train_transform = 56, "multicrop"  # 4 crops of 56 px: 196 patches each
    assert step_floor(cfg, 2, "fp32")["patch embeddings"] == 2 * 4 * 196 * 32 * 4
    final, plan = resolve(cfg, 1)
    need = sum(step_floor(cfg, plan.micro, "fp32").values())
    check_floor(cfg, final, plan, need, "a machine of exactly that much")
    with pytest.raises(ConfigError, match=r"a step needs at least 0\.0 GiB per rank \(images 0\.0, .*\), more than "
                                          r"the 0\.0 GiB of a smaller one: lower model.img_size"):
        check_floor(cfg, final, plan, need - 1, "a smaller one")
    monkeypatch.setattr("train.estimate.memory.torch.cuda.is_available", lambda: False)  # the command's start on a CPU
    monkeypatch.setattr("train.estimate.memory.os.sysconf", lambda name: {"SC_PHYS_PAGES": 16, "SC_PAGE_SIZE": 4096}[name])
    with pytest.raises(ConfigError, match="GiB of this machine's memory"):
        check_floor(cfg, final, plan)


def test_mlomaes_masking_network_and_head_are_counted_as_what_they_hold():
    """MLO-MAE's C and T train beside the engine (fp32, whole on every rank): the estimate counts
    their weights, AdamW moments and gradients, 16 bytes a parameter, in what does not grow with
    the micro-batch."""
    from train.estimate.dry_run import check
    from train.estimate.gpus import gpu_named
    from train.estimate.memory import OUTSIDE_BYTES

    ds = REPO / "ds_configs" / "mlomae_vit_b_8xa100_bf16_zero1.json"
    cfg = parse_args(["--ds_config", str(ds), "--config", str(REPO / "train/configs/mlomae/vit_b.json"),
                      "--data.source", "synthetic"])
    gpu = gpu_named("a100")
    mem = check(cfg, 8, gpu).memory
    d, n, hidden = 768, 196, cfg.mlomae.mask_hidden  # Appendix B.2: Linear(N d, hidden), ReLU, Linear(hidden, N)
    want = (n * d * hidden + hidden) + (hidden * n + n) + (d * cfg.mlomae.num_classes + cfg.mlomae.num_classes)
    assert mem.outside_params == want and mem.outside == OUTSIDE_BYTES * want
    assert mem.outside > 1.1 * 2**30  # more than the encoder's whole model states on 8 ranks
    assert mem.fixed == mem.model_states + mem.extra_gradients + mem.buffers + mem.outside
    assert mem.table()["outside the engine"] == round(mem.outside / 2**30, 2)


def test_the_bytes_counted_per_outside_parameter_are_what_mlomae_holds():
    """After an AdamW step of C and T: fp32 weights and two moments (12 bytes a parameter); their
    gradients (4 more) live through each step, so the estimate's 16 is the step's peak."""
    from model.objectives import build_objective
    from model.objectives.mlomae import Auxiliary
    from model.registry import create_model
    from train.config.options import section
    from train.estimate.memory import OUTSIDE_BYTES

    cfg = parse_args(["--ds_config", str(REPO / "ds_configs/cpu_debug.json"), "--config",
                      str(REPO / "train/configs/mlomae/debug.json"), "--data.source", "synthetic"])
    objective = build_objective("mlomae", create_model(cfg.model.name, in_chans=cfg.model.in_chans), section(cfg))
    aux = objective.aux
    for module, opt in ((aux.mask_net, aux.mask_opt), (aux.head, aux.head_opt)):
        Auxiliary.step(module, opt, [torch.ones_like(p) for p in module.parameters()], 1e-3)
    params = objective.outside_parameters()
    held = sum(size(p) for p in params) + sum(size(v) for opt in (aux.mask_opt, aux.head_opt)
                                              for state in opt.state.values() for v in state.values() if v.ndim)
    n = sum(p.numel() for p in params)
    assert held == (OUTSIDE_BYTES - 4) * n and all(p.dtype == torch.float32 for p in params)
