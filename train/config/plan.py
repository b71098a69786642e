"""What a configuration implies before anything is built: the encoder it describes, the
objective's labeled split, the peak lr and the schedule's step counts for a batch plan."""
from __future__ import annotations

from data.source import nominal_epoch_size
from data.split import LabeledSplit
from model.registry import create_model
from train.config.ds_config import BatchPlan
from train.config.ds_config import load as load_ds_config
from train.config.errors import ConfigError
from train.config.options import PretrainConfig, section


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
    peak = peak_lr(cfg, plan)
    if cfg.optim.min_lr > peak:  # the half-cycle cosine "down to min_lr" would climb to it instead
        raise ConfigError(f"optim.min_lr {cfg.optim.min_lr:g} is above the peak lr {peak:.3g} (blr {cfg.optim.blr:g} x "
                          f"global batch {plan.global_batch} / 256), so the schedule would rise after the warmup: "
                          f"give an optim.min_lr below {peak:.3g} (MAE: 0), or a larger optim.blr")
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
