"""The objective contract: what the loop, the entry points and the checkpoints may call on a method.

A method is an `Objective` (an nn.Module built from `(encoder, config)`) and its config, a
dataclass deriving from `ObjectiveConfig`, registered together under one name:

    @dataclass
    class PixelConfig(ObjectiveConfig):
        scale: float = 1.0

    @register_objective("pixel", PixelConfig)
    class PixelObjective(Objective):
        def forward(self, batch):
            return {"loss": ...}

The name selects it (`--objective pixel`) and names its command-line section (`--pixel.scale`);
the config's fields, defaults and comments are that section's `--help`. Every hook below has a
default here, so the loop never asks whether a method has it; a method overrides what it needs.

Checkpoints: extra state the optimizer does not own (AdPE's adversaries, MLO-MAE's masking
network and its AdamW state) goes through nn.Module's own `get_extra_state` / `set_extra_state`,
which the objective defines only when it has such state; state that differs between ranks (the
micro-batches MLO-MAE's levels II-III will still read) through `get_rank_state` / `set_rank_state`,
saved in each rank's own file of the checkpoint.
"""
from __future__ import annotations

import inspect
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn


class NoClassifierError(NotImplementedError):
    """Objective.predict called on an objective that trains no classifier (has_classifier() is
    False): the answer of the contract's default, not a missing implementation."""


class ObjectiveConfig:
    """Base of every objective's config dataclass. The checks run before any process starts
    (train/config/options.py); they raise ValueError with a message naming the option and the fix."""

    section: ClassVar[str] = ""  # the objective's name, its command-line section (set by register_objective)
    # Trains any timm model (model.name timm/<name>: ConvNeXt, Swin), which has no patch tokens to
    # mask or mix and no ViT head to replace; the others need this codebase's ViT.
    takes_timm_backbones: ClassVar[bool] = False

    def validate(self) -> None:
        """Checks of this section's values alone."""

    def encoder_overrides(self) -> dict[str, Any]:
        """Encoder constructor arguments this objective needs, applied over model.* (e.g. MAE+'s
        iRPE in every block, energy's twice-differentiable attention)."""
        return {}

    def check_fits(self, img_size: int, patch_size: int, depth: int, micro_batch: int) -> None:
        """Against the encoder's geometry and the micro-batch (e.g. MixedAE's mixing group)."""

    def check_engine(self, zero_stage: int, accum: int) -> None:
        """Against the engine: ZeRO stage and gradient accumulation steps."""

    def check_input(self, in_chans: int) -> None:
        """Against the input's channel count."""

    def check_labels(self, num_classes: int | None) -> None:
        """Against the training labels: the shards' class count (data.num_classes for synthetic data),
        None when they carry no labels (an unlabeled index, data/index_shards.py; its batches have no
        "label"). The default accepts both: objectives that read no labels pretrain on unlabeled shards. An objective that
        reads labels refuses None with a ValueError saying what it reads them for; the caller adds
        the index and the fix (train/config/options.py)."""

    def data_split(self) -> tuple[float, int] | None:
        """(share of the training samples held out as a validation split, split seed) for an
        objective that trains on two disjoint splits of the labeled shards (MLO-MAE); None = no split."""
        return None

    def val_every(self, accum: int) -> int:
        """With a data split: micro-batches between two validation batches in the stream."""
        return 1


