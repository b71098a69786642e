"""Every key of a ds_config either takes effect or is refused before start.

A ds_config is a DeepSpeed JSON; the engine (train/engine/) reads part of it. `check_keys(ds)`:
  1. top-level keys are checked against what DeepSpeed reads (`deepspeed_keys()`: the keys
     DeepSpeed's own DeepSpeedConfig looks up, recorded as it parses an empty config, plus the
     sections other parts of DeepSpeed read); an unknown key is a typo, refused with the closest
     known one ("bf_16": did you mean "bf16"?);
  2. the sections the engine reads are validated by DeepSpeed's own config classes (nested
     typos, wrong types, out-of-range values), with their messages rewritten to name the key;
  3. a DeepSpeed setting the engine does not implement is refused with the reason, unless it
     holds the value the engine behaves as anyway (AS_THE_ENGINE_DOES: contiguous_gradients
     true, the throughput timer off, ...).
Honoured the DeepSpeed way: `communication_data_type` (the gradient reduce dtype, default the
compute dtype as DeepSpeed's), `zero_optimization.overlap_comm` (either value: DDP and FSDP2 always
reduce inside the backward), `zero_optimization.reduce_bucket_size` (DDP's bucket size, ZeRO-0).
"""
from __future__ import annotations

import difflib
import functools
import os
from typing import Any

from train.config import ConfigError

# read by the engine: section -> keys (None: the whole key is read)
ENGINE_READS: dict[str, set[str] | None] = {
    "train_batch_size": None, "train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": None,
    "gradient_clipping": None, "communication_data_type": None,
    "zero_optimization": {"stage", "overlap_comm", "reduce_bucket_size"},
    "bf16": {"enabled"}, "bfloat16": {"enabled"},
    "fp16": {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale"},
    "activation_checkpointing": set(),  # its presence switches recomputation on (train/ds_config.py)
}
# DeepSpeed settings that change nothing here when they hold these values (what the engine does anyway)
AS_THE_ENGINE_DOES: dict[str, Any] = {
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True, "zero_optimization.compute_grad_norm": True,
    "wall_clock_breakdown": False, "memory_breakdown": False, "timers": {"throughput": {"enabled": False}},
    "prescale_gradients": False, "gradient_predivide_factor": 1.0, "dump_state": False,
}
OFFLOAD = ("FSDP2's CPU offload would move the sharded weights, their gradients and the optimizer step to the "
           "CPU together, and the step's device-side checks (found_inf, fp16's loss scale, the skip counters) "
           "would then read across devices every step; to fit a larger model use ZeRO-3 with activation "
           "checkpointing (ds_configs/vit_h_*_zero3_actckpt.json)")
# why a setting does not take effect, by key (the rest: "the engine does not read it")
WHY = {
    "zero_optimization.offload_optimizer": OFFLOAD,
    "zero_optimization.offload_param": OFFLOAD,
    "zero_optimization.allgather_bucket_size": "FSDP2 gathers one transformer block at a time (its own unit), not "
                                               "in buckets",
    "zero_optimization.contiguous_gradients": "DDP's buckets and FSDP2's reduce-scatter inputs are contiguous anyway",
    "steps_per_print": "the loop logs every run.log_every steps",
    "wall_clock_breakdown": "the loop measures step time itself; see tools/profile_step.py for a breakdown",
    "timers": "the loop measures throughput itself at its log steps",
    "tensorboard": "the run writes TensorBoard events itself (run.tensorboard)",
    "checkpoint": "checkpoints are the run's own (train/checkpoint.py)",
}
# read by parts of DeepSpeed other than DeepSpeedConfig's parser
OTHER_SECTIONS = {"optimizer", "scheduler", "activation_checkpointing", "flops_profiler", "autotuning", "aio"}


@functools.lru_cache(maxsize=1)
def deepspeed_keys() -> frozenset[str]:
    """The top-level keys DeepSpeed reads: those its DeepSpeedConfig looks up while parsing a
    minimal config (recorded by a dict that notes every lookup), and OTHER_SECTIONS."""
    if not _cuda():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed otherwise probes for accelerators and warns
    from deepspeed.runtime.config import DeepSpeedConfig

    class Recording(dict):
        seen: set[str] = set()

        def get(self, key, *default):
            self.seen.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            self.seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            self.seen.add(key)
            return super().__contains__(key)

    config = Recording(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_clipping=0.0)
    DeepSpeedConfig(config)
    return frozenset(Recording.seen | OTHER_SECTIONS)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def did_you_mean(key: str, known) -> str:
    """"; did you mean 'x'?" for the closest of `known`, or "" when none is close."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _section_models() -> dict[str, type]:
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config,
            "bfloat16": DeepSpeedBF16Config}


def _validate_section(name: str, section: Any) -> None:
    """DeepSpeed's own model of a section: typos (with the closest field), types, allowed values."""
    from pydantic import ValidationError

    if not isinstance(section, dict):
        raise ConfigError(f"ds_config {name!r} must be an object ({{...}}), got {section!r}")
    model = _section_models()[name]
    try:
        model(**section)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            fields = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
            raise ConfigError(f"ds_config {name}.{field} is not a DeepSpeed setting{did_you_mean(field, fields)} "
                              f"(DeepSpeed's {model.__name__})") from None
        raise ConfigError(f"ds_config {name}.{field}: {first['msg']} (got {first.get('input')!r}; DeepSpeed's "
                          f"{model.__name__})") from None


def _refuse(key: str, value: Any) -> None:
    if key in AS_THE_ENGINE_DOES and value == AS_THE_ENGINE_DOES[key]:
        return
    why = WHY.get(key, "the engine (train/engine/) does not implement it")
    raise ConfigError(f"ds_config {key} = {value!r} would not take effect: {why}. Remove it from the JSON (the "
                      f"engine reads the batch sizes, gradient_clipping, communication_data_type, "
                      f"zero_optimization.stage / overlap_comm / reduce_bucket_size, bf16 / fp16 with fp16's "
                      f"loss-scale keys and activation_checkpointing: docs/TRAINING.md)")


def check_keys(ds: dict) -> None:
    """ConfigError for the first key of `ds` that is unknown, invalid or would not take effect."""
    zero = ds.get("zero_optimization", {})
    if isinstance(zero, dict) and zero.get("reduce_bucket_size") is not None and zero.get("stage", 0) != 0:
        raise ConfigError(f"ds_config zero_optimization.reduce_bucket_size = {zero['reduce_bucket_size']!r} would not "
                          f"take effect: ZeRO stages 1-3 run on FSDP2, which reduce-scatters one transformer block "
                          f"at a time (no buckets); it sets DDP's bucket size under ZeRO stage 0. Remove it")
    known = deepspeed_keys()
    for key, value in ds.items():
        if key not in known and key not in ENGINE_READS:
            raise ConfigError(f"ds_config key {key!r} is not a DeepSpeed setting{did_you_mean(key, known | set(ENGINE_READS))}")
        if key in _section_models():
            _validate_section(key, value)
        reads = ENGINE_READS.get(key, "not read")
        if reads == "not read":
            if key not in ("optimizer", "scheduler"):  # refused with their own message (train/ds_config.py)
                _refuse(key, value)
        elif isinstance(reads, set) and key != "activation_checkpointing":
            for sub, v in value.items():
                if sub not in reads:
                    _refuse(f"{key}.{sub}", v)
