"""Typed, strict configuration for pretraining.

One source of truth per setting: batch sizes, precision, ZeRO stage and gradient clipping live
in the DeepSpeed JSON (`--ds_config`); everything else lives here. Values come from the
dataclass defaults, then what the JSON presets (`--config FILE`, any number, in any order) agree
on (train/config/presets.py), then `--section.key value` on the command line. Unknown keys are errors
naming the closest valid key. Every value is read strictly as its field's type (train/config/values.py)
and every number must lie in the range its field declares, `field(default=..., metadata={"range":
"[0, 1)"})`: `validate` checks them for every section, objectives' included, and `--help` shows
them.

The common sections are the fields of PretrainConfig; each registered objective adds its own
section under its name (`cfg.mae`, `--mae.mask_ratio`), built from the registry when the config
is made, so a method registered anywhere (model/objectives/base.py) gets its options, its
`--help` lines and its preset keys without an edit here.

Reading a command's options (presets, `--key value`, `--help`) is train/config/parsing.py; the
checks of the objective against the model, batch, engine and data, made before start, are
train/config/objective_fits.py.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.labels import LabelKey
from data.transform_settings import DECODES, check_augment_policy
from kernels import resolve_backend
from model.objectives import OBJECTIVES, ObjectiveConfig, list_objectives
from model.registry import list_models, model_arch
from model.timm_backbone import is_timm_name
from train.config.ds_keys import did_you_mean
from train.config.errors import ConfigError
from train.config.help import field_comments, show_default
from train.config.values import Interval, check_range, from_json, from_text, shown


@dataclass
class ModelConfig:
    name: str = "vit_base_patch16"  # a key of model.registry.list_models(), or timm/<timm model name> (energy)
    img_size: int = field(default=0, metadata={"range": "[0, inf)"})  # 0 = the registry entry's default (224 for standard sizes)
    in_chans: int = field(default=3, metadata={"range": "[1, inf)"})  # input channels (3 = RGB; the shards decode to RGB)
    attn_backend: str = "auto"  # auto (= sdpa) | sdpa | math | flash_attn; sdpa runs each shape on the SDPA kernel measured fastest for it (kernels/attention_choices.json)
    global_pool: str = "token"  # token (cls) | avg (patch mean + fc_norm, MAE fine-tuning)
    drop_path_rate: float = field(default=0.0, metadata={"range": "[0, 1)"})  # stochastic depth, grows linearly to this value over the blocks
    rpe: bool = False  # iRPE in every block (to fine-tune an MAE+/AdPE RPE encoder; maeplus.rpe sets it for pretraining)
    init_from: str = ""  # weights to start from: our run folder / checkpoint, official MAE .pth, timm or exported encoder, a transformers folder


@dataclass
class DataConfig:
    source: str = "shards"  # shards (webdataset, data/write_shards.py) | synthetic (benchmarks)
    train_index: str = ""  # the <name>.json index of the training shards
    eval_index: str = ""  # labeled shards for top-1/top-5 of classification objectives ('' = none)
    label_key: str = ""  # where labels are: empty = the key the index records (cls for data/write_shards.py's), else cls (the .cls member) | json:FIELD (a field of the .json member), which must be the index's; unlabeled indexes are read without labels
    eval_crop_pct: float = field(default=0.875, metadata={"range": "(0, 1]"})  # evaluation resize = img_size / eval_crop_pct, then center crop
    epoch_size: int = field(default=0, metadata={"range": "[0, inf)"})  # nominal samples per epoch; 0 = the shard index's count (synthetic: 1,281,167)
    num_workers: int = field(default=-1, metadata={"range": "[-1, inf)"})  # DataLoader workers per rank; -1 = auto: min(10, cores per rank - 1, shards per rank); 0 = decode in the training process
    shuffle_buffer: int = field(default=1000, metadata={"range": "[1, inf)"})  # samples held by each worker's shuffle buffer
    crop_scale_min: float = field(default=0.2, metadata={"range": "(0, 1]"})  # RandomResizedCrop scale range (crop_scale_min, 1)
    train_transform: str = "crop_flip"  # crop_flip (MAE pretraining / linprobe) | randaug (fine-tuning) | multicrop (MAE+)
    decode: str = "cpu"  # cpu | cpu_draft (JPEG decoded at 1/2-1/8 scale when the crop allows) | nvjpeg (on the GPU)
    num_crops: int = field(default=4, metadata={"range": "[1, inf)"})  # crops per image with train_transform multicrop (each img_size, scale (crop_scale_min, 1))
    randaug: str = "rand-m9-mstd0.5-inc1"  # timm augmentation policy (train_transform randaug): rand-..., augmix-..., original; '' = none
    reprob: float = field(default=0.25, metadata={"range": "[0, 1]"})  # random erasing probability (train_transform randaug)
    num_classes: int = field(default=1000, metadata={"range": "[1, inf)"})  # synthetic source only
    max_bad_fraction: float = field(default=0.01, metadata={"range": "[0, 1]"})  # stop when more of a reader's samples are unusable (data/faults.py; 1.0 = never)
    max_image_pixels: int = field(default=89_478_485, metadata={"range": "[1, inf)"})  # larger images are skipped from their header (PIL's default limit)
    allow_pipe_urls: bool = False  # let index entries 'pipe:<shell command>' run commands to read shards
    verify_shards: bool = False  # before start, check every shard's tar and image headers (python -m data.verify); refuse bad ones


@dataclass
class OptimConfig:
    blr: float = field(default=1.5e-4, metadata={"range": "(0, inf)"})  # lr = blr * global_batch / 256
    weight_decay: float = field(default=0.05, metadata={"range": "[0, inf)"})  # AdamW decay of weight matrices (none on biases, norms, tokens, position tables)
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata={"range": "[0, 1)"})  # AdamW betas, comma-separated
    epochs: int = field(default=800, metadata={"range": "[1, inf)"})  # schedule length in epochs of data.epoch_size samples
    warmup_epochs: float = field(default=40.0, metadata={"range": "[0, inf)"})  # linear warmup, then half-cycle cosine to min_lr
    min_lr: float = field(default=0.0, metadata={"range": "[0, inf)"})  # the cosine schedule's floor
    name: str = "adamw"  # adamw | lars (momentum 0.9, trust 0.001; needs ZeRO stage 0)
    layer_decay: float = field(default=1.0, metadata={"range": "(0, 1]"})  # layer-wise lr decay of the encoder (1.0 = none; MAE fine-tuning 0.65 B / 0.75 L)


@dataclass
class RunConfig:
    log_every: int = field(default=20, metadata={"range": "[1, inf)"})  # optimizer steps between metric lines
    ckpt_every: int = field(default=1000, metadata={"range": "[1, inf)"})  # optimizer steps between checkpoints (one is always written at the end)
    keep_checkpoints: int = field(default=3, metadata={"range": "[0, inf)"})  # newest complete checkpoints kept on disk (0 = all)
    keep_every_epochs: int = field(default=0, metadata={"range": "[0, inf)"})  # also checkpoint at the end of every N-th epoch and never delete those (0 = none)
    max_steps: int = field(default=0, metadata={"range": "[0, inf)"})  # stop after this many optimizer steps (0 = the full schedule); the schedule is unchanged
    tensorboard: bool = True  # TensorBoard events in <output_dir>/tb beside metrics.jsonl
    progress: bool = True  # a progress bar on rank 0 (tqdm)
    export: bool = True  # write encoder.safetensors + encoder.json at the end
    vis_every: int = field(default=0, metadata={"range": "[0, inf)"})  # optimizer steps between PNG figures in <output_dir>/vis (0 = none)
    eval_every: int = field(default=0, metadata={"range": "[0, inf)"})  # optimizer steps between evaluations on data.eval_index (0 = only at the end)
    compile: bool = False  # torch.compile every ViT block (encoder and decoder; any ZeRO stage): one static graph per block shape
    float8: bool = False  # the ViT blocks' linear layers train in float8 (torchao, dynamic per-tensor scales; GPUs of compute capability >= 8.9, e.g. H100; CPU for tests); with run.compile
    stop_check_every: int = field(default=5, metadata={"range": "[1, inf)"})  # optimizer steps between the ranks' agreement on a stop signal (SIGUSR1 / SIGTERM)
    max_nonfinite_steps: int = field(default=20, metadata={"range": "[0, inf)"})  # consecutive skipped steps (non-finite loss / gradients) that stop the run; 0 = never
    overwrite: bool = False  # start afresh in an output_dir that holds another run (its checkpoints and logs are deleted)


def _registered_sections() -> dict[str, ObjectiveConfig]:
    """Every registered objective's config at its defaults, in registration order."""
    common = {f.name for f in dataclasses.fields(PretrainConfig)}
    clash = sorted(common & set(OBJECTIVES))
    if clash:
        raise ConfigError(f"objectives {clash} are named like common config sections; register them under other names")
    return {name: config_cls() for name, (config_cls, _) in OBJECTIVES.items()}