class Objective(nn.Module, metaclass=ABCMeta):
    """Base of every objective. `forward(batch)` is the training step's loss:

    batch: "image" (B, C, H, W) in the compute dtype (or (B, k, C, s, s) multi-crop), "label" (B,)
           when the shards carry labels, and what the data source attaches (e.g. "val_image").
    returns: a dict with "loss" (a 0-dim fp32 tensor, the one the engine differentiates: fp16's loss
           scale of 2**16 is inf in 16 bits, so the engine refuses a 16-bit loss) plus named
           0-dim tensors, averaged over the log window and logged; other entries (non-0-dim)
           are outputs for inspection and are not logged.
    """

    name: ClassVar[str] = ""  # set by @register_objective
    # The loss differentiates through input gradients (energy restoration): memory estimates count
    # a second backward (train/estimate/costs.py) and run.compile is refused.
    double_backward: ClassVar[bool] = False
    # after_optimizer_step reads the weights (MLO-MAE's levels II-III): where the engine shards
    # them, it gathers them whole for the hook (train/engine/core.py)
    hook_reads_weights: ClassVar[bool] = False
    # Why the blocks' linear layers may not train in float8 (run.float8), or None: they may.
    float8_refusal: ClassVar[str | None] = None
    # The step computes matmuls its modules' forward hooks do not see (gradients taken inside the
    # forward: energy's restoration; passes after the optimizer step: MLO-MAE's levels II-III): its
    # FLOPs are counted by running it (train/estimate/step_flops.py), not modelled as 3 x forward.
    counted_flops: ClassVar[bool] = False

    def __init__(self, encoder: nn.Module, cfg: ObjectiveConfig):
        super().__init__()
        self.encoder = encoder
        self.cfg = cfg

    @abstractmethod  # the one hook without a default: a subclass without it cannot be built or registered
    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ...

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> class logits (B, num_classes), for objectives with a classifier
        (fine-tuning, linear probe, MLO-MAE's level-II head): data.eval_index scores it. The
        default is the answer "no classifier" (has_classifier() is False; config checks refuse
        data.eval_index for such objectives before start, so this raises only on a direct call)."""
        raise NoClassifierError(f"objective {self.name!r} has no classifier: predict needs one of "
                                f"{sorted(n for n, (_, c) in OBJECTIVES.items() if c.has_classifier())}")

    @classmethod
    def has_classifier(cls) -> bool:
        return cls.predict is not Objective.predict

    def no_weight_decay(self) -> set[str]:
        """Names of this module's own parameters kept out of weight decay (tokens, position
        tables), beside 1-d tensors, which never decay. Submodules list theirs the same way."""
        return set()

    def decayed_names(self) -> set[str]:
        """Dotted names (from this objective) that weight decay takes although a submodule's
        no_weight_decay exempts them (MAE+ `decay_tokens`, as AdPE's official code decays the cls
        token)."""
        return set()

    def outside_parameters(self) -> list[torch.Tensor]:
        """Parameters this objective trains with its own optimizers, outside its modules (MLO-MAE's
        masking network and level-II head): fp32, whole on every rank, each with a gradient and
        AdamW's two moments. The engine neither casts, shards nor optimises them; the memory
        estimate counts them (train/estimate/memory.py). Empty: none."""
        return []

    @property
    def after_step_period(self) -> int:
        """Optimizer steps over which `after_optimizer_step`'s work repeats (MLO-MAE: level II every
        level1_steps steps, level III every mask_every such cycles): what a count of its FLOPs
        averages over (train/estimate/step_flops.py)."""
        return 1

    def after_optimizer_step(self, lr: float, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """After every optimizer step: update state the optimizer does not own (AdPE's adversary
        ascent, MLO-MAE's levels II-III). `lr` is this step's encoder lr, `batches` the step's
        micro-batches as forward saw them. Returns 0-dim tensors to log for this step."""
        return {}

    def get_rank_state(self) -> dict[str, list[torch.Tensor]]:
        """This rank's state that a resume on the same ranks needs and no other rank holds (its own
        data): lists of tensors by name, saved beside the rank's RNG state. Empty: none."""
        return {}

    def set_rank_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Take back what get_rank_state gave (CPU tensors), at a resume on the same world size."""

    def visualizations(self, images: torch.Tensor, noise: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Figures for the run folder (train/run/visualize.py): name -> rows of (B, C, H, W) images
        in the input's normalisation. `noise` (B, N) in [0, 1) fixes the masks across steps."""
        return {}


# name -> (config class, objective class), filled by @register_objective
OBJECTIVES: dict[str, tuple[type[ObjectiveConfig], type[Objective]]] = {}


@dataclass
class ClassifierConfig(ObjectiveConfig):
    """The config of an objective that trains a classifier on the training labels (finetune,
    linprobe): its output count, checked against the labels before start."""

    num_classes: int = field(default=1000, metadata={"range": "[2, inf)"})  # classifier outputs (the labeled shards' class count)

    def check_labels(self, num_classes: int | None) -> None:
        if num_classes is None:
            raise ValueError(f"objective {self.section} trains its classifier on the labels")
        if num_classes > self.num_classes:  # labels past the classifier's outputs fail in the first step
            raise ValueError(f"the training labels have {num_classes} classes but {self.section}.num_classes is "
                             f"{self.num_classes}; set --{self.section}.num_classes {num_classes}")
        # fewer trains, wrongly: softmax mass (and label smoothing's) goes to outputs no sample has
        if num_classes < self.num_classes:
            raise ValueError(f"the training labels have {num_classes} classes but {self.section}.num_classes is "
                             f"{self.num_classes}: its other {self.num_classes - num_classes} outputs would be classes "
                             f"no sample has; set --{self.section}.num_classes {num_classes}")


def register_objective(name: str, config: type[ObjectiveConfig]):
    """Class decorator: make `cls` selectable as `--objective name` with `config` as `--name.*`."""
    if not name.isidentifier():
        raise ValueError(f"objective name {name!r} must be a Python identifier (it names a config section)")
    if not issubclass(config, ObjectiveConfig):
        raise TypeError(f"{config.__name__} must derive from ObjectiveConfig")

    def decorate(cls: type[Objective]) -> type[Objective]:
        if not issubclass(cls, Objective):
            raise TypeError(f"{cls.__name__} must derive from Objective")
        if inspect.isabstract(cls):
            raise TypeError(f"{cls.__name__} must define forward(batch) -> {{'loss': ...}}")
        if name in OBJECTIVES and OBJECTIVES[name][1] is not cls:
            raise ValueError(f"objective {name!r} is already registered by {OBJECTIVES[name][1].__qualname__}")
        cls.name = config.section = name
        OBJECTIVES[name] = (config, cls)
        return cls

    return decorate


def list_objectives() -> list[str]:
    return sorted(OBJECTIVES)


def build_objective(name: str, encoder: nn.Module, cfg: ObjectiveConfig) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {list_objectives()}")
    return OBJECTIVES[name][1](encoder, cfg)
