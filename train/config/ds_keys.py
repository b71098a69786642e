"""Every key of a ds_config either takes effect or is refused before start.

A ds_config is a DeepSpeed JSON; the engine (train/engine/) reads part of it. `check_keys(ds)`:
  1. top-level keys are checked against what DeepSpeed reads (`deepspeed_keys()`: the keys
     DeepSpeed's own DeepSpeedConfig looks up, recorded as it parses an empty config, plus those
     it reads only inside a process group and the sections other parts of DeepSpeed read); an
     unknown key is a typo, refused with the closest known one ("bf_16": did you mean "bf16"?);
  2. the sections the engine reads are validated by DeepSpeed's own config classes (nested
     typos, wrong types, out-of-range values), with their messages rewritten to name the key;
  3. a DeepSpeed setting the engine does not implement is refused with the reason, unless it
     holds the value the engine behaves as anyway (AS_THE_ENGINE_DOES: contiguous_gradients
     true, the throughput timer off, sequence_parallel_size 1, ...).
Honoured the DeepSpeed way: `communication_data_type` (the gradient reduce dtype, default the
compute dtype as DeepSpeed's), `data_types.grad_accum_dtype` (the dtype ZeRO-1's micro-batches are
summed in before their reduction), `zero_optimization.overlap_comm` (either value: DDP and FSDP2 always
reduce inside the backward), `zero_optimization.reduce_bucket_size` (DDP's bucket size, ZeRO-0).
"""
from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass
from typing import Any

from train.config.errors import ConfigError
from train.config.values import Interval, check_range, from_json, shown


@dataclass(frozen=True)
class Setting:
    """A value the engine reads: its type (bool, int, float, str), for numbers its interval
    (train/config/values.py), what it means and an example."""
    kind: type
    range: str = ""
    meaning: str = ""
    example: Any = None


# every value the engine reads ("section.key" inside a section), with its type and range
ENGINE_VALUES: dict[str, Setting] = {
    "train_batch_size": Setting(int, "[1, inf)", "samples per optimizer step over all ranks", 4096),
    "train_micro_batch_size_per_gpu": Setting(int, "[1, inf)", "samples per rank per forward", 8),
    "gradient_accumulation_steps": Setting(int, "[1, inf)", "micro-batches per optimizer step", 1),
    "gradient_clipping": Setting(float, "[0, inf)", "the largest global l2 norm of the gradients; 0 = no clipping",
                                 1.0),
    "communication_data_type": Setting(str, "", "the dtype gradients are reduced in: fp32, bf16 or fp16", "fp32"),
    "data_types.grad_accum_dtype": Setting(str, "", "the dtype micro-batch gradients are summed in: fp32 or the "
                                                    "compute dtype", "fp32"),
    "zero_optimization.stage": Setting(int, "[0, 3]", "the ZeRO stage", 1),
    "zero_optimization.overlap_comm": Setting(bool, "", "", True),
    "zero_optimization.reduce_bucket_size": Setting(int, "[1, inf)", "elements per DDP bucket under ZeRO stage 0",
                                                    500000000),
    "bf16.enabled": Setting(bool, "", "", True),
    "bfloat16.enabled": Setting(bool, "", "", True),
    "fp16.enabled": Setting(bool, "", "", True),
    # fp16's largest value is 65504 (~2**16): a scale past 2**32 overflows every step until it has halved back
    "fp16.loss_scale": Setting(float, "[0, 4294967296]", "0 = dynamic loss scaling, else this static scale", 0),
    "fp16.initial_scale_power": Setting(int, "[0, 32]", "the dynamic scale starts at 2**power", 16),
    "fp16.loss_scale_window": Setting(int, "[1, inf)", "overflow-free steps before the scale doubles", 1000),
    "fp16.hysteresis": Setting(int, "[1, inf)", "overflows tolerated before the scale halves", 2),
    "fp16.consecutive_hysteresis": Setting(bool, "", "", False),
    "fp16.min_loss_scale": Setting(float, "(0, 4294967296]", "the dynamic scale's floor", 1),
}


def _engine_reads() -> dict[str, set[str] | None]:
    """Section -> the keys of it the engine reads (None: the whole key is read)."""
    reads: dict[str, set[str] | None] = {"activation_checkpointing": set()}  # its presence switches recomputation on
    for key in ENGINE_VALUES:
        section, _, sub = key.partition(".")
        reads[section] = reads.get(section, set()) | {sub} if sub else None
    return reads


