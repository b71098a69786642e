"""Check a pretraining configuration for a world size and a GPU, and estimate per-GPU memory,
without starting any process or touching a GPU.

    python -m train.pretrain --dry-run [--world_size N] [--gpu a100] --ds_config FILE [--config PRESET] [--key value ...]

Checks everything train/pretrain.py checks before it starts (options, batch arithmetic against
the world size, the objective against model, batch and ZeRO stage, shards against ranks x
workers when the index is readable here) plus what depends on the named GPU (bf16 support,
sm80 kernels) and whether the memory estimate (train/estimate/memory.py) fits it. Exit 0 when the
configuration is sound and fits, 2 otherwise, with the problems listed.

--gpu defaults to the GPU a shipped ds_config names (`..._8xa100_...`), else this machine's;
--world_size to WORLD_SIZE, else what a ds_config giving all three batch numbers implies, else 8
ranks for GPUs (one node) and 1 for CPU ranks; the first line says which and why. On several
ranks it also prints a step's communication on paper (train/estimate/scaling.py; `python -m tools.scaling`
for the assumptions and other world sizes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import attention_choice
from kernels.attention import describe_paths
from model.objectives import OBJECTIVES
from train.config.ds_config import (
    activation_checkpointing,
    float8_refusal,
    load,
    precision,
    resolve,
    zero_stage,
)
from train.config.errors import ConfigError
from train.config.flags import pop_flags
from train.config.objective_fits import check_objective_fits
from train.config.options import PretrainConfig
from train.config.parsing import parse_args
from train.config.plan import peak_lr, schedule_steps
from train.config.values import from_text
from train.engine.config import EngineConfig
from train.engine.execution import describe_blocks
from train.estimate.costs import attention_calls
from train.estimate.step_flops import training_flops
from train.estimate.gpus import GPU, current_gpu, gpu_in_filename, gpu_named
from train.estimate.memory import (
    GIB,
    HEADROOM,
    MemoryEstimate,
    check_floor,
    estimate,
    ram,
)
from train.weights.fit import check_init_from


@dataclass
class DryRun:
    world: int
    gpu: GPU | None  # None: CPU ranks
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    memory: MemoryEstimate | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def default_world(ds_config: str, gpu: GPU | None) -> tuple[int, str]:
    """(the world size checked without --world_size, where it comes from)."""
    if "WORLD_SIZE" in os.environ:
        return world_size(os.environ["WORLD_SIZE"], "WORLD_SIZE"), "WORLD_SIZE"
    ds = load(ds_config)
    tb, mb, ga = (int(ds.get(k) or 0) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                "gradient_accumulation_steps"))
    if tb and mb and ga and tb % (mb * ga) == 0:
        return tb // (mb * ga), "train_batch_size / (micro-batch x accumulation) of the ds_config"
    if gpu is None:
        return 1, "assumed: one CPU process; pass --world_size N to check N ranks"
    return 8, f"assumed: one node of 8 {gpu.name}s; pass --world_size N to check another"


def world_size(text: str, where: str = "--world_size") -> int:
    """The ranks `text` names: an integer >= 1."""
    try:
        world = from_text(int, text)
    except ValueError as e:
        raise ConfigError(f"{where} {e}: give the number of ranks to check, e.g. --world_size 8") from None
    if world < 1:
        raise ConfigError(f"{where} must be >= 1, got {world}: a run needs at least one rank (e.g. --world_size 8)")
    return world


def default_gpu(ds_config: str) -> GPU | None:
    """The GPU a shipped file names, else this machine's; None (CPU ranks) on a machine without one."""
    name = gpu_in_filename(Path(ds_config).name)
    return gpu_named(name) if name is not None else current_gpu()


