"""Builders of a pretraining run, shared by the entry points (train/trainer.py runs them;
train/bench.py times them; train/dry_run.py and train/memory.py check and profile them):
the encoder and objective, the engine (train/engine/), the schedule's step counts, the training
data stream, and the checks a checkpoint must pass to be resumed.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from data.source import build_source, nominal_epoch_size
from data.split import LabeledSplit
from model.hf_interop import is_transformers_folder, load_transformers_folder
from model.interop import load_into_objective
from model.objectives import build_objective
from model.registry import create_model
from train import checkpoint
from train.config import ConfigError, PretrainConfig, encoder_img_size, section, to_dict
from train.ds_config import BatchPlan, activation_checkpointing
from train import engine as engines
from train.ds_config import load as load_ds_config
from train.engine import EngineConfig
from train.optim import WarmupCosineSchedule, build_optimizer, build_param_groups

log = logging.getLogger("pretrain")


def build_encoder(cfg: PretrainConfig, arch: dict | None = None):
    """The configured encoder; `arch` overrides its registry entry's sizes (tools/census.py's narrow widths)."""
    overrides = {**(arch or {}), "in_chans": cfg.model.in_chans, "attn_backend": cfg.model.attn_backend, "rpe": cfg.model.rpe,
                 "global_pool": cfg.model.global_pool, "drop_path_rate": cfg.model.drop_path_rate}
    if cfg.model.img_size:
        overrides["img_size"] = cfg.model.img_size
    overrides.update(section(cfg).encoder_overrides())  # e.g. MAE+/AdPE: iRPE in every block
    return create_model(cfg.model.name, **overrides)


def labeled_split(cfg: PretrainConfig) -> LabeledSplit | None:
    """The objective's split of the labeled training shards (MLO-MAE's D_tr / D_val), if it has one."""
    split = section(cfg).data_split()
    return None if split is None else LabeledSplit(*split)


def peak_lr(cfg: PretrainConfig, plan: BatchPlan) -> float:
    """The schedule's peak lr: blr x global batch / 256 (the MAE recipe's scaling rule)."""
    return cfg.optim.blr * plan.global_batch / 256


def schedule_steps(cfg: PretrainConfig, plan: BatchPlan) -> tuple[int, int, float]:
    """(steps per epoch, total schedule steps, warmup steps), all in optimizer steps."""
    epoch_size = nominal_epoch_size(cfg.data, labeled_split(cfg))
    per_epoch = epoch_size // plan.global_batch
    if per_epoch < 1:
        raise ConfigError(f"the epoch ({epoch_size} samples) is smaller than the global batch {plan.global_batch} "
                          f"({plan.micro} x {plan.accum} x {plan.world} ranks), so there is no whole step in it: give "
                          f"{smaller_batch(cfg, plan, epoch_size)}, or more samples (data.epoch_size, or more shards)")
    return per_epoch, per_epoch * cfg.optim.epochs, per_epoch * cfg.optim.warmup_epochs


def smaller_batch(cfg: PretrainConfig, plan: BatchPlan, samples: int) -> str:
    """The ds_config change that makes a global batch fit in `samples`, named by the key the file sets."""
    ds = load_ds_config(cfg.ds_config) if cfg.ds_config else {}
    if "train_batch_size" in ds:
        return f"a ds_config with a train_batch_size of at most {samples}"
    most = samples // (plan.accum * plan.world)
    if most < 1:
        return f"fewer ranks or less accumulation than {plan.accum} x {plan.world} ranks"
    return f"a ds_config with a train_micro_batch_size_per_gpu of at most {most} (it sets {plan.micro})"


def training_source(cfg: PretrainConfig, img_size: int, plan: BatchPlan, rank: int, world: int,
                    device: torch.device):
    """This rank's training batches (micro-batches of `plan.micro` samples): the objective's labeled
    split, when it has one, interleaves a validation batch every `val_every(accum)` micro-batches."""
    split = labeled_split(cfg)
    return build_source(cfg.data, img_size, cfg.model.in_chans, plan.micro, cfg.seed, rank, world, device, split,
                        section(cfg).val_every(plan.accum) if split is not None else 1)


def apply_execution_options(objective: torch.nn.Module, recompute: bool, compile_blocks: bool,
                            cuda_graphs: bool = False) -> None:
    """Activation checkpointing (the ds_config's section: every transformer block recomputed in
    backward) and run.compile (torch.compile of every ViT block: one static graph per block shape,
    model/vit.py `Block.compile_static`). Compiling starts from an empty dynamo cache: every block of
    every model shares one code object, whose graphs count against dynamo's recompile limit (8), so
    a process that builds several runs (benchmarks, tests) must not carry the earlier runs' graphs;
    inductor's compiled kernels stay in its on-disk cache. `cuda_graphs`: the compiled blocks also
    replay as CUDA graphs (`uses_cuda_graphs`)."""
    from model.vit import Block

    if compile_blocks:
        torch._dynamo.reset()
    for module in objective.modules():
        if recompute and hasattr(module, "set_grad_checkpointing"):
            module.set_grad_checkpointing(True)
        if compile_blocks and isinstance(module, Block):
            module.compile_static(cuda_graphs)


def uses_cuda_graphs(cfg: PretrainConfig, ds_config: dict, device: torch.device, world: int) -> bool:
    """run.compile on a CUDA device with replicated weights (one rank, or ZeRO-0 on DDP): the compiled
    blocks replay as CUDA graphs. Measured on one H200 (docs/PERFORMANCE.md): compiled blocks without
    graphs cut the device time of a MAE ViT-B step by a fifth but made the host, calling 40 compiled
    graphs a step, slower than the device. FSDP2 (ZeRO 1-3 on several ranks) regathers each block's
    weights into storage it frees between uses, which a graph cannot keep as a fixed address, so
    sharded runs compile without graphs."""
    from train.ds_config import zero_stage

    return cfg.run.compile and device.type == "cuda" and (world == 1 or zero_stage(ds_config) == 0)


def profile_config(cfg: PretrainConfig, ds_config: dict, micro: int, fused_kernels: bool, value_bytes: int = 2):
    """(the configured objective built on the meta device with the ds_config's activation
    checkpointing, the profile of one micro-batch: FLOPs and activations from its token counts)."""
    from train.costs import example_batch, profile

    with torch.device("meta"):
        objective = build_objective(cfg.objective, build_encoder(cfg), section(cfg))
        apply_execution_options(objective, activation_checkpointing(ds_config), compile_blocks=False)
        batch = example_batch(cfg.data, micro, encoder_img_size(cfg), cfg.model.in_chans)
        return objective, profile(objective, batch, fused_kernels, value_bytes)


def build_engine(cfg: PretrainConfig, ds_config: dict, device: torch.device, peak_lr: float,
                 warmup_steps: float, total_steps: int, arch: dict | None = None):
    """Encoder + objective (identical initial weights on every rank), optimizer, schedule, engine
    (train/engine/: one rank or ZeRO-0 replicated, ZeRO-1-3 on FSDP2). Returns (engine, objective, param_split: how
    the parameters split between decay / no decay)."""
    torch.manual_seed(cfg.seed)
    objective = build_objective(cfg.objective, build_encoder(cfg, arch), section(cfg))
    if cfg.model.init_from:
        try:
            state = None
            if is_transformers_folder(cfg.model.init_from):  # config.json + weights of a transformers ViT / ViT-MAE
                log.info(load_transformers_folder(objective, cfg.model.init_from))
            else:
                if Path(cfg.model.init_from).is_dir():  # a run folder / checkpoint tag of ours: encoder (+ MAE decoder)
                    from train.export import pretrained_state

                    state = pretrained_state(checkpoint.find_resume(cfg.model.init_from, Path(cfg.model.init_from)))
                log.info(load_into_objective(objective, cfg.model.init_from, state))
        except ValueError as e:
            raise ConfigError(f"model.init_from: {e}") from None
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    cuda_graphs = uses_cuda_graphs(cfg, ds_config, device, world)
    apply_execution_options(objective, activation_checkpointing(ds_config), cfg.run.compile, cuda_graphs)
    groups, param_split = build_param_groups(objective, cfg.optim.weight_decay, cfg.optim.layer_decay)
    engine_cfg = EngineConfig.from_ds_config(ds_config)

    def make_schedule(optimizer):
        return WarmupCosineSchedule(optimizer, peak_lr, cfg.optim.min_lr, warmup_steps, total_steps)

    def make_optimizer(opt_groups):
        return build_optimizer(opt_groups, cfg.optim)

    engine = engines.build(objective, groups, make_optimizer, make_schedule, engine_cfg, device)
    engine.cuda_graphs = cuda_graphs
    return engine, objective, param_split


def check_resume_compatible(meta: dict, cfg: PretrainConfig, plan: BatchPlan) -> None:
    """The checkpoint (its complete.json) must come from the same model and objective and have
    trained with the same global batch (the schedule counts its steps; the data position is in
    samples of it)."""
    was = meta.get("global_batch")
    if meta["world_size"] == plan.world and was is not None and was != plan.global_batch:
        raise ConfigError(f"--resume: the checkpoint trained with global batch {was}, this run has {plan.global_batch} "
                          f"(same {plan.world} ranks); keep the ds_config's batch sizes, or start a new run")
    if meta["world_size"] != plan.world:
        if was is None:
            raise ConfigError(f"--resume: the checkpoint was written by {meta['world_size']} ranks, this run has "
                              f"{plan.world}, and it predates world-size changes; resume with {meta['world_size']} ranks")
        if was != plan.global_batch:
            raise ConfigError(
                f"--resume: the checkpoint trained with global batch {was} on {meta['world_size']} ranks, this run "
                f"has {plan.global_batch} on {plan.world}; keep the global batch (give train_batch_size and "
                f"train_micro_batch_size_per_gpu in the ds_config, so the accumulation follows the world size)")
    saved, now = meta["config"], json.loads(json.dumps(to_dict(cfg)))  # as stored: tuples become lists
    default = json.loads(json.dumps(to_dict(PretrainConfig())))
    for key in ("objective", "model", cfg.objective):
        was, is_ = saved.get(key), now[key]
        if isinstance(was, dict) and isinstance(is_, dict):
            # an option added to the code after the checkpoint was written counts as its default
            was = {**{k: v for k, v in default[key].items() if k not in was}, **was}
        if was != is_:
            raise ConfigError(f"--resume: the checkpoint was trained with {key}={saved.get(key)}, this run has "
                              f"{now[key]}; to continue that run, give its {key} again; to train this one from the "
                              f"checkpoint's weights, start it in another --output_dir with --model.init_from "
                              f"<the checkpoint>")


def _dotted(d: dict, prefix: str = "") -> dict:
    """Nested config dict -> {'optim.blr': value, ...} (leaves only)."""
    out: dict = {}
    for k, v in d.items():
        out.update(_dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def resume_changes(saved: dict, cfg: PretrainConfig) -> dict[str, list]:
    """Options this run sets differently from the checkpoint it resumes ({'optim.blr': [old, new]}),
    after check_resume_compatible refused those that break a resume. An option added to the code
    after the checkpoint was written counts as its default; `resume` itself is left out."""
    default = _dotted(json.loads(json.dumps(to_dict(PretrainConfig()))))
    was = {**default, **_dotted(saved)}
    now = _dotted(json.loads(json.dumps(to_dict(cfg))))  # as stored: tuples become lists
    return {key: [was.get(key), value] for key, value in now.items() if key != "resume" and was.get(key) != value}
