"""Pretraining entry point.

    deepspeed train/pretrain.py --ds_config ds_configs/<file>.json [--key value ...]
    python    train/pretrain.py --ds_config ds_configs/cpu_debug.json [--key value ...]

Options: `python train/pretrain.py --help`; `--dry-run [--world_size N] [--gpu a100]` checks a
configuration for another world size and GPU and estimates memory (train/dry_run.py). Everything
is checked before the process group starts; then: build encoder + objective, DeepSpeed engine,
resume (also on another world size), loop (stopping with a checkpoint on SIGUSR1: requeue),
final checkpoint, export.
"""
from __future__ import annotations

if __name__ == "__main__":  # before the heavy imports below: a stop signal from now on waits for the loop
    from train import early_signals

    early_signals.catch_stop_signals()

import json
import logging
import random
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from data.faults import CorruptDataError, ShardIndexError
from data.shards import ShardSet
from data.source import build_source, check_source, fixed_images, nominal_epoch_size, train_shards
from data.split import LabeledSplit
from kernels.accelerators import describe as describe_accelerators
from kernels.attention import describe_paths
from model.interop import load_into_objective
from model.objectives import build_objective
from model.registry import create_model
from model.timm_backbone import TimmBackbone
from train import checkpoint, code_version, distributed
from train.config import (
    ConfigError,
    PretrainConfig,
    check_objective_fits,
    encoder_img_size,
    help_text,
    parse_args,
    to_dict,
)
from train.ds_config import BatchPlan, activation_checkpointing, precision, resolve
from train.evaluate import classification_accuracy
from train.loop import LoopState, run
from train.nonfinite import NonFiniteError, skip_nonfinite_steps
from train.optim import WarmupCosineSchedule, build_optimizer, build_param_groups
from train.preemption import StopSignal, requeue_job
from train.run_dir import Reporter, check_run_folder, write_run_files
from train.visualize import write_figures

log = logging.getLogger("pretrain")


def build_encoder(cfg: PretrainConfig):
    overrides = {"in_chans": cfg.model.in_chans, "attn_backend": cfg.model.attn_backend, "rpe": cfg.model.rpe,
                 "global_pool": cfg.model.global_pool, "drop_path_rate": cfg.model.drop_path_rate}
    if cfg.model.img_size:
        overrides["img_size"] = cfg.model.img_size
    section = getattr(cfg, cfg.objective)
    if hasattr(section, "encoder_overrides"):  # e.g. MAE+/AdPE: iRPE in every block
        overrides.update(section.encoder_overrides())
    return create_model(cfg.model.name, **overrides)


def labeled_split(cfg: PretrainConfig) -> LabeledSplit | None:
    """The objective's split of the labeled training shards (MLO-MAE's D_tr / D_val), if it has one."""
    section = getattr(cfg, cfg.objective)
    return LabeledSplit(*section.data_split()) if hasattr(section, "data_split") else None


def schedule_steps(cfg: PretrainConfig, plan: BatchPlan) -> tuple[int, int, float]:
    """(steps per epoch, total schedule steps, warmup steps), all in optimizer steps."""
    epoch_size = nominal_epoch_size(cfg.data, labeled_split(cfg))
    per_epoch = epoch_size // plan.global_batch
    if per_epoch < 1:
        raise ConfigError(f"the epoch ({epoch_size} samples) is smaller than the global batch {plan.global_batch}")
    return per_epoch, per_epoch * cfg.optim.epochs, per_epoch * cfg.optim.warmup_epochs


def apply_execution_options(objective: torch.nn.Module, recompute: bool, compile_blocks: bool) -> None:
    """Activation checkpointing (the ds_config's section: every transformer block recomputed in
    backward) and run.compile (torch.compile of every ViT block: one graph per block shape)."""
    from model.vit import Block

    for module in objective.modules():
        if recompute and hasattr(module, "set_grad_checkpointing"):
            module.set_grad_checkpointing(True)
        if compile_blocks and isinstance(module, Block):
            module.compile()