def attention_line(prof, gpu: GPU, prec: str) -> str:
    """Which kernel each attention call of the run gets on `gpu`: for dense SDPA calls, the kernel
    measured for the shape (kernels/attention_choice.py); for the others, their path
    (kernels.attention.describe_paths: the math backend, restricted masks, a relative-position bias)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(prec, torch.float32)
    try:
        chosen = attention_choice.choices_for(gpu.capability, dtype)
    except ValueError as e:
        raise ConfigError(f"attention kernel table: {e}") from None
    capability = tuple(map(int, gpu.capability.split(".")))
    said = []
    for heads, tokens, head_dim, kind, backend in attention_calls(prof):
        if kind == "dense" and backend == "sdpa":
            said.append(attention_choice.describe(chosen, [(heads, tokens, head_dim)]))
        else:
            path = describe_paths(backend, torch.device("cuda"), dtype, tokens, head_dim, capability)[kind]
            said.append(f"{heads}x{tokens}x{head_dim} {kind + ': ' if kind != 'dense' else ''}{path}")
    where = f"{prec} on sm{gpu.capability.replace('.', '')}"
    return f"attention kernels ({where}; heads x tokens x head dim): {'; '.join(said)}"


def check(cfg: PretrainConfig, world: int, gpu: GPU | None) -> DryRun:
    """gpu None: CPU ranks (launchers/submit.py --gpus_per_node 0): no GPU checks, no memory estimate."""
    run = DryRun(world, gpu)
    if world < 1:
        run.problems.append(f"world size {world}: a run needs at least 1 rank")
        return run
    try:
        ds, plan = resolve(cfg, world, cuda=gpu is not None, bf16_ok=gpu.bf16 if gpu is not None else None)
    except ConfigError as e:
        run.problems.append(str(e))
        return run
    stage = zero_stage(ds)
    prec = precision(ds)
    run.lines.append(f"{world} x {gpu.name if gpu is not None else 'CPU'}: global batch {plan.global_batch} = micro {plan.micro} x accumulation "
                     f"{plan.accum} x {world} ranks; {prec}; ZeRO {stage}; offload none; activation checkpointing "
                     f"{'on' if activation_checkpointing(ds) else 'off'}")
    run.lines.append(f"engine: {EngineConfig.from_ds_config(ds).describe(world)}")
    run.lines.append(describe_blocks(cfg, ds, world, on_gpu=gpu is not None))
    if cfg.run.float8:
        run.lines.append("float8: the transformer blocks' linear layers multiply in float8 (torchao, dynamic "
                         "per-tensor scales); weights, gradients and optimizer keep their dtypes")
    if gpu is not None and cfg.model.attn_backend == "flash_attn" and not gpu.sm80:
        run.problems.append(f"model.attn_backend flash_attn needs an sm80+ GPU (FlashAttention-2); {gpu.name} has "
                            f"none: use sdpa")
    if gpu is not None and cfg.run.float8 and (
            refusal := float8_refusal(gpu.name, tuple(map(int, gpu.capability.split("."))))):
        run.problems.append(refusal)
    limit, where = (gpu.memory_gib * GIB, gpu.name) if gpu is not None else ram()  # CPU ranks: this machine's
    for checked in (lambda: check_floor(cfg, ds, plan, limit, where),  # tensors that cannot be allocated at all
                    lambda: check_objective_fits(cfg, plan.micro, plan.accum, stage),
                    lambda: check_init_from(cfg)):  # the weights' channels and sizes against the model
        try:
            checked()
        except ConfigError as e:
            run.problems.append(str(e))
    if cfg.data.source == "synthetic" or Path(cfg.data.train_index).is_file():
        try:
            from data.source import check_source

            check_source(cfg.data, world, cfg.model.in_chans)
            per_epoch, total, _ = schedule_steps(cfg, plan)
            run.lines.append(f"schedule: {per_epoch} steps per epoch, {total} steps; peak lr "
                             f"{peak_lr(cfg, plan):.3g} (blr {cfg.optim.blr:g} x "
                             f"{plan.global_batch} / 256)")
        except (ConfigError, ValueError) as e:
            run.problems.append(str(e))
    else:
        run.lines.append(f"shards not checked: {cfg.data.train_index!r} is not readable here")
    if run.problems or gpu is None:  # a configuration that cannot start has no memory to estimate; nor has a CPU
        return run
    try:
        mem = estimate(cfg, ds, plan, gpu)
    except (NotImplementedError, RuntimeError) as e:  # an objective the meta device cannot run
        run.lines.append(f"memory not estimated: the objective does not run on the meta device ({e})")
        return run
    run.memory = mem
    prof = mem.profile
    outside = f" + {mem.outside_params / 1e6:.1f}M trained outside the engine" if mem.outside else ""
    per_sample = training_flops(cfg, prof, plan.micro, plan.accum) / (plan.micro * plan.accum)
    how = ("counted: forward, backward and after-step hook" if OBJECTIVES[cfg.objective][1].counted_flops
           else "3 x forward matmuls of what trains")
    run.lines.append(f"parameters: {mem.params / 1e6:.1f}M ({mem.trainable / 1e6:.1f}M trained){outside}; per sample: "
                     f"{prof.tokens() / plan.micro:.0f} block tokens, {per_sample / 1e9:.1f} training GFLOPs ({how})")
    parts = ", ".join(f"{k} {v}" for k, v in mem.table().items())
    limit = HEADROOM * gpu.memory_gib
    run.lines.append(attention_line(prof, gpu, prec))
    run.lines.append(f"memory per GPU, estimate (GiB): {parts} of {gpu.memory_gib:g} (limit {limit:.1f}); "
                     f"largest micro-batch that fits: {mem.largest_micro(gpu)}")
    run.lines.append(f"model states {mem.model_states / GIB:.2f} GiB: weights + gradient buffers + optimizer, as the "
                     f"engine lays them out (extra gradients: autograd's in the compute dtype, or one block's before "
                     f"its reduce-scatter; train/estimate/memory.py)")
    if not mem.fits(gpu):
        run.problems.append(f"the estimate {mem.total / GIB:.1f} GiB exceeds {limit:.1f} GiB of {gpu.name}: set "
                            f"train_micro_batch_size_per_gpu to at most {mem.largest_micro(gpu)} (with "
                            f"train_batch_size given, the accumulation follows), or use a higher ZeRO stage or "
                            f"activation checkpointing")
    return run


def main(argv: list[str]) -> int:
    flags, rest = pop_flags(argv, {"--dry-run": None, "--world_size": world_size, "--gpu": str})
    world, gpu_name = flags.get("world_size"), flags.get("gpu")
    cfg = parse_args(rest)
    try:  # --gpu cpu: CPU ranks, as launchers/submit.py checks them with --gpus_per_node 0
        gpu = None if gpu_name == "cpu" else gpu_named(gpu_name) if gpu_name else default_gpu(cfg.ds_config)
    except ValueError as e:
        raise ConfigError(f"{e} (or cpu for CPU ranks)") from None
    world, why = (world, "--world_size") if world else default_world(cfg.ds_config, gpu)
    run = check(cfg, world, gpu)
    if run.memory is not None and run.world > 1:  # the objective ran on the meta device: its step's collectives too
        from train.estimate.scaling import summary_line

        run.lines.append(summary_line(cfg, load(cfg.ds_config), run.world, gpu))
    print(f"dry run of {cfg.objective} on {cfg.model.name} with {cfg.ds_config}, world size {world} ({why})")
    for line in run.lines:
        print(f"  {line}")
    for p in run.problems:
        print(f"  PROBLEM: {p}")
    print("  OK: nothing would stop this run before it starts" if run.ok else f"  {len(run.problems)} problem(s)")
    return 0 if run.ok else 2
