"""tools/deepspeed_step.py's old_defaults: the ds_config DeepSpeed's own engine ran with before
train/engine/ (overlapped, bucketed gradient reduction at every ZeRO stage that reduces gradients
in buckets; no activation checkpointing; its timers off): a pure function, no DeepSpeed needed. And
one DeepSpeedStep on a world of one rank (DeepSpeed's import is slow: one test)."""
import contextlib

import pytest

from tools.deepspeed_step import old_defaults

BUCKET = 50_000_000
GIVEN = {"train_batch_size": 8, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
         "activation_checkpointing": {"partition_activations": True},
         "zero_optimization": {"reduce_bucket_size": 1, "overlap_comm": False}}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_old_defaults_set_the_buckets_each_zero_stage_had(stage):
    ds = old_defaults({**GIVEN, "zero_optimization": {**GIVEN["zero_optimization"], "stage": stage}})
    zero = ds["zero_optimization"]
    expected = {"stage": stage}
    if stage in (1, 2):  # gradients reduced in 50M-element buckets, overlapped with the backward
        expected |= {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": BUCKET,
                     "allgather_bucket_size": BUCKET}
    elif stage == 3:  # and parameters gathered ahead, small ones kept whole
        expected |= {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": BUCKET,
                     "stage3_prefetch_bucket_size": BUCKET, "stage3_param_persistence_threshold": 100_000}
    assert zero == expected  # the file's own zero settings give way
    assert "activation_checkpointing" not in ds
    assert {k: ds[k] for k in ("train_batch_size", "bf16", "gradient_clipping")} == \
        {k: GIVEN[k] for k in ("train_batch_size", "bf16", "gradient_clipping")}
    assert ds["wall_clock_breakdown"] is False and ds["timers"] == {"throughput": {"enabled": False}}


def test_old_defaults_without_zero_settings_is_stage_0():
    ds = old_defaults({"train_batch_size": 8})
    assert ds["zero_optimization"] == {"stage": 0}


@pytest.fixture
def world_of_one():
    """A process group of one rank (DeepSpeed's engine needs one); it ends with the test, and the
    environment it and DeepSpeed set goes back."""
    import os

    import torch

    env = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


def test_one_call_is_one_optimizer_step_of_accum_micro_batches(world_of_one):
    """With gradient_accumulation_steps 2 in the ds_config, every call runs 2 micro-batches (data,
    forward, backward, engine.step each) and then the objective's hook on both: DeepSpeed's engine
    takes exactly one optimizer step per call (the census counts a call as one step)."""
    import json

    from conftest import REPO

    from data.synthetic import SyntheticImages
    from tools.deepspeed_step import DeepSpeedStep
    from train.bench import NOT_READ
    from train.config.options import encoder_img_size
    from train.config.parsing import parse_args
    from train.engine import distributed

    accum, micro, calls = 2, 2, 2
    ds = json.loads((REPO / "ds_configs" / "cpu_debug.json").read_text())
    ds.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum, train_batch_size=micro * accum)
    cfg = parse_args(["--ds_config", str(REPO / "ds_configs" / "cpu_debug.json"), "--data.source", "synthetic",
                      "--config", str(REPO / "train" / "configs" / "mae" / "debug.json")], NOT_READ)
    _, _, device = distributed.init()  # a world of 1
    data = SyntheticImages(micro, encoder_img_size(cfg), cfg.model.in_chans, 10, 0, 0, device)
    step = DeepSpeedStep(cfg, ds, data, device, 1e-3)
    hooked = []
    step.engine.module.after_optimizer_step = lambda lr, batches: hooked.append(len(batches))
    phases = []

    @contextlib.contextmanager
    def phase(name):
        phases.append(name)
        yield

    for _ in range(calls):
        step(phase)
    assert step.engine.global_steps == calls
    assert data.position == calls * accum  # micro-batches drawn
    assert phases == (["data", "forward", "backward", "step"] * accum + ["hook"]) * calls
    assert hooked == [accum] * calls
    assert step.accum == accum  # what the census counts a step's micro-batches by (tools/census.py)
