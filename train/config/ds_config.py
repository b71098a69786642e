"""Load, check and complete a DeepSpeed JSON before any process group starts.

The JSON owns batch sizes, precision, ZeRO stage and gradient clipping: what the engine reads
(train/engine/). Every other key is checked by train/config/ds_keys.py (typos, DeepSpeed's own
validation of its sections, settings the engine does not implement). Optimizer and scheduler
come from the run options (one source of truth), so those DeepSpeed sections are rejected rather
than silently overridden.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from data.cli import InputError, read_json
from train.config.device_checks import check_kernels, this_device
from train.config.ds_keys import check_keys, check_values, did_you_mean
from train.config.errors import ConfigError
from train.config.options import PretrainConfig
from train.config.values import shown


@dataclass(frozen=True)
class BatchPlan:
    micro: int  # samples per rank per forward
    accum: int  # micro-batches per optimizer step
    world: int  # data-parallel ranks

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world


def zero_stage(ds: dict) -> int:
    """The ZeRO stage a DeepSpeed JSON asks for (0 when it has no zero_optimization section)."""
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def load(path: str) -> dict:
    """The ds_config at `path`: a JSON object whose values the engine reads are of their types and
    inside their ranges (train/config/ds_keys.py); its keys are checked by `resolve`."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"ds_config {path!r} does not exist; pass a file from ds_configs/")
    try:
        ds = read_json(p, "ds_config")  # a folder, an unreadable or non-UTF-8 file, a key given twice: one line
    except InputError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(ds, dict):
        raise ConfigError(f"ds_config {path!r} holds a JSON {type(ds).__name__}, not an object of DeepSpeed "
                          f'settings (e.g. {{"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, '
                          f'"gradient_clipping": 0.0}})')
    check_values(ds)
    return ds


