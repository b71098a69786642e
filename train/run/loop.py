"""The one training loop: every objective, every precision and ZeRO stage go through here.

Per optimizer step: `accum` micro-batches of objective(batch) -> engine.backward -> engine.step,
then the objective's after-step hook. Logged scalars and the engine's counters stay on the device
between reads; the loop reads them (one host-device sync) at log steps and before checkpoints,
and never inside a step (tools/census.py counts it; tests/train/estimate/test_census.py keeps it so).
"""
from __future__ import annotations

import contextlib
import math
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from train.engine import fault_injection
from train.engine.nonfinite import StepHealth, nan_if_not_finite


def no_phases(name: str) -> AbstractContextManager:
    """The loop's default phase marker: marks nothing."""
    return contextlib.nullcontext()


@dataclass(frozen=True)
class LoopSettings:
    """What one call of run() does: where it ends, its cadences (in optimizer steps)."""
    stop_step: int  # exclusive end of this invocation
    log_every: int
    ckpt_every: int
    global_batch: int  # samples per optimizer step over all ranks (images/s)
    vis_every: int = 0  # 0 = no figures
    eval_every: int = 0  # 0 = evaluate only at the end (when an evaluation is given)
    max_nonfinite_steps: int = 0  # consecutive skipped (non-finite) steps that stop the run; 0 = never
    keep_every: int = 0  # steps between checkpoints that are never pruned (run.keep_every_epochs); 0 = none

    def kept_for_later(self, step: int) -> bool:
        """The checkpoint at `step` is one that pruning spares (run.keep_every_epochs)."""
        return bool(self.keep_every) and step % self.keep_every == 0


@dataclass
class LoopState:
    """The loop's progress, owned by its caller (which resumes it and reads it after run())."""
    step: int = 0  # optimizer steps completed


