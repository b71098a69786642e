"""train/run/loop.py's log window: its throughput counts training only (not checkpoints, evaluation
or figures), and its loss is the mean over the window's finite micro-batch losses."""
import math

import pytest
import torch

import train.run.loop as loop
from train.engine import EngineConfig, build
from train.engine.nonfinite import NonFiniteError
from train.engine.optim import WarmupCosineSchedule
from train.run.loop import LoopSettings, LoopState, run


class Recorded(torch.nn.Module):
    """An objective whose loss is NaN at the given calls (counted from 1); it keeps every loss it
    returned, and each call takes a second of `clock` when one is given."""

    def __init__(self, nan_at: set[int] = frozenset(), clock: list[float] | None = None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))
        self.nan_at, self.clock, self.losses = nan_at, clock, []

    def forward(self, batch):
        if self.clock is not None:
            self.clock[0] += 1.0
        loss = (self.w * batch["image"]).sum() * (float("nan") if len(self.losses) + 1 in self.nan_at else 1.0)
        self.losses.append(loss.detach())
        return {"loss": loss}

    def after_optimizer_step(self, lr, batches):
        return {}


def engine_of(module: Recorded, accum: int = 1):
    return build(module, [{"params": [module.w], "weight_decay": 0.0}],
                 lambda groups: torch.optim.AdamW(groups, lr=0.0, fused=True),
                 lambda opt: WarmupCosineSchedule(opt, 0.1, 0.0, 0, 100),
                 EngineConfig(0, "fp32", accum, 0.0), torch.device("cpu"))


def images():
    return iter({"image": torch.full((2,), float(i))} for i in range(1, 1000))


def train(module: Recorded, settings: LoopSettings, accum: int = 1, **callbacks) -> dict[int, dict]:
    """`module` trained through the loop on images 1, 2, 3, ...: the metrics of each logged step."""
    logged = {}
    run(engine_of(module, accum), images(), settings, LoopState(0), torch.device("cpu"), torch.float32,
        lambda step, metrics: logged.update({step: metrics}), callbacks.pop("on_checkpoint", lambda step: None),
        **callbacks)
    return logged


def test_evaluation_and_figure_time_is_left_out_of_throughput(monkeypatch):
    """Evaluation at a log step and mid-window, figures likewise, a checkpoint too: each window's
    step_time is its steps' own second (a fake clock: each step 1 s, each callback 10 s)."""
    clock = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])

    def slow(step):
        clock[0] += 10.0

    settings = LoopSettings(12, log_every=4, ckpt_every=6, global_batch=4, vis_every=3, eval_every=2)
    logged = train(Recorded(clock=clock), settings, on_checkpoint=slow, on_evaluate=slow, on_visualize=slow)
    assert [logged[s]["step_time"] for s in (4, 8, 12)] == [1.0, 1.0, 1.0]
    assert [logged[s]["images_per_s"] for s in (4, 8, 12)] == [4.0, 4.0, 4.0]


def test_the_last_step_closes_a_short_window_logged_at_its_own_throughput(monkeypatch):
    """Stop at 10, log every 4: the last step logs the window of steps 9-10, its step time each
    step's one second and its images per second the global batch of 4 over that second."""
    clock = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    logged = train(Recorded(clock=clock), LoopSettings(10, log_every=4, ckpt_every=100, global_batch=4))
    assert sorted(logged) == [4, 8, 10]
    assert [logged[s]["step_time"] for s in (4, 8, 10)] == [1.0, 1.0, 1.0]
    assert [logged[s]["images_per_s"] for s in (4, 8, 10)] == [4.0, 4.0, 4.0]


def test_figures_are_drawn_every_vis_every_steps_and_at_the_last_step():
    figures = []
    train(Recorded(), LoopSettings(10, log_every=4, ckpt_every=100, global_batch=4, vis_every=4),
          on_visualize=figures.append)
    assert figures == [4, 8, 10]


