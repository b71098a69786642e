"""train/run/chance_loss.py: a classifier whose loss still sits at ln(classes) once the run has
trained long enough past its lr warmup (and past a quarter of its steps) is named, with advice for
its command; one that learns, or is early, or whose run is too short to judge, is not."""
import math

import pytest
from conftest import REPO

from train.config.parsing import parse_args
from train.run.chance_loss import SETTLE_STEPS, ChanceLoss, chance_watch

RECIPES = REPO / "train" / "configs"
LINPROBE_MAE = RECIPES / "linprobe" / "mae_recipe.json"
LINPROBE_CPU = RECIPES / "linprobe" / "cpu_recipe.json"
FINETUNE_MAE = RECIPES / "finetune" / "mae_recipe.json"


def test_at_chance_only_after_a_quarter_and_within_two_percent():
    watch = ChanceLoss(num_classes=10, stop_step=100)
    assert not watch.at_chance(20, math.log(10))  # before step 25: too early to judge
    assert watch.at_chance(25, 0.99 * math.log(10))
    assert watch.first_time() and not watch.first_time()  # said once
    assert "2.280 at step 25 is within 2% of chance (ln 10 = 2.303): the classifier is not learning" in watch.message()
    assert not watch.at_chance(50, 0.97 * math.log(10)) and watch.last is None  # learning now: cleared
    assert watch.at_chance(100, 2.34)  # above chance counts too (the probe of the report: 2.34)


def test_a_loss_above_chance_counts_as_not_learning():
    """A classifier worse than guessing (10 classes: loss 3.5 past ln 10 = 2.303, e.g. diverged) is
    not learning either: only a loss below the band around chance clears it."""
    watch = ChanceLoss(num_classes=10, stop_step=100)
    assert 3.5 > 1.02 * math.log(10)
    assert watch.at_chance(50, 3.5) and watch.last == (50, 3.5)


def test_a_run_is_judged_once_past_its_warmup_by_as_many_steps_again():
    """70.2 warmup steps (the CPU probe's 0.3 epochs of 234): the lr reaches its peak at step 71, and
    the loss is judged from step 142 on, though a quarter of the 200-step run is step 50."""
    watch = ChanceLoss(num_classes=10, stop_step=200, warmup_steps=70.2)
    assert not watch.at_chance(141, math.log(10)) and watch.last is None
    assert watch.at_chance(142, math.log(10))
    assert "at step 142 is within 2% of chance (ln 10 = 2.303), 71 steps after the lr warmup ended" in watch.message()


def test_a_shortened_run_is_not_judged():
    """The CPU probe stopped at step 2 (--run.max_steps 2) is still in its 70-step warmup, its lr near
    0 and its loss at ln 10: nothing is said, and eval.json's training_loss_at_chance is false."""
    watch = ChanceLoss(num_classes=10, stop_step=2, warmup_steps=70.2)
    assert not watch.at_chance(2, 2.304) and watch.last is None and not watch.first_time()
    no_warmup = ChanceLoss(num_classes=10, stop_step=10)  # a quarter would be step 3: too few steps to judge
    assert not any(no_warmup.at_chance(step, math.log(10)) for step in range(1, SETTLE_STEPS))
    assert no_warmup.at_chance(SETTLE_STEPS, math.log(10))


def _cfg(*presets, extra=()):
    return parse_args([arg for p in presets for arg in ("--config", str(p))] + [
        "--ds_config", str(REPO / "ds_configs" / "cpu_linprobe.json"), "--data.source", "synthetic",
        "--data.epoch_size", "2560", "--model.name", "vit_debug_patch4", "--data.num_classes", "1000", *extra])


def test_the_advice_fits_the_command_and_names_no_recipe_already_in_use():
    lars_probe = chance_watch(_cfg(LINPROBE_MAE), 0.1 * 8 / 256, 2.0, 20)
    assert "far too small for LARS" in lars_probe.advice
    assert "on a CPU use train/configs/linprobe/cpu_recipe.json (AdamW" in lars_probe.advice
    cpu_probe = chance_watch(_cfg(LINPROBE_MAE, LINPROBE_CPU), 3e-2, 2.0, 20)  # the CPU recipe: no other recipe
    assert "cpu_recipe" not in cpu_probe.advice and "LARS" not in cpu_probe.advice
    assert "the lr does not fit optim.name adamw at this batch (peak lr 0.03 = optim.blr 0.03" in cpu_probe.advice
    finetune = chance_watch(_cfg(FINETUNE_MAE), 5e-4 * 256 / 256, 2.0, 20)
    assert "LARS" not in finetune.advice and "linprobe" not in finetune.advice
    assert "optim.name adamw" in finetune.advice and "layer-wise decay optim.layer_decay 0.65" in finetune.advice
    assert chance_watch(_cfg(RECIPES / "mae" / "debug.json"), 1e-4, 2.0, 20) is None  # no classifier, no watch


@pytest.mark.parametrize("warmup_epochs", ["1", "0"])
def test_the_watch_of_a_run_takes_its_warmup_and_length(warmup_epochs):
    cfg = _cfg(FINETUNE_MAE, extra=["--optim.warmup_epochs", warmup_epochs])
    watch = chance_watch(cfg, 5e-4, 10.0 * float(warmup_epochs), 10)  # 10 steps per epoch of 2560 at 256
    assert watch.from_step == (20 if warmup_epochs == "1" else SETTLE_STEPS)
    assert watch.num_classes == cfg.finetune.num_classes