@dataclass
class PretrainConfig:
    """Common sections as fields; the objectives' sections (`cfg.<objective name>`) in `sections`."""

    ds_config: str = ""  # DeepSpeed JSON: batch, precision, ZeRO, clipping
    output_dir: str = "runs/pretrain"  # the run folder: config, metrics, checkpoints, figures, export
    resume: str = ""  # '' | 'auto' (latest complete checkpoint in output_dir) | path to a checkpoint
    seed: int = field(default=0, metadata={"range": "[0, 2147483647]"})  # initial weights (every rank); masks, augmentation and data order draw from seed + rank (numpy takes seeds below 2**32)
    objective: str = "mae"  # a registered objective: one of the sections below after run
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # objective name -> its config, one per objective registered when this config was made
    sections: dict[str, ObjectiveConfig] = field(default_factory=_registered_sections, repr=False)

    def __getattr__(self, name: str) -> Any:
        """cfg.<objective name> is that objective's section (only called for names not found otherwise)."""
        sections = self.__dict__.get("sections")
        if sections is not None and name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__} has no section or field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        sections = self.__dict__.get("sections")
        if sections is not None and name in sections:
            sections[name] = value
        else:
            super().__setattr__(name, value)

    def validate(self) -> None:
        check_values(self)  # every option's type and range, as its field declares them
        if not self.ds_config:
            raise ConfigError("--ds_config is required (e.g. ds_configs/cpu_debug.json)")
        if not self.output_dir.strip():
            raise ConfigError("--output_dir is empty: give the run folder, e.g. --output_dir runs/pretrain")
        if self.objective not in OBJECTIVES or self.objective not in self.sections:
            raise ConfigError(f"objective {self.objective!r} is unknown; choose one of {list_objectives()}"
                              f"{did_you_mean(self.objective, list_objectives())}")
        if self.optim.name not in ("adamw", "lars"):
            raise ConfigError(f"optim.name must be adamw or lars, got {self.optim.name!r}")
        if self.data.train_transform not in ("crop_flip", "randaug", "multicrop"):
            raise ConfigError(f"data.train_transform must be crop_flip, randaug or multicrop, got "
                              f"{self.data.train_transform!r}")
        if self.data.train_transform == "randaug":
            try:
                check_augment_policy(self.data.randaug)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.data.decode not in DECODES:
            raise ConfigError(f"data.decode must be one of {DECODES}, got {self.data.decode!r}")
        if self.data.decode != "cpu" and self.data.train_transform == "randaug":
            raise ConfigError(f"data.decode {self.data.decode} is not available with train_transform randaug "
                              f"(timm's pipeline decodes whole images with PIL); use data.decode cpu")
        if self.data.decode == "nvjpeg" and self.data.train_transform != "crop_flip":
            raise ConfigError("data.decode nvjpeg supports train_transform crop_flip only; use cpu_draft for multicrop")
        if self.model.global_pool not in ("token", "avg"):
            raise ConfigError(f"model.global_pool must be token or avg, got {self.model.global_pool!r}")
        objective_cls = OBJECTIVES[self.objective][1]
        if self.data.eval_index and not objective_cls.has_classifier():
            raise ConfigError(f"data.eval_index is for objectives with a classifier; objective {self.objective!r} "
                              f"has none (evaluate its encoder with train/evaluate.py)")
        split_objective = section(self).data_split() is not None  # MLO-MAE: levels I-III read train_index
        if split_objective and self.data.eval_index and \
                Path(self.data.eval_index).resolve() == Path(self.data.train_index).resolve():
            raise ConfigError("data.eval_index is the training index, which every MLO-MAE level reads: the reported "
                              "accuracy would be measured on training samples; point it at the held-out test split")
        if self.run.compile and objective_cls.double_backward:
            raise ConfigError(f"run.compile: objective {self.objective} differentiates through input gradients, "
                              f"which compiled graphs do not support; set run.compile false")
        if self.run.float8:
            refusal = ("it differentiates through input gradients" if objective_cls.double_backward
                       else objective_cls.float8_refusal)
            if refusal:
                raise ConfigError(f"run.float8: objective {self.objective} cannot train its blocks in float8: {refusal}; "
                                  f"set run.float8 false")
            if importlib.util.find_spec("torchao") is None:
                raise ConfigError("run.float8 needs the torchao package, which is not installed: "
                                  "pip install -e '.[float8]' (or set run.float8 false)")
        if self.run.overwrite and self.resume:
            raise ConfigError("run.overwrite starts afresh and --resume continues: give one of them")
        if self.optim.warmup_epochs > self.optim.epochs:
            raise ConfigError(f"optim.warmup_epochs ({self.optim.warmup_epochs}) exceeds optim.epochs ({self.optim.epochs})")
        if self.data.source not in ("shards", "synthetic"):
            raise ConfigError(f"data.source {self.data.source!r} is unknown; choose 'shards' or 'synthetic'")
        if self.data.source == "shards" and not self.data.train_index:
            raise ConfigError("data.train_index is required with data.source shards (the JSON written by "
                              "data/write_shards.py); to try the code without data, start from a debug preset "
                              "(--config train/configs/<method>/debug.json: the debug ViT on synthetic images, "
                              "32 steps), not --data.source synthetic alone (ImageNet-sized epochs of the model "
                              f"{self.model.name})")
        try:
            if self.data.label_key:  # empty: the index's own
                LabelKey.parse(self.data.label_key)
        except ValueError as e:
            raise ConfigError(f"data.label_key: {e}") from None
        if not self.resume:  # a resume does not read it (train.weights.fit.check_init_from checks it otherwise)
            check_init_from_exists(self.model.init_from)
        if self.model.name not in list_models() and not is_timm_name(self.model.name):
            close = difflib.get_close_matches(self.model.name, list_models(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"model.name {self.model.name!r} is not registered{hint} Choose one of {list_models()} "
                              f"or a timm model as 'timm/<name>' (e.g. timm/convnext_atto)")
        if is_timm_name(self.model.name) and not section(self).takes_timm_backbones:
            takers = sorted(n for n, (c, _) in OBJECTIVES.items() if c.takes_timm_backbones)
            raise ConfigError(f"model.name {self.model.name} is a timm backbone, which only --objective "
                              f"{' / '.join(takers)} trains; {self.objective} needs a ViT of this codebase (one of "
                              f"{list_models()}). A timm backbone's export loads into timm.create_model for timm's "
                              f"own fine-tuning; train.evaluate probes it")
        check_patch_grid(self.model)
        try:
            resolve_backend(self.model.attn_backend)
            section(self).validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_init_from_exists(init_from: str) -> None:
    if init_from and not Path(init_from).exists():
        raise ConfigError(f"model.init_from {init_from!r} does not exist: give an exported encoder.safetensors, a "
                          f"run folder, an official MAE or a timm checkpoint")


def check_patch_grid(model: ModelConfig) -> None:
    """A ViT's model.img_size (0: the registry entry's own) must be a whole number of patches."""
    if not model.img_size or is_timm_name(model.name):
        return
    arch = model_arch(model.name)
    patch = arch["patch_size"]
    if model.img_size % patch:
        raise ConfigError(f"model.img_size {model.img_size} is not divisible by the patch size {patch} of "
                          f"{model.name}: give a multiple of the patch size (e.g. "
                          f"{max(patch, model.img_size // patch * patch)}), or 0 for its own size ({arch['img_size']})")


def section(cfg: PretrainConfig) -> ObjectiveConfig:
    """The selected objective's config section (cfg.<cfg.objective>)."""
    return cfg.sections[cfg.objective]


def encoder_img_size(cfg: PretrainConfig) -> int:
    """The encoder's input size: model.img_size, else the registry entry's default."""
    return cfg.model.img_size or model_arch(cfg.model.name)["img_size"]


# --- the options' value schema ---------------------------------------------------------------

@dataclass(frozen=True)
class Option:
    """What an option may hold: its type (bool, int, float, str, or a tuple of floats), its default,
    for numbers the interval its field declares (`field(..., metadata={"range": "[0, 1)"})`; None:
    any finite number) and its description (the comment on its field's line)."""
    type: Any
    default: Any
    range: Interval | None
    text: str

    def read(self, value: Any, text: bool) -> Any:
        """A command-line text (`text`) or a JSON value as this option's type; ValueError saying
        what it must be."""
        if typing.get_origin(self.type) is not tuple:
            return (from_text if text else from_json)(self.type, value)
        kinds = typing.get_args(self.type)
        items = value.split(",") if text else value
        if not isinstance(items, list) or len(items) != len(kinds):
            raise ValueError(f"must be {len(kinds)} {'comma-separated numbers' if text else 'numbers in a list'}, "
                             f"got {shown(value)}")
        return tuple((from_text if text else from_json)(kind, item) for kind, item in zip(kinds, items))

    def check(self, value: Any) -> None:
        """ValueError when `value` is not of this option's type or lies outside its range."""
        if typing.get_origin(self.type) is tuple:
            items = list(value) if isinstance(value, (tuple, list)) else value
            self.read(items, text=False)
            if self.range is not None and not all(item in self.range for item in items):
                raise ValueError(f"must be {len(items)} numbers each {self.range}, got {show_default(tuple(items))}")
            return
        from_json(self.type, value)
        if self.type is int and not isinstance(value, int):  # 8.0 is read as 8, but not kept as 8.0
            raise ValueError(f"must be an integer, got {shown(value)}")
        if self.type in (int, float):
            check_range(value, self.range)

    def refusal(self, key: str, problem: ValueError, origin: str = "command line") -> ConfigError:
        """The one line refusing a value: the option, where it was set, what it must be, what it
        is for and an example (its default)."""
        where = "" if origin == "command line" else f" (set by the preset {origin})"
        about = f" ({self.text})" if self.text else ""
        return ConfigError(f"option {key}{where} {problem}{about}; e.g. --{key} {show_default(self.default)}")


@functools.lru_cache(maxsize=None)
def _class_options(cls: type) -> dict[str, Option]:
    """Dotted key -> Option for every leaf field of a config dataclass (nested ones included)."""
    out: dict[str, Option] = {}
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.name == "sections":  # the objectives' sections: each its own class
            continue
        if dataclasses.is_dataclass(tp):
            out.update({f"{f.name}.{k}": option for k, option in _class_options(tp).items()})
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        interval = Interval.parse(f.metadata["range"]) if "range" in f.metadata else None
        out[f.name] = Option(tp, default, interval, comments.get(f.name, ""))
    return out


def options(cfg: PretrainConfig | None = None) -> dict[str, Option]:
    """Every option (dotted key -> Option): the common sections, then each objective's section, of
    `cfg` or (None) of every registered objective."""
    sections = {name: config_cls for name, (config_cls, _) in OBJECTIVES.items()} if cfg is None else \
        {name: type(section) for name, section in cfg.sections.items()}
    out = dict(_class_options(PretrainConfig))
    for name, config_cls in sections.items():
        out.update({f"{name}.{k}": option for k, option in _class_options(config_cls).items()})
    return out


def valid_keys() -> dict[str, Any]:
    """Every option (dotted key -> type): the common sections, then each registered objective's."""
    return {key: option.type for key, option in options().items()}


def check_values(cfg: PretrainConfig, origins: dict[str, str] | None = None) -> None:
    """Every option's value of its type, finite and inside its field's range (`origins`: where each
    was set, for the message)."""
    for key, option in options(cfg).items():
        try:
            option.check(option_value(cfg, key))
        except ValueError as e:
            raise option.refusal(key, e, (origins or {}).get(key, "command line")) from None


def option_value(cfg: PretrainConfig, key: str) -> Any:
    target = cfg
    for part in key.split("."):
        target = getattr(target, part)
    return target
