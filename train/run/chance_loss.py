"""A classifier that is not learning: its training cross-entropy still sits at chance, ln(classes),
once the run has trained long enough at its full lr to be expected to have left it. A linear probe
whose lr does not fit its optimizer and batch ends that way silently (the loss stays at ln 10 = 2.30
while the run looks healthy), so a probe or fine-tuning run says so in its log and at its end, with
what usually causes it for its command (docs/EVALUATION.md).

When a loss counts (`ChanceLoss.from_step`): the lr warms up linearly from 0, so a loss at chance
during the warmup, or just after it, says nothing. The warmup's length is the run's own measure of
how long its lr takes to become useful, so a logged step is judged only once the warmup has ended
and the run has trained past it for as many steps again (at least SETTLE_STEPS), and past a quarter
of the run: W warmup steps of S are judged from max(S / 4, W + max(W, SETTLE_STEPS)), rounded up.
A run that stops before then (a shortened one, `--run.max_steps`) is not judged.
"""
from __future__ import annotations

import math

from model.objectives.base import ClassifierConfig
from train.config.options import PretrainConfig, section

NEAR = 0.02  # within 2% of ln(classes)
SETTLE_STEPS = 10  # the fewest optimizer steps after the warmup before a loss at chance is judged
CPU_RECIPE = "train/configs/linprobe/cpu_recipe.json"
GENERIC_ADVICE = "Usually the lr does not fit the optimizer and batch, or the labels do not match the images"
LARS_SMALL_LR = 1.0  # a LARS step moves each weight by lr x trust (0.001) of its norm: below lr 1, < 0.1% of it


class ChanceLoss:
    """Watches the logged training loss of a classifier of `num_classes` outputs over a run that
    ends at `stop_step` and warms its lr up over `warmup_steps` (optimizer steps, fractional);
    `at_chance` is given every logged (step, loss). `advice`: what usually causes it, for the message."""

    def __init__(self, num_classes: int, stop_step: int, warmup_steps: float = 0.0, advice: str = GENERIC_ADVICE):
        self.chance = math.log(num_classes)
        self.num_classes = num_classes
        self.warmup_end = math.ceil(warmup_steps)  # the step the warmup ends at
        self.from_step = max(1, math.ceil(stop_step / 4), self.warmup_end + max(self.warmup_end, SETTLE_STEPS))
        self.advice = advice
        self.last: tuple[int, float] | None = None  # the latest logged step whose loss was at chance
        self.said = False

    def at_chance(self, step: int, loss: float) -> bool:
        """Whether the loss logged at `step` counts: judged (from_step on) and within NEAR of ln(classes)
        or above it."""
        near = step >= self.from_step and loss >= (1 - NEAR) * self.chance
        self.last = (step, loss) if near else None
        return near

    def message(self) -> str:
        step, loss = self.last
        after = f", {step - self.warmup_end} steps after the lr warmup ended" if self.warmup_end else ""
        return (f"the training loss {loss:.3f} at step {step} is within {NEAR:.0%} of chance (ln {self.num_classes} = "
                f"{self.chance:.3f}){after}: the classifier is not learning. {self.advice}")

    def first_time(self) -> bool:
        """True once: the first logged step at chance."""
        if self.last is None or self.said:
            return False
        self.said = True
        return True


def chance_watch(cfg: PretrainConfig, peak_lr: float, warmup_steps: float, stop_step: int) -> ChanceLoss | None:
    """The watch of a run whose objective trains a classifier (linear probe, fine-tuning), None for
    any other, with the advice that fits its command and optimizer."""
    classifier = section(cfg)
    if not isinstance(classifier, ClassifierConfig):
        return None
    return ChanceLoss(classifier.num_classes, stop_step, warmup_steps, advice(cfg, peak_lr))


def advice(cfg: PretrainConfig, peak_lr: float) -> str:
    """What usually keeps this run's classifier at chance, said for its command and optimizer: a
    recipe is named only where the run is not already on it."""
    lr = f"peak lr {peak_lr:.3g} = optim.blr {cfg.optim.blr:g} x global batch / 256"
    labels = "or the labels do not match the images"
    if cfg.optim.name == "lars" and peak_lr < LARS_SMALL_LR:  # its lr is a step relative to each weight's norm
        recipe = (f", or on a CPU use {CPU_RECIPE} (AdamW, whose step does not depend on the weight's norm)"
                  if cfg.objective == "linprobe" else "")
        return (f"Usually the lr is far too small for LARS, which needs one of order 1 ({lr}: the rule gives a small "
                f"batch far less): raise --optim.blr{recipe}; {labels}")
    if cfg.objective == "finetune":
        decay = f", layer-wise decay optim.layer_decay {cfg.optim.layer_decay:g} below it" * (cfg.optim.layer_decay < 1)
        return (f"Usually the lr does not fit optim.name {cfg.optim.name} at this batch ({lr}{decay}): a smaller "
                f"--optim.blr settles a loss above chance, a larger one moves a loss that sits at it; {labels}")
    return (f"Usually the lr does not fit optim.name {cfg.optim.name} at this batch ({lr}): a larger --optim.blr moves "
            f"a head that stays at its start, a smaller one settles a loss above chance; {labels}")