def test_a_window_logs_the_mean_of_its_finite_losses_and_counts_the_others():
    """Two micro-batches a step, log every 2 steps: NaN at micro-batch 3 (step 2) leaves the
    window of steps 1-2 the mean of the other three; steps 3-4 (both NaN) have no finite loss."""
    module = Recorded(nan_at={3, 5, 6, 7, 8})
    logged = train(module, LoopSettings(6, log_every=2, ckpt_every=100, global_batch=4), accum=2)
    losses = [x.item() for x in module.losses]
    assert logged[2]["loss"] == pytest.approx((losses[0] + losses[1] + losses[3]) / 3, rel=1e-12)
    assert logged[2]["nonfinite_losses"] == 1
    assert math.isnan(logged[4]["loss"]) and logged[4]["nonfinite_losses"] == 4
    # a finite window: exactly the plain mean over its micro-batches, and no count
    assert logged[6]["loss"] == torch.stack(module.losses[8:12]).double().mean().item()
    assert "nonfinite_losses" not in logged[6]


def test_on_a_gpu_the_queued_training_work_is_finished_before_a_callback_is_timed(monkeypatch):
    """An evaluation at a step that neither logs nor saves follows no read: the kernels still queued
    would finish inside its timer and be taken out of the window's time."""
    order = []

    class Stream:
        def synchronize(self):
            order.append("synchronize")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    loop._seconds(lambda step: order.append(f"evaluate {step}"), 7, torch.device("cuda", 0))
    loop._seconds(lambda step: order.append(f"evaluate {step}"), 8, torch.device("cpu"))
    assert order == ["synchronize", "evaluate 7", "evaluate 8"]


@pytest.mark.parametrize("signal_at, stopped, saved_at", [
    (4, False, [4]),  # in the last step: the run is finished (exported, exit 0), not interrupted
    (3, True, [3]),  # before it: a checkpoint of the step reached, and the run reports the stop
])
def test_a_stop_signal_interrupts_only_a_run_with_steps_left(signal_at, stopped, saved_at):
    state, saved = LoopState(0), []
    result = run(engine_of(Recorded()), images(), LoopSettings(4, log_every=2, ckpt_every=100, global_batch=4), state,
                 torch.device("cpu"), torch.float32, lambda step, metrics: None, saved.append,
                 should_stop=lambda step: step == signal_at)
    assert result is stopped
    assert saved == saved_at and state.step == signal_at


def test_a_stop_signal_at_a_checkpoint_step_stops_there_and_saves_it_once():
    """The signal lands on step 2 of 6, which saves anyway (ckpt_every 2): the run stops at that step,
    not one later, with that step's one checkpoint (no second write of the same step)."""
    state, saved = LoopState(0), []
    result = run(engine_of(Recorded()), images(), LoopSettings(6, log_every=3, ckpt_every=2, global_batch=4), state,
                 torch.device("cpu"), torch.float32, lambda step, metrics: None, saved.append,
                 should_stop=lambda step: step >= 2)  # once received, every later round agrees to stop
    assert result is True
    assert state.step == 2 and saved == [2]


def test_a_nonfinite_streak_is_caught_at_a_checkpoint_step_before_it_is_saved():
    """NaN losses at steps 2 and 3 reach the limit of 2 at step 3, a checkpoint step but no log step
    (log every 4): the counters are read there, so the run stops at 3 without writing that checkpoint."""
    state, saved = LoopState(0), []
    settings = LoopSettings(8, log_every=4, ckpt_every=3, global_batch=4, max_nonfinite_steps=2)
    with pytest.raises(NonFiniteError, match=r"\(2-3\)"):
        run(engine_of(Recorded(nan_at={2, 3})), images(), settings, state, torch.device("cpu"), torch.float32,
            lambda step, metrics: None, saved.append)
    assert state.step == 3 and saved == []


def test_after_a_resume_a_nonfinite_run_is_placed_among_this_runs_steps():
    """Resumed at step 10, NaN at steps 11-12 (limit 2), finite again by the read at step 16: the
    error places the run of skipped steps after the resumed step, between 11 and 16."""
    settings = LoopSettings(20, log_every=8, ckpt_every=100, global_batch=4, max_nonfinite_steps=2)
    with pytest.raises(NonFiniteError, match="between steps 11 and 16"):
        run(engine_of(Recorded(nan_at={1, 2})), images(), settings, LoopState(10), torch.device("cpu"),
            torch.float32, lambda step, metrics: None, lambda step: None)
