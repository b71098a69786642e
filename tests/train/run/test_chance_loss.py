"""train/run/chance_loss.py: a classifier whose loss still sits at ln(classes) after a quarter of its
steps is named; one that learns, or is early, is not."""
import math

from train.run.chance_loss import ChanceLoss


def test_at_chance_only_after_a_quarter_and_within_two_percent():
    watch = ChanceLoss(num_classes=10, stop_step=100)
    assert not watch.at_chance(20, math.log(10))  # before step 25: too early to judge
    assert watch.at_chance(25, 0.99 * math.log(10))
    assert watch.first_time() and not watch.first_time()  # said once
    assert "2.280 at step 25 is within 2% of chance (ln 10 = 2.303)" in watch.message()
    assert not watch.at_chance(50, 0.97 * math.log(10)) and watch.last is None  # learning now: cleared
    assert watch.at_chance(100, 2.34)  # above chance counts too (the probe of the report: 2.34)


def test_a_quarter_of_a_run_rounds_up():
    """10 steps: a quarter is 2.5 steps, so step 2 is still too early and step 3 is past it."""
    watch = ChanceLoss(num_classes=10, stop_step=10)
    assert not watch.at_chance(2, math.log(10))
    assert watch.at_chance(3, math.log(10))


def test_a_loss_above_chance_counts_as_not_learning():
    """A classifier worse than guessing (10 classes: loss 3.5 past ln 10 = 2.303, e.g. diverged) is
    not learning either: only a loss below the band around chance clears it."""
    watch = ChanceLoss(num_classes=10, stop_step=100)
    assert 3.5 > 1.02 * math.log(10)
    assert watch.at_chance(50, 3.5) and watch.last == (50, 3.5)
