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
    assert model_states(P, psi, L, "bf16", 3, 1) == z0  # one rank: nothing to shard


def test_a_steps_floor_is_what_the_debug_vit_certainly_holds(monkeypatch):
    from train.estimate.memory import check_floor, step_floor

    cfg = parse_args(["--ds_config", str(REPO / "ds_configs/cpu_debug.json"), "--config",
                      str(REPO / "train/configs/mae/debug.json")])  # 28 px, patch 4, width 32, depth 2, 1 channel
    assert step_floor(cfg, 8, "fp32") == {"images": 8 * 28 * 28 * 4, "patch embeddings": 8 * 49 * 32 * 4,
                                         "position table": 50 * 32 * 4, "block weights": 2 * 12 * 32 * 32 * 4}
    assert step_floor(cfg, 8, "bf16")["images"] == 8 * 28 * 28 * 2
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
