"""One run of the pretraining command (train/run/command.py parses it; finetune.py and
linprobe.py run it with their recipes as defaults).

`run(cfg)`: `check_before_start` (train/run/prestart.py: every check that can reject the input,
before any process group starts), then a `Trainer`: process group, engine, seeded RNGs, run
folder, data, resume; the loop (train/run/loop.py) with the trainer's checkpoint, figure and
evaluation callbacks; stop and requeue on a signal; export.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from data.source import eval_shards, fixed_images, train_shards
from kernels.accelerators import describe as describe_accelerators
from kernels.attention import describe_paths
from model.timm_backbone import TimmBackbone
from train.config.errors import ConfigError
from train.config.options import PretrainConfig
from train.config.parsing import to_dict
from train.config.plan import labeled_split, peak_lr
from train.engine import checkpoint, distributed
from train.engine.execution import describe_blocks
from train.engine.nonfinite import REMEDY, STEADIER, NonFiniteError
from train.run import code_version
from train.run.build import build_engine, training_source
from train.run.chance_loss import chance_watch
from train.run.compile_watch import CompileWatch, eager_blocks
from train.run.evaluation import classification_accuracy, eval_summary
from train.run.folder import Reporter, record_resume, write_run_files
from train.run.loop import LoopSettings, LoopState
from train.run.loop import run as run_loop
from train.run.preemption import REQUEUE_FAILED, Interrupted, StopOnSignal, requeue_job, resume_hint
from train.run.prestart import CheckedRun, check_before_start
from train.run.run_lock import hold_run_lock, release_run_lock, sign_run_lock
from train.run.summary import RunSummary
from train.run.visualize import write_figures
from train.weights.export import export_checkpoint

log = logging.getLogger("pretrain")  # train/run/build.py and train/run/folder.py log under this name too


def run(cfg: PretrainConfig) -> Path:
    """One run of a parsed configuration: the checks before start, then the Trainer; the run folder
    of a finished (or stopped) run. The run folder's lock is released however it ends."""
    try:
        return Trainer(cfg, check_before_start(cfg)).run()
    finally:
        release_run_lock(Path(cfg.output_dir))