def _to_device(batch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    out["image"] = out["image"].to(dtype)  # the model's compute dtype (fp32 / bf16 / fp16)
    return out


def _window_stats(values: torch.Tensor) -> torch.Tensor:
    """(mean, sum of the finite values, how many are finite, how many are not) of one scalar's
    window, in float64; the plain mean stays the logged value of a window without a non-finite one."""
    finite = torch.isfinite(values)
    return torch.stack([values.mean(), torch.where(finite, values, 0.0).sum(), finite.sum(dtype=torch.float64),
                        (~finite).sum(dtype=torch.float64)])


def read_window(window: dict[str, list[torch.Tensor]], device_state: dict[str, torch.Tensor],
                counters: dict[str, int], device: torch.device) -> dict[str, float]:
    """The one host-device sync of a read: the means of the window's logged 0-dim tensors (over
    its micro-batches or steps, and over ranks), the engine's device state (gradient norm, skip
    counters, fp16 scale: the same on every rank) and the data source's counters (host integers,
    summed over ranks) come back in one `.tolist()`; with a process group, means and counters
    share one all-reduce. A non-finite value (a skipped step's loss) is left out of its scalar's
    mean, which is NaN only when none is finite; `nonfinite_losses` counts the losses left out."""
    names = sorted(window)
    parts = [torch.stack([_window_stats(torch.stack(window[k]).double()) for k in names]).flatten()] if names else []
    reduce_counters = dist.is_initialized() and bool(counters)
    if reduce_counters:  # copied to the device without waiting for it
        parts.append(torch.tensor(list(counters.values()), dtype=torch.float64).to(device, non_blocking=True))
    if dist.is_initialized() and parts:
        reduced = torch.cat(parts)
        dist.all_reduce(reduced)
        reduced[:4 * len(names)].view(-1, 4)[:, 0] /= dist.get_world_size()  # sums and counts stay sums
        parts = [reduced]
    engine_names = list(device_state)
    if engine_names:
        parts.append(torch.stack([device_state[k].detach().double().reshape(()) for k in engine_names]))
    read = torch.cat(parts).tolist() if parts else []  # the sync
    metrics = {}
    for i, k in enumerate(names):
        mean, finite_sum, finite, left_out = read[4 * i:4 * i + 4]
        metrics[k] = mean if not left_out else finite_sum / finite if finite else math.nan
        if k == "loss" and left_out:
            metrics["nonfinite_losses"] = round(left_out)
    read = read[4 * len(names):]
    if reduce_counters:
        metrics.update(zip(counters, map(round, read[:len(counters)]), strict=True))
    else:
        metrics.update(counters)
    metrics.update(zip(engine_names, read[len(read) - len(engine_names):]))
    return metrics


def _seconds(callback: Callable[[int], None], step: int, device: torch.device) -> float:
    """How long `callback(step)` took. On a GPU the training work still queued is finished first (an
    evaluation or figure at a step that neither logs nor saves follows no read), so that its time
    stays the window's; the callback waits for the device anyway."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    start = time.perf_counter()
    callback(step)
    return time.perf_counter() - start


def run(
    engine,
    data: Iterator[dict[str, torch.Tensor]],
    settings: LoopSettings,
    state: LoopState,
    device: torch.device,
    dtype: torch.dtype,
    on_log: Callable[[int, dict[str, float]], None],
    on_checkpoint: Callable[[int], None],
    on_visualize: Callable[[int], None] = lambda step: None,
    on_evaluate: Callable[[int], None] | None = None,
    should_stop: Callable[[int], bool] = lambda step: False,
    phase: Callable[[str], AbstractContextManager] = no_phases,
) -> bool:
    """Train from state.step until settings.stop_step, counting steps in state.step; True when
    `should_stop` (a collective: train/run/preemption.py) ended it early, after a checkpoint of the
    step reached. `phase(name)` marks the parts of each step (data, forward, backward, step,
    hook) for tools/census.py; what is unmarked is the loop's own."""
    accum = engine.accum
    # An objective may own state the optimizer does not update (AdPE's adversaries, MLO-MAE's
    # masking network and head): after every optimizer step it gets the step's lr and micro-batches
    # and may return 0-dim tensors to log for that step.
    after_step = engine.after_optimizer_step  # the objective's, with whole weights where it reads them
    window: dict[str, list[torch.Tensor]] = {}  # logged 0-dim tensors of this window, kept on the device
    t_last, steps_since_log = time.perf_counter(), 0
    health = StepHealth(settings.max_nonfinite_steps)
    health.last_read = state.step
    # CUDA graphs of compiled blocks: each micro-batch's forward starts a new generation of replays
    # (the previous one's outputs, consumed by its backward, may be overwritten)
    new_graph_step = torch.compiler.cudagraph_mark_step_begin if getattr(engine, "cuda_graphs", False) else (lambda: None)
    while state.step < settings.stop_step:
        step = state.step + 1
        log_now = step % settings.log_every == 0 or step == settings.stop_step
        batches: list[dict[str, torch.Tensor]] = []  # this step's micro-batches, as the objective saw them
        for _ in range(accum):
            with phase("data"):
                batches.append(_to_device(next(data), device, dtype))
            with phase("forward"):
                new_graph_step()
                out = engine(batches[-1])
            out["loss"] = fault_injection.poison_loss(out["loss"], step)
            with phase("backward"):
                # a non-finite loss gives NaN gradients: the engine then skips the step (train/engine/nonfinite.py)
                engine.backward(nan_if_not_finite(out["loss"]))
            lr = engine.get_lr()  # this step's (the schedule moves on in the last micro-batch's engine.step)
            with phase("step"):
                engine.step()
            for k, v in out.items():
                if v.ndim == 0:
                    window.setdefault(k, []).append(v.detach())
        with phase("hook"):  # objective state outside the optimizer
            extra = after_step(lr, batches)
        for k, v in extra.items():
            window.setdefault(k, []).append(v.detach())
        state.step = step
        steps_since_log += 1
        fault_injection.at("after_step", step)
        fault_injection.slow_down(step)
        last = step == settings.stop_step
        save = step % settings.ckpt_every == 0 or last or settings.kept_for_later(step)
        if log_now or save:  # the counters decide whether this run may go on (and be saved)
            counters = data.counters() if log_now and hasattr(data, "counters") else {}  # host integers, this rank's
            metrics = read_window(window if log_now else {}, engine.device_state(), counters, device)
            engine.health.window_read()
            health.check(metrics, step, engine.module)
        if log_now:
            elapsed = time.perf_counter() - t_last  # after the read: the device work is done
            metrics["lr"] = lr
            metrics["skipped_steps"] = round(metrics["skipped_steps"])
            metrics["step_time"] = elapsed / steps_since_log
            metrics["images_per_s"] = settings.global_batch * steps_since_log / elapsed
            for k in ("nonfinite_streak", "nonfinite_worst", "loss_scale_collapsed"):
                metrics.pop(k, None)
            on_log(step, metrics)
            window, t_last, steps_since_log = {}, time.perf_counter(), 0
        # checkpoints, evaluation and figures are not training throughput: the window's start moves by
        # their time (a reset would drop the window's earlier steps from the time but not from the count)
        if on_evaluate is not None and (last or (settings.eval_every and step % settings.eval_every == 0)):
            t_last += _seconds(on_evaluate, step, device)
        if settings.vis_every and (step % settings.vis_every == 0 or last):
            t_last += _seconds(on_visualize, step, device)
        if save:
            t_last += _seconds(on_checkpoint, step, device)
        if not last and should_stop(step):
            if not save:
                on_checkpoint(step)
            return True
    return False
