"""Builders of a pretraining run, shared by the entry points (train/run/trainer.py runs them;
train/bench.py times them; train/estimate/dry_run.py and train/estimate/memory.py check and profile them):
the encoder and objective, the engine (train/engine/), the schedule's step counts, the training
data stream, and the checks a checkpoint must pass to be resumed.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
from pathlib import Path

import torch

from data.source import build_source
from kernels import attention_choice
from model.hf_interop import is_transformers_folder, load_transformers_folder
from model.interop import load_into_objective
from model.objectives import build_objective
from train import engine as engines
from train.config.ds_config import BatchPlan, activation_checkpointing
from train.config.errors import ConfigError
from train.config.options import PretrainConfig, section
from train.config.parsing import to_dict
from train.config.plan import build_encoder, labeled_split
from train.engine import EngineConfig, checkpoint
from train.engine.execution import apply_execution_options, uses_cuda_graphs
from train.engine.optim import WarmupCosineSchedule, build_optimizer, build_param_groups

log = logging.getLogger("pretrain")


def training_source(cfg: PretrainConfig, img_size: int, plan: BatchPlan, rank: int, world: int,
                    device: torch.device):
    """This rank's training batches (micro-batches of `plan.micro` samples): the objective's labeled
    split, when it has one, interleaves a validation batch every `val_every(accum)` micro-batches."""
    split = labeled_split(cfg)
    return build_source(cfg.data, img_size, cfg.model.in_chans, plan.micro, cfg.seed, rank, world, device, split,
                        section(cfg).val_every(plan.accum) if split is not None else 1)


def build_engine(cfg: PretrainConfig, ds_config: dict, device: torch.device, peak_lr: float,
                 warmup_steps: float, total_steps: int, arch: dict | None = None, init_weights: bool = True):
    """Encoder + objective (identical initial weights on every rank), optimizer, schedule, engine
    (train/engine/: one rank or ZeRO-0 replicated, ZeRO-1-3 on FSDP2). Returns (engine, objective, param_split: how
    the parameters split between decay / no decay). `init_weights` False (a resume, whose checkpoint
    replaces every weight): model.init_from is not read."""
    torch.manual_seed(cfg.seed)
    objective = build_objective(cfg.objective, build_encoder(cfg, arch), section(cfg))
    if cfg.model.init_from and not init_weights:
        log.info("model.init_from %s not read: the resumed checkpoint holds every weight", cfg.model.init_from)
    elif cfg.model.init_from:
        try:
            state = None
            if is_transformers_folder(cfg.model.init_from):  # config.json + weights of a transformers ViT / ViT-MAE
                log.info(load_transformers_folder(objective, cfg.model.init_from))
            else:
                if Path(cfg.model.init_from).is_dir():  # a run folder / checkpoint tag of ours: encoder (+ MAE decoder)
                    from train.weights.export import pretrained_state

                    state = pretrained_state(checkpoint.find_resume(cfg.model.init_from, Path(cfg.model.init_from)))
                log.info(load_into_objective(objective, cfg.model.init_from, state))
        except ValueError as e:
            raise ConfigError(f"model.init_from: {e}") from None
    try:  # before compiling: the blocks' graphs trace the chosen kernels in
        measured = attention_choice.activate(device)
    except ValueError as e:
        raise ConfigError(f"attention kernel table: {e}") from None
    if measured:
        log.info("attention: %d shapes run the kernel measured fastest on this GPU (%s)", measured,
                 attention_choice.TABLE.relative_to(attention_choice.TABLE.parents[1]))
    for line in attention_choice.set_aside_warnings():
        log.warning(line)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    cuda_graphs = uses_cuda_graphs(cfg, ds_config, device, world)
    in_float8 = apply_execution_options(objective, activation_checkpointing(ds_config), cfg.run.compile, cuda_graphs,
                                        cfg.run.float8)
    if cfg.run.float8:
        log.info("float8: %d linear layers of the transformer blocks train in float8 (torchao, dynamic per-tensor "
                 "scales); the weights, gradients and optimizer keep their dtypes", in_float8)
    groups, param_split = build_param_groups(objective, cfg.optim.weight_decay, cfg.optim.layer_decay)
    engine_cfg = EngineConfig.from_ds_config(ds_config)

    def make_schedule(optimizer):
        return WarmupCosineSchedule(optimizer, peak_lr, cfg.optim.min_lr, warmup_steps, total_steps)

    def make_optimizer(opt_groups):
        return build_optimizer(opt_groups, cfg.optim)

    engine = engines.build(objective, groups, make_optimizer, make_schedule, engine_cfg, device)
    engine.cuda_graphs = cuda_graphs
    return engine, objective, param_split


# Options of the compared sections that a resume may change (logged at start, kept in resumes.jsonl):
# the weights they would give come from the checkpoint; the attention kernel computes the same function
# (a job started on flash-attn GPUs continues where flash-attn is not).
FREE_ON_RESUME = ("model.init_from", "model.attn_backend")


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
            differing = sorted(k for k in set(was) | set(is_) if was.get(k) != is_.get(k)
                               and f"{key}.{k}" not in FREE_ON_RESUME)
            if differing:
                raise ConfigError(f"--resume: the checkpoint was trained with "
                                  f"{', '.join(f'{key}.{k} {was.get(k)!r}' for k in differing)}, this run has "
                                  f"{', '.join(repr(is_.get(k)) for k in differing)}; to continue that run, give "
                                  f"the same again; {new_run_hint(saved, cfg)}")
        elif was != is_:
            raise ConfigError(f"--resume: the checkpoint was trained with {key}={saved.get(key)}, this run has "
                              f"{now[key]}; to continue that run, give its {key} again; to train this one from the "
                              f"checkpoint's weights, start it in another --output_dir with --model.init_from "
                              f"<the checkpoint>")


def new_run_hint(saved: dict, cfg: PretrainConfig) -> str:
    """How to train this run's model rather than continue the checkpoint's (whose config is `saved`):
    in another output_dir, from the checkpoint's weights (--model.init_from) only where its encoder
    loads into this model (`init_from_misfit`)."""
    problem = init_from_misfit(saved, cfg)
    if not problem:
        return ("to train this one from the checkpoint's weights, start it in another --output_dir with "
                "--model.init_from <the checkpoint>")
    return (f"to train this model, start it in another --output_dir (the checkpoint's encoder does not load into it: "
            f"--model.init_from takes an encoder of the same architecture, and this one has {problem})")


def _as_saved(options: object, kind: type):
    """The options dataclass `kind` with the values a checkpoint's config recorded for it (`options`,
    a dict); an option added to the code since counts as its default, as check_resume_compatible has it."""
    known = {f.name for f in dataclasses.fields(kind)}
    return kind(**{k: v for k, v in options.items() if k in known} if isinstance(options, dict) else {})


def init_from_misfit(saved: dict, cfg: PretrainConfig) -> str:
    """How the encoder of a checkpoint whose config is `saved` differs from this run's in what
    --model.init_from loads ('' when it loads): train/weights/fit.py's rule (channels, width, patch
    size, depth, each tensor's shape; a position table of another grid and a new classifier aside),
    and the same tensors otherwise. Both encoders are built on the meta device from their model
    options and objective section (e.g. MAE+'s iRPE): nothing is allocated."""
    from train.weights.fit import NEW, mismatch

    theirs_cfg = copy.copy(cfg)
    theirs_cfg.sections = dict(cfg.sections)
    try:
        theirs_cfg.model = _as_saved(saved.get("model"), type(cfg.model))
        theirs_cfg.sections[cfg.objective] = _as_saved(saved.get(cfg.objective), type(section(cfg)))
        with torch.device("meta"):
            theirs, ours = ({k: tuple(v.shape) for k, v in build_encoder(c).state_dict().items()}
                            for c in (theirs_cfg, cfg))
    except (ValueError, KeyError, TypeError, RuntimeError):  # e.g. a model name this code no longer registers
        recorded = saved.get("model") if isinstance(saved.get("model"), dict) else {}
        return f"a model this code does not build (model.name {recorded.get('name')!r})"
    theirs = {k: v for k, v in theirs.items() if not k.startswith("head.")}  # a classifier is never loaded
    ours = {k: v for k, v in ours.items() if not k.startswith(NEW)}  # started fresh (fc_norm: average pooling)
    if problem := mismatch(theirs, ours):
        return problem
    pooled = {"norm.weight", "norm.bias"}  # average pooling drops the final norm: loaded either way
    lacks, extra = sorted(set(ours) - set(theirs) - pooled), sorted(set(theirs) - set(ours) - pooled)
    return "; ".join([*([f"no {', '.join(lacks[:2])} (the model's)"] if lacks else []),
                      *([f"{', '.join(extra[:2])}, which the model has not"] if extra else [])])


def _dotted(d: dict, prefix: str = "") -> dict:
    """Nested config dict -> {'optim.blr': value, ...} (leaves only)."""
    out: dict = {}
    for k, v in d.items():
        out.update(_dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def resume_changes(meta: dict, cfg: PretrainConfig, ds_config: dict) -> dict[str, list]:
    """Options this run sets differently from the checkpoint it resumes ({'optim.blr': [old, new]}),
    after check_resume_compatible refused those that break a resume, and the final ds_config's
    settings that differ from the one the checkpoint trained with ('ds_config.bf16.enabled': the
    file's path alone says nothing of its contents; checkpoints that predate recording it: none).
    An option added to the code after the checkpoint was written counts as its default; `resume`
    itself is left out."""
    default = _dotted(json.loads(json.dumps(to_dict(PretrainConfig()))))
    was = {**default, **_dotted(meta["config"])}
    now = _dotted(json.loads(json.dumps(to_dict(cfg))))  # as stored: tuples become lists
    changes = {key: [was.get(key), value] for key, value in now.items() if key != "resume" and was.get(key) != value}
    if isinstance(meta.get("ds_config"), dict):
        was, now = _dotted(meta["ds_config"], "ds_config."), _dotted(json.loads(json.dumps(ds_config)), "ds_config.")
        changes |= {key: [was.get(key), now.get(key)] for key in sorted(set(was) | set(now))
                    if was.get(key) != now.get(key)}
    return changes
