"""Checks of the selected objective against the model, the batch, the engine and the data, made
before any process starts (the dry run, the benchmark and the training commands): e.g. MixedAE's
group size and mixing cells, MLO-MAE's ZeRO stage and class count, a timm backbone's fit, a
transformers folder's sizes; objectives that read labels refuse unlabeled shards.
"""
from __future__ import annotations

from pathlib import Path

from model.hf_interop import check_folder_fits, is_transformers_folder
from model.objectives import OBJECTIVES, ObjectiveConfig
from model.registry import model_arch
from model.timm_backbone import is_timm_name
from train.config.backbones import check_timm_backbone
from train.config.errors import ConfigError
from train.config.options import PretrainConfig, encoder_img_size, section


def check_objective_fits(cfg: PretrainConfig, micro_batch: int, accum: int = 1, zero_stage: int = 0) -> None:
    """Objective-vs-model/batch/engine/data checks (e.g. MixedAE's group size and mixing cells,
    MLO-MAE's ZeRO stage and class count; objectives that read labels refuse unlabeled shards),
    before any process starts."""
    if is_timm_name(cfg.model.name):
        options = {k: getattr(cfg.model, k) for k in ("in_chans", "drop_path_rate", "rpe", "attn_backend")}
        check_timm_backbone(cfg.model.name, encoder_img_size(cfg), options, cfg.optim.layer_decay,
                            OBJECTIVES[cfg.objective][1].double_backward)
    checks = section(cfg)
    arch = model_arch(cfg.model.name, **({"img_size": cfg.model.img_size} if cfg.model.img_size else {}))
    # the shard index is read only for objectives that check its labels
    reads_labels = type(checks).check_labels is not ObjectiveConfig.check_labels
    if cfg.model.init_from and is_transformers_folder(cfg.model.init_from):
        check_transformers_init(cfg, {**arch, "in_chans": cfg.model.in_chans})
    try:
        checks.check_fits(arch["img_size"], arch["patch_size"], arch["depth"], micro_batch)
        checks.check_engine(zero_stage, accum)
        checks.check_input(cfg.model.in_chans)
        if reads_labels and cfg.data.source == "synthetic":  # labels 0 .. data.num_classes - 1
            checks.check_labels(cfg.data.num_classes)
        if reads_labels and cfg.data.source == "shards" and Path(cfg.data.train_index).is_file():
            from data.shard_index import ShardSet

            shards = ShardSet.from_index(cfg.data.train_index, cfg.data.allow_pipe_urls)
            try:
                checks.check_labels(len(shards.classes) if shards.labeled else None)
            except ValueError as e:
                shards.require_labels(f"{e} (data.train_index)")  # unlabeled: the index and the fix said
                raise
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None


def check_transformers_init(cfg: PretrainConfig, arch: dict) -> None:
    """model.init_from naming a transformers folder: its config.json's sizes against model.name
    and, for a ViTMAEForPreTraining folder, the objective's decoder options (model/hf_interop.py)."""
    checks = section(cfg)
    decoder = {f"{cfg.objective}.{k}": getattr(checks, k) for k in ("decoder_dim", "decoder_depth", "decoder_heads")
               if hasattr(checks, k)}
    try:
        check_folder_fits(cfg.model.init_from, cfg.model.name, arch, decoder)
    except (ValueError, OSError) as e:
        raise ConfigError(f"model.init_from: {e}") from None
