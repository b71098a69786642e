"""The memory estimate's model states (train/memory.py) against what the engine really allocates:
train/engine.py builds MAE on CPU and every buffer it holds is counted, for each ZeRO stage and
precision on one rank; the partitioned stages' shares follow the same layout on more ranks."""
import json

import pytest
import torch
from conftest import REPO

from train.build import build_engine
from train.config import parse_args
from train.ds_config import resolve
from train.memory import largest_layer, model_states


def engine_bytes(engine) -> dict[str, int]:
    """Bytes of what the engine holds: the module's trained parameters (one flat buffer), its fp32
    master copy if separate, its gradient buffers, the optimizer's state tensors."""
    def size(t):
        return t.numel() * t.element_size()

    master = 0 if engine.master.data_ptr() == engine.flat_params.data_ptr() else size(engine.master)
    grads = size(engine.flat_grads) + (size(engine.shard_grads) if engine.sharded else 0)
    optimizer = sum(size(v) for t in engine.opt_tensors for v in engine.optimizer.state[t].values() if v.ndim)
    return {"weights": size(engine.flat_params) + master, "gradients": grads, "optimizer": optimizer}


@pytest.mark.parametrize("precision,stage", [("fp32", 0), ("bf16", 0), ("bf16", 1), ("bf16", 2), ("fp32", 2)])
def test_model_states_are_what_the_engine_allocates(tmp_path, precision, stage):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cfg = parse_args(["--ds_config", str(tmp_path / "ds.json"), "--config", str(REPO / "train/configs/mae/debug.json")])
    final, _ = resolve(cfg, 1)
    engine, objective, _ = build_engine(cfg, final, torch.device("cpu"), 1e-3, 1, 10)
    trained = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    params = sum(p.numel() for p in objective.parameters())
    want = model_states(params, trained, largest_layer(objective), precision, stage, 1)
    real = engine_bytes(engine)
    padding = engine.layout.padded - trained  # the flat buffers' alignment: under 64 elements per tensor
    w = 2 if precision == "bf16" else 4
    frozen = (params - trained) * w  # fixed sin-cos tables: module weights outside the flat buffer
    assert real["weights"] + frozen == pytest.approx(want.weights, abs=padding * (w + 4))
    assert real["gradients"] == pytest.approx(want.gradients, abs=padding * 4)
    assert real["optimizer"] == pytest.approx(want.optimizer, abs=padding * 8)
    assert want.extra_gradients == w * trained  # autograd's gradients, in the compute dtype


def test_partitioned_stages_divide_what_they_partition():
    P, psi, L = 1000, 900, 100
    z0 = model_states(P, psi, L, "bf16", 0, 8)
    z1, z2, z3 = (model_states(P, psi, L, "bf16", s, 8) for s in (1, 2, 3))
    assert z0.optimizer == 8 * psi and z1.optimizer == z2.optimizer == 8 * psi / 8
    assert z0.weights == 2 * P + 4 * psi and z1.weights == 2 * P + 4 * psi / 8  # fp32 masters partitioned
    assert z1.gradients == 4 * psi + 4 * psi / 8 and z2.gradients == 2 * psi + 6 * psi / 8  # ZeRO-2: one micro-batch
    assert z3.weights == 4 * P / 8 + 4 * L and z3.optimizer == 8 * psi / 8
    assert model_states(P, psi, L, "bf16", 1, 1) == z0  # one rank: nothing to partition
