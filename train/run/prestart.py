"""The checks before start: everything that can reject a pretraining command's input (a
ConfigError naming the option and the fix), run before any process group starts or anything is
written: the output folder is writable, the ds_config resolves, the model fits memory and the
objective, the init weights and the data read, and under the run folder's lock the checkpoint to
resume fits this run (every file checked, nothing executed) and the folder holds no other run.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data.source import check_source
from data.verify import verify_before_start
from model.objectives import build_objective
from train.config.ds_config import BatchPlan, resolve, zero_stage
from train.config.errors import ConfigError
from train.config.objective_fits import check_objective_fits
from train.config.options import PretrainConfig, section
from train.config.parsing import to_dict
from train.config.plan import build_encoder, schedule_steps
from train.engine import checkpoint, distributed
from train.engine.state_files import EXTRA_STATE, WEIGHTS_FILE, TagContents
from train.estimate.memory import check_floor
from train.run.build import check_resume_compatible, resume_changes
from train.run.folder import check_run_folder, check_writable_folder
from train.run.run_lock import RESUME_WAIT_S, hold_run_lock, release_run_lock
from train.weights.fit import check_init_from


@dataclass
class CheckedRun:
    """What the checks before start settled."""
    ds_config: dict  # final, as the engine gets it
    plan: BatchPlan
    per_epoch: int  # optimizer steps
    total_steps: int
    warmup_steps: float
    run_dir: Path
    resume_from: Path | None  # a checkpoint tag, checked
    resume_changes: dict[str, list] = field(default_factory=dict)  # option -> [checkpoint's value, this run's]


def check_before_start(cfg: PretrainConfig) -> CheckedRun:
    """Everything that rejects bad input (ConfigError) before any process group starts."""
    try:  # a --resume path that is not there: a typo, refused before anything is checked at length
        checkpoint.check_resume_exists(cfg.resume)
    except checkpoint.NoCheckpointThere as e:
        raise ConfigError(f"{e}; {checkpoint.RESUME_TAKES}") from None
    try:  # where the run writes, first: nothing else matters if it cannot
        check_writable_folder(Path(cfg.output_dir), "--output_dir")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ds_config, plan = resolve(cfg, distributed.world_size_from_env())
    check_floor(cfg, ds_config, plan)  # tensors this machine cannot hold at all, before anything is built
    check_same_objective(cfg)  # before the objective's own checks, which would blame its options
    check_objective_fits(cfg, plan.micro, plan.accum, zero_stage(ds_config))
    if not cfg.resume:  # a resume takes the checkpoint's weights: init_from is not read (its file may be gone)
        check_init_from(cfg)  # the weights' channels and sizes against the model, from the file's shapes
    try:
        check_source(cfg.data, plan.world, cfg.model.in_chans)
        verify_before_start(cfg.data)  # data.verify_shards: every shard's headers, before the run folder
    except ValueError as e:
        raise ConfigError(str(e)) from None
    run_dir = Path(cfg.output_dir)
    locks = distributed.rank_from_env() == 0  # the rank that holds the folder's lock, and alone may clear it
    if locks and run_dir.is_dir():  # another run may be writing it (a new folder: locked as it is made)
        hold_run_lock(run_dir, RESUME_WAIT_S if cfg.resume else 0.0)
    try:
        return check_run_folder_before_start(cfg, ds_config, plan, run_dir, clear=locks)
    except BaseException:
        release_run_lock(run_dir, refused=True)
        raise


def check_run_folder_before_start(cfg: PretrainConfig, ds_config: dict, plan: BatchPlan, run_dir: Path,
                                  clear: bool) -> CheckedRun:
    """The checks that read the run folder (the checkpoint to resume, another run's files), under
    its lock; `clear`: this rank may delete a cleared run's outputs."""
    per_epoch, total_steps, warmup_steps = schedule_steps(cfg, plan)
    try:
        resume_from = checkpoint.find_resume(cfg.resume, run_dir)  # every file of the tag checked, nothing executed
    except checkpoint.NoCheckpointThere as e:  # a folder without a complete tag
        raise ConfigError(f"{e}; {checkpoint.RESUME_TAKES}") from None
    if resume_from is not None:
        check_resume(resume_from, cfg, plan)
    elif cfg.resume:  # --resume auto found nothing to continue: a fresh start reads init_from
        check_init_from(cfg)
    # options that do not break the resume (e.g. the lr) may change: said at start, kept in resumes.jsonl
    changes = resume_changes(checkpoint.read_meta(resume_from), cfg, ds_config) if resume_from is not None else {}
    if "optim.name" in changes:  # the optimizer state of one optimizer does not load into another
        was, now = changes["optim.name"]
        raise ConfigError(f"--resume: the checkpoint holds the optimizer state of optim.name {was}, this run has "
                          f"{now}; give --optim.name {was} to continue it, or start another --output_dir with "
                          f"--model.init_from <the checkpoint>")
    try:
        check_run_folder(run_dir, to_dict(cfg), resuming=resume_from, overwrite=cfg.run.overwrite,
                         inputs={"--model.init_from": cfg.model.init_from, "--data.train_index": cfg.data.train_index,
                                 "--data.eval_index": cfg.data.eval_index},
                         clear=clear)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return CheckedRun(ds_config, plan, per_epoch, total_steps, warmup_steps, run_dir, resume_from, changes)


def trained_objective(cfg: PretrainConfig) -> tuple[str, str] | None:
    """(the objective of the run this one would continue, where that is recorded), or None: the
    checkpoint --resume names, else the run folder's config.json (unless run.overwrite replaces it).
    Only complete.json is read here (the resume's own check reads every file later)."""
    if cfg.resume and cfg.resume != "auto":
        try:
            tag = checkpoint.find_resume(cfg.resume, Path(cfg.output_dir), check=checkpoint.check_files)
            return checkpoint.read_meta(tag)["config"]["objective"], f"the checkpoint {tag}"
        except (OSError, ValueError, KeyError, TypeError, RecursionError):  # unreadable: check_resume says so
            return None
    saved = Path(cfg.output_dir) / "config.json"
    if cfg.run.overwrite or not saved.is_file():
        return None
    try:
        return json.loads(saved.read_text())["objective"], f"--output_dir {cfg.output_dir} (its config.json)"
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # unreadable: check_run_folder judges it
        return None


def check_same_objective(cfg: PretrainConfig) -> None:
    """A run continued (or started in a run folder) under another objective is refused naming both."""
    found = trained_objective(cfg)
    if found is not None and found[0] != cfg.objective:
        was, where = found
        raise ConfigError(f"--objective {cfg.objective}, but {where} holds a {was} run: give --objective {was} to "
                          f"continue it, or another --output_dir for the {cfg.objective} run (--model.init_from "
                          f"starts it from that run's weights)")


def check_resume(resume_from: Path, cfg: PretrainConfig, plan: BatchPlan) -> None:
    """The checkpoint fits this run (any world size, any ZeRO stage), and every file the resume
    will read is checked first, nothing executed (checkpoint.verify_readable): bad input is refused
    before the run folder is written."""
    try:
        contents = checkpoint.verify_readable(resume_from)
    except ValueError as e:
        raise ConfigError(f"--resume: {e}") from None
    meta = checkpoint.read_meta(resume_from)
    if not isinstance(meta.get("config"), dict):
        raise ConfigError(f"--resume: {resume_from / checkpoint.COMPLETE} holds no config: not a checkpoint this "
                          f"code wrote; resume another tag")
    check_resume_compatible(meta, cfg, plan)
    check_fits_objective(resume_from, contents, cfg)


def check_fits_objective(tag: Path, contents: TagContents, cfg: PretrainConfig) -> None:
    """The checkpoint's tensors (names and shapes, from its weights file's header) and objective
    states are those of this run's objective, built on the meta device: nothing is allocated and
    no state computed (which modules keep an extra state is known from their class)."""
    with torch.device("meta"):
        objective = build_objective(cfg.objective, build_encoder(cfg), section(cfg))
    params = {k: list(v.shape) for k, v in objective.named_parameters(remove_duplicate=False)}
    tensors = params | {k: list(v.shape) for k, v in objective.named_buffers(remove_duplicate=False)}
    extra = sorted(f"{name}.{EXTRA_STATE}" if name else EXTRA_STATE for name, module in objective.named_modules()
                   if type(module).get_extra_state is not torch.nn.Module.get_extra_state)
    missing = sorted(set(params) - set(contents.weights))  # a buffer may be one the module does not save
    unexpected = sorted(set(contents.weights) - set(tensors))
    reshaped = [f"{k} {contents.weights[k]} (the model's: {tensors[k]})" for k in sorted(tensors)
                if k in contents.weights and contents.weights[k] != tensors[k]]
    if missing or unexpected or reshaped or extra != contents.extra:
        raise ConfigError(f"--resume: {tag / WEIGHTS_FILE} does not fit this run's {cfg.objective} objective "
                          f"(missing {missing[:4]}, unexpected {unexpected[:4]}, other shapes {reshaped[:4]}, "
                          f"objective state {contents.extra} for {extra}); resume the run that wrote it with its own "
                          f"options, or another tag")
