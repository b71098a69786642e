"""Model states of the dry run's memory estimate (train/memory.py) against DeepSpeed's own
estimators, called with the parameter counts DeepSpeed's model_to_params takes from the real model."""
import json

import pytest
import torch
from conftest import REPO
from deepspeed.runtime.zero import stage3
from deepspeed.runtime.zero import stage_1_and_2 as stage12

from model.objectives import build_objective
from train.build import build_encoder
from train.config import parse_args
from train.ds_config import resolve
from train.gpus import gpu_named
from train.memory import estimate

GPUS = 8  # one node, no offload


def mae(model: str, ds_path, stage: int, tmp_path):
    """The dry run's estimate of MAE on `model` with a shipped bf16 file set to ZeRO `stage`, and
    DeepSpeed's (total params, largest layer params) of the same objective."""
    ds = json.loads(ds_path.read_text())
    ds["zero_optimization"]["stage"] = stage
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cfg = parse_args(["--ds_config", str(tmp_path / "ds.json"), "--model.name", model, "--data.source", "synthetic"])
    final, plan = resolve(cfg, GPUS, cuda=True, bf16_ok=True)
    with torch.device("meta"):
        objective = build_objective(cfg.objective, build_encoder(cfg), cfg.mae)
    objective.to_empty(device="cpu")  # real storages (model_to_params tells shared ones apart by address), unfilled
    return estimate(cfg, final, plan, gpu_named("a100")), stage3.model_to_params(objective)


@pytest.mark.parametrize("model,ds", [("vit_base_patch16", "vit_b_8xa100_bf16_zero1.json"),
                                      ("vit_large_patch16", "vit_l_8xa100_bf16_zero1.json")])
def test_model_states_agree_with_deepspeeds_estimators(model, ds, tmp_path):
    for stage in (1, 2, 3):
        mem, (total, largest) = mae(model, REPO / "ds_configs" / ds, stage, tmp_path)
        if stage == 3:
            _, want, _ = stage3.estimate_zero3_model_states_mem_needs(
                total, largest, num_gpus_per_node=GPUS, num_nodes=1, cpu_offload=False, cpu_offload_params=False)
        else:  # DeepSpeed has no ZeRO-1 estimator: its zero2 one is the convention for stage 1 too
            _, want = stage12.estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=GPUS, num_nodes=1,
                                                                    cpu_offload=False)
        states = mem.weights + mem.gradients + mem.optimizer
        assert states == pytest.approx(want, rel=0.05), (model, stage, states / want)
        assert total == mem.params and largest == mem.largest_layer
        # what DeepSpeed 0.19 holds beyond its estimators: ZeRO-1's unpartitioned bf16 gradients,
        # ZeRO-3's flat bf16 gradient partition; nothing for ZeRO-2
        assert mem.extra_gradients == {1: 2 * mem.trainable, 2: 0, 3: 2 * mem.trainable / GPUS}[stage]
        assert mem.total > states + mem.extra_gradients + mem.buffers  # activations come on top