ENGINE_READS = _engine_reads()
# DeepSpeed settings that change nothing here when they hold these values (what the engine does anyway)
AS_THE_ENGINE_DOES: dict[str, Any] = {
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True, "zero_optimization.compute_grad_norm": True,
    # FSDP2 all-gathers the sharded weights; with no CPU offload there are no gradient copies to order
    "zero_optimization.allgather_partitions": True, "zero_optimization.round_robin_gradients": False,
    "sequence_parallel_size": 1,  # DeepSpeed's default (the key absent): every rank data-parallel
    "wall_clock_breakdown": False, "memory_breakdown": False, "timers": {"throughput": {"enabled": False}},
    "prescale_gradients": False, "gradient_predivide_factor": 1.0, "dump_state": False,
    # fp32 master weights, gradient sums and optimizer state (train/engine/replicated.py, sharded.py)
    "fp16.fp16_master_weights_and_grads": False,
    # every step with a non-finite gradient norm is skipped, in bf16 as in fp16 (train/engine/core.py);
    # "bfloat16" is DeepSpeed's other spelling of the section
    **{f"{section}.{key}": value for section in ("bf16", "bfloat16") for key, value in (
        ("check_grad_overflow", True), ("bf16_master_weights_and_grads", False), ("bf16_optimizer_states", False))},
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
    "zero_optimization.allgather_partitions": "FSDP2 gathers the sharded weights with all-gathers; it has no "
                                              "broadcast path to choose instead",
    "zero_optimization.round_robin_gradients": "it orders the gradient copies to the CPU under optimizer offload, "
                                               "which the engine does not do (offload_optimizer is refused)",
    "sequence_parallel_size": "the engine has no sequence parallelism: every rank is data-parallel, since a ViT's "
                              "few hundred tokens per image (197 for ViT-B/16 at 224 px) need no splitting over GPUs",
    # refused even at false, which the engine behaves as: DeepSpeed itself refuses a file that holds it
    "sparse_gradients": "DeepSpeed has removed it (the sparse reduction of embedding gradients): 0.19.8 refuses a "
                        "ds_config that holds it, at any value; the engine reduces every gradient dense",
    "steps_per_print": "the loop logs every run.log_every steps",
    "wall_clock_breakdown": "the loop measures step time itself; see tools/profile_step.py for a breakdown",
    "timers": "the loop measures throughput itself at its log steps",
    "tensorboard": "the run writes TensorBoard events itself (run.tensorboard)",
    "checkpoint": "checkpoints are the run's own (train/engine/checkpoint.py)",
    "fp16.fp16_master_weights_and_grads": "the engine keeps fp32 master weights and gradient sums",
    **{f"{section}.{key}": why for section in ("bf16", "bfloat16") for key, why in (
        ("check_grad_overflow", "the engine skips every step whose gradients are not finite"),
        ("bf16_master_weights_and_grads", "the engine keeps fp32 master weights and gradient sums"),
        ("bf16_optimizer_states", "the engine keeps the optimizer state in fp32"))},
}
# read by parts of DeepSpeed other than DeepSpeedConfig's parser
OTHER_SECTIONS = {"optimizer", "scheduler", "activation_checkpointing", "flops_profiler", "autotuning", "aio"}
# read by DeepSpeedConfig only inside a process group (it divides the world size), so the recording
# in deepspeed_keys(), parsed without one, never sees it
READ_IN_A_PROCESS_GROUP = {"sequence_parallel_size"}


@functools.lru_cache(maxsize=1)
def deepspeed_keys() -> frozenset[str]:
    """The top-level keys DeepSpeed reads: those its DeepSpeedConfig looks up while parsing a
    minimal config (recorded by a dict that notes every lookup), READ_IN_A_PROCESS_GROUP and
    OTHER_SECTIONS."""
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
    return frozenset(Recording.seen | READ_IN_A_PROCESS_GROUP | OTHER_SECTIONS)


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


def check_values(ds: dict) -> None:
    """ConfigError for the first value the engine reads that is not of its type or lies outside its
    range (a JSON string is not a number, 1 is not true, 8.5 is not an integer: train/config/values.py).
    A whole number written as a float (5e8) is an integer: the readers of integers take int() of it."""
    for key, setting in ENGINE_VALUES.items():
        section, _, sub = key.partition(".")
        holder = ds.get(section) if sub else ds
        if sub and holder is not None and not isinstance(holder, dict):
            raise ConfigError(f"ds_config {section!r} must be an object ({{...}}), got {shown(holder)}")
        if not isinstance(holder, dict) or (sub or section) not in holder:
            continue
        value = holder[sub or section]
        try:
            from_json(setting.kind, value)
            if setting.range:
                check_range(value, Interval.parse(setting.range))
        except ValueError as e:
            meaning = f" ({setting.meaning})" if setting.meaning else ""
            raise ConfigError(f"ds_config {key}{meaning} {e}; e.g. \"{sub or section}\": {shown(setting.example)}") \
                from None


def _same(value: Any, expected: Any) -> bool:
    """`value` is `expected` with its JSON type: true is not 1, 1.0 is 1 but not true."""
    if isinstance(expected, dict):
        return isinstance(value, dict) and value.keys() == expected.keys() and \
            all(_same(value[k], expected[k]) for k in expected)
    return isinstance(value, bool) == isinstance(expected, bool) and type(value) in (bool, int, float) and \
        value == expected


def _refuse(key: str, value: Any) -> None:
    if key in AS_THE_ENGINE_DOES and _same(value, AS_THE_ENGINE_DOES[key]):
        return
    why = WHY.get(key, "the engine (train/engine/) does not implement it")
    raise ConfigError(f"ds_config {key} = {value!r} would not take effect: {why}. Remove it from the JSON (the "
                      f"engine reads the batch sizes, gradient_clipping, communication_data_type, "
                      f"data_types.grad_accum_dtype, zero_optimization.stage / overlap_comm / reduce_bucket_size, "
                      f"bf16 / fp16 with fp16's loss-scale keys and activation_checkpointing: docs/TRAINING.md)")


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
            if key not in ("optimizer", "scheduler"):  # refused with their own message (train/config/ds_config.py)
                _refuse(key, value)
        elif isinstance(reads, set) and key != "activation_checkpointing":
            for sub, v in value.items():
                if sub not in reads:
                    _refuse(f"{key}.{sub}", v)
