"""A classifier that is not learning: its training cross-entropy still sits at chance, ln(classes),
after a quarter of its steps. A linear probe whose lr does not fit its optimizer and batch ends that
way silently (the loss stays at ln 10 = 2.30 while the run looks healthy), so a probe or fine-tuning
run says so in its log and at its end, with what usually causes it (docs/EVALUATION.md).
"""
from __future__ import annotations

import math

NEAR = 0.02  # within 2% of ln(classes)


class ChanceLoss:
    """Watches the logged training loss of a classifier of `num_classes` outputs over a run that
    ends at `stop_step`; `check` is given every logged (step, loss)."""

    def __init__(self, num_classes: int, stop_step: int):
        self.chance = math.log(num_classes)
        self.num_classes = num_classes
        self.from_step = max(1, math.ceil(stop_step / 4))
        self.last: tuple[int, float] | None = None  # the latest logged step whose loss was at chance
        self.said = False

    def at_chance(self, step: int, loss: float) -> bool:
        """Whether the loss logged at `step` counts: past a quarter of the run and within NEAR of ln(classes)."""
        near = step >= self.from_step and loss >= (1 - NEAR) * self.chance
        self.last = (step, loss) if near else None
        return near

    def message(self) -> str:
        step, loss = self.last
        return (f"the training loss {loss:.3f} at step {step} is within {NEAR:.0%} of chance (ln {self.num_classes} = "
                f"{self.chance:.3f}) after a quarter of the run: the classifier is not learning. Usually the lr "
                f"does not fit the optimizer and batch (LARS needs an lr of order 1: blr x batch / 256 at a small "
                f"batch gives it far less; on a CPU use train/configs/linprobe/cpu_recipe.json), or the labels "
                f"do not match the images")

    def first_time(self) -> bool:
        """True once: the first logged step at chance."""
        if self.last is None or self.said:
            return False
        self.said = True
        return True
