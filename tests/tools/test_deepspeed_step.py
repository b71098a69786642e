"""tools/deepspeed_step.py's old_defaults: the ds_config DeepSpeed's own engine ran with before
train/engine/ (overlapped, bucketed gradient reduction at every ZeRO stage that reduces gradients
in buckets; no activation checkpointing; its timers off). A pure function: no DeepSpeed needed."""
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
