"""The line that ends a run's log."""
from __future__ import annotations

import time


class RunSummary:
    """The line that ends a run's log (rank 0): its steps, time, last loss, throughput and skipped
    steps, from the windows the loop logged (no device read of its own)."""

    def __init__(self, first_step: int, global_batch: int):
        self.first_step, self.global_batch = first_step, global_batch
        self.started = time.perf_counter()
        self.logged_step, self.last = first_step, {}
        self.training_s = 0.0  # the logged windows' own time: without checkpoints, evaluation and figures

    def add(self, step: int, metrics: dict) -> None:
        self.training_s += metrics["step_time"] * (step - self.logged_step)
        self.logged_step, self.last = step, metrics

    def line(self, step: int) -> str | None:
        """'trained steps A-B in T s: ...' after step `step`; None when no window was logged."""
        if not self.last:
            return None
        images_per_s = self.global_batch * (self.logged_step - self.first_step) / self.training_s
        return (f"trained steps {self.first_step + 1}-{step} in {time.perf_counter() - self.started:.1f} s: loss "
                f"{self.last['loss']:.4g} (last window), {images_per_s:.0f} images/s over the run, "
                f"{self.last['skipped_steps']} skipped step(s)")