def seed_global_rngs(seed: int) -> None:
    """Every global RNG the objectives draw from (masking noise, drop path: torch; timm's mixup:
    numpy) starts from `seed` (the run's seed + rank: different across ranks); all are checkpointed."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def describe_attention(encoder, device: torch.device, dtype: torch.dtype) -> tuple[str, dict[str, str]]:
    """(the encoder's attention backend, the implementation each kind of attention call gets)."""
    if isinstance(encoder, TimmBackbone):  # timm's own attention modules (a timm ViT's blocks have no .backend)
        return encoder.attn_backend, {"dense": encoder.describe_attention()}
    attn = encoder.blocks[0].attn
    return attn.backend, describe_paths(attn.backend, device, dtype, encoder.num_patches + 1,
                                        encoder.embed_dim // attn.num_heads)


def loop_settings(cfg: PretrainConfig, checked: CheckedRun) -> LoopSettings:
    """The loop's stop step (run.max_steps caps the schedule) and cadences."""
    stop_step = min(checked.total_steps, cfg.run.max_steps) if cfg.run.max_steps else checked.total_steps
    return LoopSettings(stop_step, cfg.run.log_every, cfg.run.ckpt_every, checked.plan.global_batch,
                        cfg.run.vis_every, cfg.run.eval_every, cfg.run.max_nonfinite_steps,
                        cfg.run.keep_every_epochs * checked.per_epoch)


def earlier_tag_hint(tag: Path) -> str:
    """How to continue without `tag`: from the newest complete tag before it in its folder."""
    earlier = sorted(p for p in tag.parent.glob("step*") if p.name < tag.name and checkpoint.is_complete(p))
    return (f"resume from an earlier one instead, e.g. --resume {earlier[-1]}" if earlier else
            "no earlier one exists there: start the run again (--run.overwrite true)")


class Trainer:
    """One run, after check_before_start: set up in the constructor, trained by `run()`."""

    def __init__(self, cfg: PretrainConfig, checked: CheckedRun):
        self.cfg, self.checked, self.run_dir = cfg, checked, checked.run_dir
        plan = checked.plan
        self.rank, self.world, self.device = distributed.init()
        logging.basicConfig(level=logging.INFO if self.rank == 0 else logging.WARNING, format="[%(name)s] %(message)s")
        self.peak_lr = peak_lr(cfg, plan)
        self.engine, objective, param_split = build_engine(cfg, checked.ds_config, self.device, self.peak_lr,
                                                           checked.warmup_steps, checked.total_steps,
                                                           init_weights=checked.resume_from is None)
        self.dtype = self.engine.dtype
        seed_global_rngs(cfg.seed + self.rank)
        self.encoder = objective.encoder
        backend, attention_paths = describe_attention(self.encoder, self.device, self.dtype)
        if self.rank == 0:
            hold_run_lock(self.run_dir)  # held since the checks, or (a new folder) taken before its first file
            sign_run_lock(self.run_dir)
            self.write_run_files(param_split, backend, attention_paths)
            self.record_labeled_split()
            self.say_if_unlabeled()
        self.data = training_source(cfg, self.encoder.img_size, plan, self.rank, self.world, self.device)
        self.last_saved: Path | None = None  # the newest checkpoint tag of this run's weights (written or resumed)
        self.state = LoopState(self.resume())
        if self.rank == 0 and checked.resume_from is not None:
            record_resume(self.run_dir, self.state.step, checked.resume_from, checked.resume_changes)
        self.settings = loop_settings(cfg, checked)
        self.ckpt_meta = {"zero_stage": self.engine.stage, "objective": cfg.objective,
                          "config": to_dict(cfg), "ds_config": checked.ds_config, "global_batch": plan.global_batch,
                          "encoder_timm_kwargs": self.encoder.timm_kwargs(), "model_name": cfg.model.name}
        self.vis_images = self.vis_noise = None  # rank 0: the same images and masks at every figure step
        if self.rank == 0 and cfg.run.vis_every:
            self.vis_images, self.vis_noise = self.figure_inputs()
        self.reporter = Reporter(self.run_dir, self.state.step, self.settings.stop_step, cfg.run.tensorboard,
                                 cfg.run.progress) if self.rank == 0 else None
        # classification objectives: top-1/top-5 on every rank's share of the shards
        self.eval_shards = eval_shards(cfg.data) if cfg.data.eval_index else None
        # a probe or fine-tuning run whose loss stays at ln(classes) says so (train/run/chance_loss.py)
        self.chance = chance_watch(cfg, self.peak_lr, checked.warmup_steps, self.settings.stop_step)

    def figure_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(fixed images (B, C, H, W) in the compute dtype, mask noise (B, N)), drawn from their own
        generators: the global RNGs are left as they are."""
        images = fixed_images(self.cfg.data, self.encoder.img_size, self.cfg.model.in_chans).to(self.device, self.dtype)
        noise = torch.rand(len(images), self.encoder.num_patches, generator=torch.Generator().manual_seed(0))
        return images, noise.to(self.device)

    def write_run_files(self, param_split: dict, backend: str, attention_paths: dict[str, str]) -> None:
        """Rank 0: config, final ds_config and meta.json in the run folder; the run's shape in the log."""
        cfg, checked, plan = self.cfg, self.checked, self.checked.plan
        write_run_files(self.run_dir, to_dict(cfg), checked.ds_config, {
            "world_size": self.world, "device": str(self.device), "precision": str(self.dtype).removeprefix("torch."),
            "zero_stage": self.engine.stage, "offload": "none", "engine": self.engine.describe(),
            "reduce_dtype": self.engine.cfg.reduce or self.engine.cfg.precision,
            "batch": asdict(plan) | {"global": plan.global_batch}, "peak_lr": self.peak_lr,
            "steps_per_epoch": checked.per_epoch, "total_steps": checked.total_steps,
            "accelerators": describe_accelerators(), "attention_backend": backend, "attention_paths": attention_paths,
            "param_split": param_split, "code": code_version.describe(),  # which code ran (a submit.py snapshot?)
        })
        log.info("world %d on %s, %s, ZeRO stage %d, offload none, global batch %d = %d x %d x %d, peak lr %.3g, "
                 "%d steps (%d/epoch)", self.world, self.device, str(self.dtype).removeprefix("torch."),
                 self.engine.stage, plan.global_batch, plan.micro, plan.accum, self.world, self.peak_lr,
                 checked.total_steps, checked.per_epoch)
        log.info("engine: %s", self.engine.describe())
        log.info("%s", describe_blocks(cfg, checked.ds_config, self.world, on_gpu=self.device.type == "cuda"))
        log.info("attention: %s", "; ".join(f"{kind}: {path}" for kind, path in attention_paths.items()))
        if cfg.optim.weight_decay == 0:
            log.info("no weight decay (optim.weight_decay 0): %d tensors (%d params) trained",
                     param_split["decay_tensors"] + param_split["no_decay_tensors"],
                     param_split["decay_params"] + param_split["no_decay_params"])
        else:
            log.info("weight decay on %d tensors (%d params), none on %d tensors (%d params)",
                     param_split["decay_tensors"], param_split["decay_params"], param_split["no_decay_tensors"],
                     param_split["no_decay_params"])

    def record_labeled_split(self) -> None:
        """Rank 0: the record of the objective's D_tr / D_val split of the shards (split.json)."""
        split = labeled_split(self.cfg)
        if split is None or self.cfg.data.source != "shards":
            return
        record = split.describe(train_shards(self.cfg.data), self.cfg.data.train_index)
        (self.run_dir / "split.json").write_text(json.dumps(record, indent=2))
        log.info("labeled split: %d D_tr / %d D_val samples (run folder: split.json)", record["num_train"],
                 record["num_val"])

    def say_if_unlabeled(self) -> None:
        """Rank 0: one warning line when the training index carries no labels (an objective that
        reads none trains on it as it is; what reads labels was refused before start)."""
        if self.cfg.data.source != "shards" or train_shards(self.cfg.data).labeled:
            return
        log.warning("data.train_index %s is unlabeled (\"labeled\": false): %s reads no labels and trains on every "
                    "sample; to fine-tune, probe or evaluate on it later, index its labels (python -m "
                    "data.index_shards ... --label_key KEY)", self.cfg.data.train_index, self.cfg.objective)

    def resume(self) -> int:
        """Engine, RNG and data position from the checked checkpoint, if any: the step to start from."""
        resume_from = self.checked.resume_from
        if resume_from is None:
            return 0
        try:
            client = checkpoint.load(self.engine, resume_from, self.rank, self.world, self.cfg.seed)
        except ValueError as e:  # it passed the check before start: a file changed in between
            raise ConfigError(f"--resume: {e}; it passed the check before the start, so a file of it changed since "
                              f"(another process writing to {resume_from.parent}?); resume again") from None
        if not self.engine.weights_finite():  # saved before checkpoints were checked, or altered since
            raise NonFiniteError(f"checkpoint {resume_from} holds non-finite weights, so training from it would "
                                 f"only diverge; {earlier_tag_hint(resume_from)}")
        self.last_saved = resume_from  # the newest good tag of this run's weights, until it writes one
        self.data.resume_from(client["data"])
        log.info("resumed from %s at step %d%s", resume_from, client["step"],
                 f" (written by {len(client['data'])} ranks, continued on {self.world})"
                 if len(client["data"]) != self.world else "")
        return client["step"]

    def on_checkpoint(self, step: int) -> None:
        if not self.engine.weights_finite():  # a tag of them would be kept, and rotate good ones away
            ours = self.last_saved is not None and \
                self.last_saved.resolve().parent == (self.run_dir / "checkpoints").resolve()
            remedy = REMEDY if ours else f"{STEADIER}; then continue from it with --resume {self.last_saved}"
            kept = (f"the last complete one, {self.last_saved.name if ours else self.last_saved}, is kept: {remedy}"
                    if self.last_saved else
                    "no earlier one exists: start again with a lower optim.blr or optim.weight_decay")
            raise NonFiniteError(f"the weights hold non-finite values after step {step}, from an update of finite "
                                 f"gradients that overflowed them. Training stopped without writing this checkpoint; "
                                 f"{kept}")
        client = {"step": step, "data": distributed.all_gather_object(self.data.state_dict())}
        self.last_saved = checkpoint.save(self.engine, self.run_dir / "checkpoints", step, client, self.rank,
                                          self.world, self.ckpt_meta, self.cfg.run.keep_checkpoints,
                                          pinned=self.settings.kept_for_later(step))

    def on_visualize(self, step: int) -> None:
        """Rank 0 draws; every rank joins the gathering of sharded weights. No global RNG draws."""
        module = self.engine.module
        module.eval()
        with self.engine.gathered(), torch.no_grad(), eager_blocks():
            if self.rank == 0:
                write_figures(module, self.vis_images, self.vis_noise, self.run_dir / "vis", step)
        module.train()

    def on_evaluate(self, step: int) -> None:
        module = self.engine.module
        self.engine.share_running_stats()  # every rank scores with the same classifier
        module.eval()
        with self.engine.gathered(), eager_blocks():  # ZeRO-3: predict() runs outside the objective's forward
            result = classification_accuracy(module.predict, self.eval_shards, self.encoder.img_size,
                                             self.cfg.data.eval_crop_pct, self.rank, self.world, self.device,
                                             self.dtype, num_workers=self.cfg.data.num_workers)
        module.train()
        if self.reporter is not None:
            log.info("step %d: %s of data.eval_index", step, eval_summary(result))
            self.reporter.log_eval(step, result)
            if self.chance is not None:
                result["training_loss_at_chance"] = self.chance.last is not None
            (self.run_dir / "eval.json").write_text(json.dumps({"step": step, **result}, indent=2))

    def run(self) -> Path:
        """Train to the stop step (or a stop signal: checkpoint, requeue), export; the run folder."""
        # Slurm's SIGUSR1 / SIGTERM: checkpoint, (requeue), exit 0; SIGINT / SIGTERM elsewhere: checkpoint, exit 130 / 143
        stop = StopOnSignal(self.cfg.run.stop_check_every, self.device)
        report = self.reporter.log if self.reporter else lambda step, metrics: None

        watch = CompileWatch() if self.cfg.run.compile else None
        summary = RunSummary(self.state.step, self.settings.global_batch)

        def on_log(step: int, metrics: dict) -> None:  # every rank: the metrics are reduced over ranks
            if watch is not None:
                metrics.update(watch.read(step, quiet=self.rank != 0))
            if step == self.settings.stop_step and hasattr(self.data, "check_unusable"):
                self.data.check_unusable(metrics)  # the give-up rule over the whole run, before its last checkpoint
            if self.chance is not None and self.chance.at_chance(step, metrics["loss"]):
                metrics["loss_at_chance"] = 1
                if self.chance.first_time() and self.rank == 0:
                    log.warning(self.chance.message())
            summary.add(step, metrics)
            report(step, metrics)

        try:
            stopped = run_loop(self.engine, self.data, self.settings, self.state, self.device, self.dtype, on_log,
                               self.on_checkpoint, self.on_visualize,
                               self.on_evaluate if self.eval_shards is not None else None, stop.should_stop)
        finally:
            stop.close()
            if self.reporter is not None:  # a run that failed keeps what it logged (TensorBoard buffers)
                self.reporter.close()
        if self.rank == 0 and (said := summary.line(self.state.step)):  # also where no bar showed the loss
            log.info(said)
        if self.rank == 0 and self.chance is not None and self.chance.last is not None and not stopped:
            log.warning("at the end: %s", self.chance.message())
        requeue_failed = ""
        if stopped and not stop.exit_status:
            log.info("stopped on a signal at step %d after writing %s", self.state.step, self.last_saved)
            if self.rank == 0 and stop.requeue:
                queued, said = requeue_job()
                log.info(said)
                requeue_failed = "" if queued else said
        elif not stopped and self.rank == 0 and self.cfg.run.export and self.last_saved is not None:
            out = self.run_dir / "encoder.safetensors"
            try:
                export_checkpoint(self.last_saved, out)
            except OSError as e:  # e.g. a full disk: the checkpoint is whole, the export can be redone from it
                raise checkpoint.CheckpointWriteError(
                    f"the encoder export {out} could not be written ({e.strerror}); the checkpoint {self.last_saved} "
                    f"is complete: once there is room, write the export with python -m train.export --checkpoint "
                    f"{self.run_dir} --overwrite (its latest checkpoint, into {out})") from None
            log.info("exported encoder to %s", out)
        distributed.barrier()
        if requeue_failed:  # rank 0 ends non-zero, so the job is not reported COMPLETED mid-schedule
            raise Interrupted(REQUEUE_FAILED, f"stopped by Slurm's warning signal after step {self.state.step}: "
                              f"checkpoint {self.last_saved}; the requeue failed ({requeue_failed}): submit the job "
                              f"again to continue (python -m launchers.submit --continue ..., or sbatch; it resumes "
                              f"with --resume auto)")
        if stopped and stop.exit_status:  # a person's Ctrl-C / kill: one line (train/run/cli.py) on where and how to resume
            raise Interrupted(stop.exit_status, f"stopped by {stop.agreed_signal.name} after step {self.state.step}: "
                              f"checkpoint {self.last_saved}; to continue: {resume_hint(self.world)}"
                              if self.rank == 0 else "")
        return self.run_dir