def profile_config(cfg: PretrainConfig, ds_config: dict, micro: int, fused_kernels: bool, value_bytes: int = 2):
    """(the configured objective built on the meta device with the ds_config's activation
    checkpointing, the profile of one micro-batch: FLOPs and activations from its token counts)."""
    from train.costs import example_batch, profile

    with torch.device("meta"):
        objective = build_objective(cfg.objective, build_encoder(cfg), getattr(cfg, cfg.objective))
        apply_execution_options(objective, activation_checkpointing(ds_config), compile_blocks=False)
        batch = example_batch(cfg.data, micro, encoder_img_size(cfg), cfg.model.in_chans)
        return objective, profile(objective, batch, fused_kernels, value_bytes)


def build_engine(cfg: PretrainConfig, ds_config: dict, device: torch.device, peak_lr: float,
                 warmup_steps: float, total_steps: int):
    """Encoder + objective (identical initial weights on every rank), AdamW, schedule, engine."""
    import deepspeed

    torch.manual_seed(cfg.seed)
    objective = build_objective(cfg.objective, build_encoder(cfg), getattr(cfg, cfg.objective))
    if cfg.model.init_from:
        try:
            state = None
            if Path(cfg.model.init_from).is_dir():  # a run folder / checkpoint tag of ours: encoder (+ MAE decoder)
                from train.export import pretrained_state

                state = pretrained_state(checkpoint.find_resume(cfg.model.init_from, Path(cfg.model.init_from)))
            log.info(load_into_objective(objective, cfg.model.init_from, state))
        except ValueError as e:
            raise ConfigError(f"model.init_from: {e}") from None
    apply_execution_options(objective, activation_checkpointing(ds_config), cfg.run.compile)
    groups, split = build_param_groups(objective, cfg.optim.weight_decay, cfg.optim.layer_decay)
    optimizer = build_optimizer(groups, cfg.optim, device.type == "cuda")
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 0 and precision(ds_config) == "fp32":
        optimizer = skip_nonfinite_steps(optimizer)  # the one engine without DeepSpeed's own check
    scheduler = WarmupCosineSchedule(optimizer, peak_lr, cfg.optim.min_lr, warmup_steps, total_steps)
    engine, _, _, _ = deepspeed.initialize(model=objective, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    return engine, objective, split


def check_resume_compatible(meta: dict, cfg: PretrainConfig, plan: BatchPlan) -> None:
    """The checkpoint (its complete.json) must come from the same model and objective; on another
    world size it must have trained with the same global batch (the schedule counts its steps)."""
    if meta["world_size"] != plan.world:
        was = meta.get("global_batch")
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
            raise ConfigError(f"--resume: the checkpoint was trained with {key}={saved.get(key)}, this run has {now[key]}")


def main(argv: list[str] | None = None) -> Path:
    from train.early_signals import catch_stop_signals

    catch_stop_signals()  # SIGUSR1 / SIGTERM during start-up: acted on at the loop's first stop check
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__ + "\n" + help_text())
        raise SystemExit(0)
    if "--dry-run" in argv:  # check for a world size and GPU, estimate memory; start nothing
        from train.dry_run import main as dry_run

        raise SystemExit(dry_run(argv))
    cfg = parse_args(argv)
    # Everything below up to distributed.init() rejects bad input before any process group starts.
    ds_config, plan = resolve(cfg, distributed.world_size_from_env())
    check_objective_fits(cfg, plan.micro, plan.accum, ds_config.get("zero_optimization", {}).get("stage", 0))
    try:
        check_source(cfg.data, plan.world, cfg.model.in_chans)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    per_epoch, total_steps, warmup_steps = schedule_steps(cfg, plan)
    run_dir = Path(cfg.output_dir)
    resume_from = checkpoint.find_resume(cfg.resume, run_dir)
    if resume_from is not None:
        try:  # DeepSpeed's loader unpickles without restriction: scan the files before anything starts
            checkpoint.verify_safe(resume_from)
        except ValueError as e:
            raise ConfigError(f"--resume: {e}") from None
        resumed_meta = checkpoint.read_meta(resume_from)
        check_resume_compatible(resumed_meta, cfg, plan)
        if resumed_meta["world_size"] != plan.world and checkpoint.needs_universal(resume_from):
            ds_config["checkpoint"] = {"load_universal": True}  # partitioned optimizer state, re-laid out
    try:
        check_run_folder(run_dir, to_dict(cfg), resuming=resume_from is not None, overwrite=cfg.run.overwrite)
    except ValueError as e:
        raise ConfigError(str(e)) from None

    rank, world, device = distributed.init()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="[%(name)s] %(message)s")
    peak_lr = cfg.optim.blr * plan.global_batch / 256
    engine, objective, split = build_engine(cfg, ds_config, device, peak_lr, warmup_steps, total_steps)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32
    # Every global RNG the objectives draw from (masking noise, drop path: torch; timm's mixup:
    # numpy) starts from the run's seed and differs across ranks; all are checkpointed.
    torch.manual_seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    encoder = objective.encoder
    if isinstance(encoder, TimmBackbone):  # timm's own attention modules (a timm ViT's blocks have no .backend)
        backend, attention_paths = encoder.attn_backend, {"dense": encoder.describe_attention()}
    else:
        attn = encoder.blocks[0].attn
        backend = attn.backend
        attention_paths = describe_paths(backend, device, dtype, encoder.num_patches + 1,
                                         encoder.embed_dim // attn.num_heads)
    if rank == 0:
        write_run_files(run_dir, to_dict(cfg), ds_config, {
            "world_size": world, "device": str(device), "precision": str(dtype).removeprefix("torch."),
            "batch": asdict(plan) | {"global": plan.global_batch}, "peak_lr": peak_lr,
            "steps_per_epoch": per_epoch, "total_steps": total_steps, "accelerators": describe_accelerators(),
            "attention_backend": backend, "attention_paths": attention_paths,
            "param_split": split, "code": code_version.describe(),  # which code ran (a submit.py snapshot?)
        })
        log.info("world %d on %s, %s, global batch %d = %d x %d x %d, peak lr %.3g, %d steps (%d/epoch)",
                 world, device, dtype, plan.global_batch, plan.micro, plan.accum, world, peak_lr, total_steps, per_epoch)
        log.info("attention: %s", "; ".join(f"{kind}: {path}" for kind, path in attention_paths.items()))
        log.info("weight decay on %d tensors (%d params), none on %d tensors (%d params)",
                 split["decay_tensors"], split["decay_params"], split["no_decay_tensors"], split["no_decay_params"])

    split, section = labeled_split(cfg), getattr(cfg, cfg.objective)
    if split is not None and rank == 0 and cfg.data.source == "shards":  # the record of D_tr / D_val
        record = split.describe(train_shards(cfg.data), cfg.data.train_index)
        (run_dir / "split.json").write_text(json.dumps(record, indent=2))
        log.info("labeled split: %d D_tr / %d D_val samples (run folder: split.json)", record["num_train"],
                 record["num_val"])
    data = build_source(cfg.data, encoder.img_size, cfg.model.in_chans, plan.micro, cfg.seed, rank,
                        world, device, split, section.val_every(plan.accum) if split is not None else 1)
    start_step = 0
    if resume_from is not None:
        client = checkpoint.load(engine, resume_from, rank, world, cfg.seed)
        start_step = client["step"]
        data.resume_from(client["data"])
        log.info("resumed from %s at step %d%s", resume_from, start_step,
                 f" (written by {len(client['data'])} ranks, continued on {world})" if len(client["data"]) != world else "")
    stop_step = min(total_steps, cfg.run.max_steps) if cfg.run.max_steps else total_steps

    ckpt_root = run_dir / "checkpoints"
    ckpt_meta = {"zero_stage": engine.zero_optimization_stage(), "objective": cfg.objective, "config": to_dict(cfg),
                 "global_batch": plan.global_batch,
                 "encoder_timm_kwargs": encoder.timm_kwargs(), "model_name": cfg.model.name}
    last_saved: list[Path] = []

    def on_checkpoint(step: int) -> None:
        client = {"step": step, "data": distributed.all_gather_object(data.state_dict())}
        last_saved[:] = [checkpoint.save(engine, ckpt_root, step, client, rank, world, ckpt_meta, cfg.run.keep_checkpoints)]

    def on_visualize(step: int) -> None:  # rank 0 only; no collectives, no global RNG draws
        if rank != 0:
            return
        module = engine.module
        module.eval()
        with torch.no_grad():
            write_figures(module, vis_images, vis_noise, run_dir / "vis", step)
        module.train()

    if rank == 0 and cfg.run.vis_every:
        img_size = encoder.img_size
        vis_images = fixed_images(cfg.data, img_size, cfg.model.in_chans).to(device, dtype)
        vis_noise = torch.rand(len(vis_images), encoder.num_patches, generator=torch.Generator().manual_seed(0))
        vis_noise = vis_noise.to(device)

    reporter = Reporter(run_dir, start_step, stop_step, cfg.run.tensorboard, cfg.run.progress) if rank == 0 else None
    on_evaluate = None
    if cfg.data.eval_index:  # classification objectives: top-1/top-5 on every rank's share of the shards
        eval_shards = ShardSet.from_index(cfg.data.eval_index, cfg.data.allow_pipe_urls)

        def on_evaluate(step: int) -> None:
            module = engine.module
            module.eval()
            result = classification_accuracy(module.predict, eval_shards, encoder.img_size,
                                             cfg.data.eval_crop_pct, rank, world, device, dtype,
                                             num_workers=cfg.data.num_workers)
            module.train()
            if reporter is not None:
                reporter.log_eval(step, result)
                (run_dir / "eval.json").write_text(json.dumps({"step": step, **result}, indent=2))

    state = LoopState(start_step, stop_step, cfg.run.log_every, cfg.run.ckpt_every, plan.global_batch,
                      cfg.run.vis_every, cfg.run.eval_every, cfg.run.max_nonfinite_steps)
    stop = StopSignal(cfg.run.stop_check_every, device)  # SIGUSR1 / SIGTERM: checkpoint, (requeue), exit
    stopped = run(engine, data, state, device, dtype, reporter.log if reporter else lambda step, metrics: None,
                  on_checkpoint, on_visualize, on_evaluate, stop.should_stop)
    if reporter is not None:
        reporter.close()
    if stopped:
        log.info("stopped on a signal at step %d after writing %s", state.step, last_saved[0])
        if rank == 0 and stop.requeue:
            log.info(requeue_job())
        distributed.barrier()
        return run_dir
    if rank == 0 and cfg.run.export and last_saved:
        from train.export import export_checkpoint

        out = export_checkpoint(last_saved[0], run_dir / "encoder.safetensors")
        log.info("exported encoder to %s", out)
    distributed.barrier()
    return run_dir


def cli(main_fn) -> None:
    """Run an entry point; a configuration problem exits with status 2 and a one-line message; a
    run stopped by what it detected (diverged: train/nonfinite.py; too much corrupt data:
    data/faults.py) with status 3, its last checkpoint kept."""
    try:
        main_fn()
    except (ConfigError, FileNotFoundError, ShardIndexError) as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (NonFiniteError, CorruptDataError) as e:
        print(f"training stopped: {e}", file=sys.stderr)
        raise SystemExit(3) from None


if __name__ == "__main__":
    try:
        cli(main)
    finally:  # ending with its own status: a SIGTERM during Python's shutdown (srun --kill-on-bad-exit
        early_signals.ignore_stop_signals()  # after another rank failed) must not turn exit 2 into 143