def resolve_batch(ds: dict, world: int) -> BatchPlan:
    """DeepSpeed's rule train_batch = micro * accum * world, with any two of three given."""
    tb, mb, ga = (None if ds.get(k) is None else int(ds[k])  # 8.0 is 8 (train/config/ds_keys.py check_values)
                  for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))
    if mb is not None and ga is not None:
        if tb is not None and tb != mb * ga * world:
            raise ConfigError(
                f"ds_config batch sizes contradict the world size: train_batch_size {tb} != micro {mb} x "
                f"accumulation {ga} x {world} ranks = {mb * ga * world}. Keep the global batch by removing "
                f"gradient_accumulation_steps (it is then derived), or let the batch follow the world size by "
                f"removing train_batch_size"
            )
        return BatchPlan(mb, ga, world)
    if tb is not None and mb is not None:
        if tb % (mb * world):
            raise ConfigError(f"ds_config train_batch_size {tb} is not divisible by micro batch {mb} x {world} ranks; "
                              f"{batch_fixes(tb, mb, world)}")
        return BatchPlan(mb, tb // (mb * world), world)
    if tb is not None and ga is not None:
        if tb % (ga * world):
            raise ConfigError(f"ds_config train_batch_size {tb} is not divisible by accumulation {ga} x {world} ranks")
        return BatchPlan(tb // (ga * world), ga, world)
    raise ConfigError(
        "ds_config must give two of train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps"
    )


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return sorted({*small, *(n // i for i in small)})


def micro_batches_keeping(total: int, world: int, largest: int, count: int = 3) -> list[int]:
    """Up to `count` micro-batches, largest first and at most `largest`, that split the global batch
    `total` over `world` ranks in whole accumulation steps (none when `world` does not divide it)."""
    if total % world:
        return []
    return [m for m in reversed(divisors(total // world)) if m <= largest][:count]


def batch_fixes(total: int, micro: int, world: int) -> str:
    """How to run the global batch `total` of a file whose micro-batch `micro` does not fit `world`
    ranks. The global batch is the recipe's (the lr is derived from it), so the fixes that keep it
    come first: a smaller micro-batch (the file's is sized to the GPU's memory) with more
    accumulation, else a world size that divides it; a new global batch is the last resort.
    The lr is blr x global batch / 256, hence "the lr follows it"."""
    if micros := micro_batches_keeping(total, world, micro):
        options = [f"{m} (accumulation {total // (m * world)})" for m in micros]
        listed = options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"
        return (f"keep the recipe's global batch {total} (the lr follows it) by setting "
                f"train_micro_batch_size_per_gpu to {listed}")
    fewer = max(d for d in divisors(total) if d < world)  # 1 at least: world > 1 here, as 1 divides any total
    more = min((d for d in divisors(total) if d > world), default=None)
    worlds = " or ".join(str(w) for w in (fewer, more) if w is not None)
    below, above = total // world * world, (total // world + 1) * world
    batches = " or ".join(str(b) for b in (below, above) if b > 0)
    return (f"no micro-batch splits {total} over {world} ranks: keep the recipe's global batch on {worlds} ranks, "
            f"or change the recipe to a train_batch_size that {world} ranks split, e.g. {batches} (the lr follows it)")


def precision(ds: dict) -> str:
    fp16 = ds.get("fp16", {}).get("enabled", False)
    # DeepSpeed's two spellings: it reads `bfloat16` (the old name) only where `bf16` is absent
    given = {name: bool(ds[name].get("enabled", False)) for name in ("bf16", "bfloat16") if name in ds}
    if len(set(given.values())) > 1:
        raise ConfigError(f"ds_config gives bf16.enabled {str(given['bf16']).lower()} and bfloat16.enabled "
                          f"{str(given['bfloat16']).lower()}; "
                          f"DeepSpeed reads only bf16 when both are there (bfloat16 is its old name): remove bfloat16")
    bf16 = any(given.values())
    if fp16 and bf16:
        raise ConfigError("ds_config enables both fp16 and bf16; enable at most one")
    return "fp16" if fp16 else "bf16" if bf16 else "fp32"


REDUCE_DTYPES = ("fp32", "bf16", "fp16")


def reduce_dtype(ds: dict) -> str:
    """The dtype gradients are reduced in over ranks: `communication_data_type` (fp32 | bf16 | fp16),
    by default DeepSpeed's for the precision (its engine's `communication_data_type`): the compute
    dtype, i.e. bf16 for bf16 training, fp16 for fp16, fp32 for fp32."""
    value = ds.get("communication_data_type")
    if value is None:
        return precision(ds)
    if not isinstance(value, str) or value.lower() not in REDUCE_DTYPES:
        raise ConfigError(f"ds_config communication_data_type {value!r} is not one of {', '.join(REDUCE_DTYPES)} "
                          f"(the dtype gradients are reduced in; leave it out for the compute dtype, as DeepSpeed does)")
    return value.lower()


# DeepSpeed's spellings of a data_types dtype (its DtypeEnum), by our name
ACCUM_SPELLINGS = {"fp32": ("fp32", "float32", "float", "torch.float32"),
                   "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
                   "fp16": ("fp16", "float16", "half", "torch.float16")}


def grad_accum_dtype(ds: dict) -> str:
    """The dtype a step's micro-batch gradients are summed in before they are reduced:
    `data_types.grad_accum_dtype`, by default the compute dtype, as DeepSpeed's. It matters under
    ZeRO-1 with accumulation, whose earlier micro-batches add up unsharded before the one
    reduce-scatter: `"fp32"` sums them in fp32 and still communicates in `communication_data_type`
    (DeepSpeed's BF16_Optimizer for bf16 ZeRO-1). The other engines sum micro-batches in fp32
    whatever it says (train/engine/config.py describe)."""
    section = ds.get("data_types") or {}
    value = section.get("grad_accum_dtype") if isinstance(section, dict) else None
    compute = precision(ds)
    if value is None:
        return compute
    name = next((n for n, spellings in ACCUM_SPELLINGS.items() if value in spellings), None)
    if name is None:
        raise ConfigError(f"ds_config data_types.grad_accum_dtype {value!r} is not a dtype gradients can be summed in: "
                          f"use \"fp32\" (or leave it out to sum in the compute dtype, {compute}, as DeepSpeed does)")
    if name not in (compute, "fp32"):
        raise ConfigError(f"ds_config data_types.grad_accum_dtype {value!r} is neither fp32 nor the compute dtype "
                          f"({compute}): gradients computed in {compute} are summed in {compute} or in fp32; set "
                          f"\"fp32\" or leave it out")
    return name


# DeepSpeed's activation_checkpointing section is the switch for recomputing every transformer
# block in backward (torch.utils.checkpoint on our blocks; model/ stays free of deepspeed). Its
# options belong to Megatron-style deepspeed.checkpointing, which our models do not call.
UNSUPPORTED_CHECKPOINTING = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                             "synchronize_checkpoint_boundary", "profile")


def activation_checkpointing(ds: dict) -> bool:
    """Whether the ds_config asks for activation checkpointing (its `activation_checkpointing` section)."""
    section = ds.get("activation_checkpointing")
    if section is None:
        return False
    if not isinstance(section, dict):
        raise ConfigError(f"ds_config activation_checkpointing must be an object, got {shown(section)} (the section's "
                          f"presence switches recomputation on: an empty section {{}} is enough)")
    for key in section:
        if key not in UNSUPPORTED_CHECKPOINTING + ("number_checkpoints",):
            close = did_you_mean(key, UNSUPPORTED_CHECKPOINTING + ("number_checkpoints",))
            raise ConfigError(f"ds_config activation_checkpointing.{key} is not a DeepSpeed setting"
                              f"{close} (the section's presence switches "
                              f"recomputation on: an empty section {{}} is enough)")
    on = [k for k in UNSUPPORTED_CHECKPOINTING if section.get(k)]
    if on or section.get("number_checkpoints"):
        raise ConfigError(f"ds_config activation_checkpointing sets {on or ['number_checkpoints']}, which apply to "
                          f"Megatron-style deepspeed.checkpointing; here the section only switches on recomputing every "
                          f"transformer block (torch.utils.checkpoint). Leave those options false")
    return True


FLOAT8_CAPABILITY = (8, 9)  # float8 matmuls on tensor cores: Ada and Hopper onwards


def float8_refusal(gpu_name: str, capability: tuple[int, int]) -> str | None:
    """Why run.float8 cannot run on this GPU, or None: it can."""
    if tuple(capability) >= FLOAT8_CAPABILITY:
        return None
    return (f"run.float8 needs float8 tensor cores (compute capability >= 8.9: H100, H200, L40S), but this GPU is "
            f"{gpu_name}, compute capability {capability[0]}.{capability[1]}; set run.float8 false")


def resolve(cfg: PretrainConfig, world: int, cuda: bool | None = None,
            bf16_ok: bool | None = None) -> tuple[dict, BatchPlan]:
    """Return the final ds_config (batch triple filled in) and the batch plan, or raise ConfigError.

    cuda None: this machine decides (its GPU, if any, must be one the torch build has kernels
    for: train/config/device_checks.py); cuda / bf16_ok given: the dry run's named GPU instead.
    """
    ds = load(cfg.ds_config)
    for section, owner in (("optimizer", "--optim.*"), ("scheduler", "--optim.* (warmup + cosine)")):
        if section in ds:
            raise ConfigError(f"ds_config has an '{section}' section; it is set by {owner}. Remove it from the JSON")
    check_keys(ds)  # every key takes effect or is refused (train/config/ds_keys.py)
    if "gradient_clipping" not in ds:
        raise ConfigError(
            "ds_config must state gradient_clipping explicitly (0.0 for the MAE recipe): DeepSpeed >= 0.19.3 "
            "clips at 1.0 when the key is missing"
        )
    stage = zero_stage(ds)
    prec = precision(ds)
    reduce_dtype(ds)  # refuses a communication_data_type the engine has no dtype for
    grad_accum_dtype(ds)  # refuses a data_types.grad_accum_dtype no engine sums in
    here = this_device() if cuda is None else None
    if here is not None:
        check_kernels(here)  # nothing else matters on a GPU the torch build cannot launch a kernel on
    cuda = here is not None if cuda is None else cuda
    if prec == "fp16" and not cuda:
        raise ConfigError("ds_config enables fp16, which needs CUDA GPUs; use ds_configs/cpu_debug.json (fp32) on CPU")
    if prec == "bf16" and cuda:
        if bf16_ok is None:  # emulated bf16 (torch's default answer on a V100) does not count
            bf16_ok = here.native_bf16 if here is not None else torch.cuda.is_bf16_supported(including_emulation=False)
        if not bf16_ok:
            gpu = f" (this GPU: {here.name}, compute capability {'.'.join(map(str, here.capability))})" if here else ""
            raise ConfigError(f"ds_config enables bf16, which this GPU lacks (V100 has none); use an fp16 config, "
                              f"e.g. ds_configs/*_8xv100_fp16_*.json{gpu}")
    if cfg.run.float8 and here is not None and (refusal := float8_refusal(here.name, here.capability)):
        raise ConfigError(refusal)
    if cfg.optim.name == "lars" and (stage != 0 or prec == "bf16"):
        raise ConfigError("optim.name lars needs whole per-layer tensors for its trust ratio, which ZeRO stages "
                          ">= 1 partition; use a ds_config with ZeRO stage 0 in fp32 or fp16 "
                          "(ds_configs/linprobe_8xa100_fp32_zero0.json; on CPU ds_configs/cpu_linprobe.json)")
    activation_checkpointing(ds)
    if cfg.model.attn_backend == "flash_attn" and prec == "fp32":
        # flash-attn takes fp16/bf16 only; kernels/attention.py hands it nothing else (fp32 parts of an
        # fp16/bf16 run, such as MLO-MAE's level III, go to SDPA), so in an fp32 run it would never run
        raise ConfigError("model.attn_backend flash_attn runs only in fp16/bf16, but the ds_config trains in fp32 "
                          "(every attention call would fall back to SDPA); use attn_backend sdpa, or an fp16/bf16 "
                          "ds_config")
    plan = resolve_batch(ds, world)
    final = dict(ds)
    final.update(
        train_batch_size=plan.global_batch,
        train_micro_batch_size_per_gpu=plan.micro,
        gradient_accumulation_steps=plan.accum,
    )
    return final, plan
