"""The one training loop: every objective, every precision and ZeRO stage go through here.

Per optimizer step: `accum` micro-batches of objective(batch) -> engine.backward -> engine.step.
Scalars stay on the device between log steps; our code syncs the host with the device once per
log step (`read_window`) and never in between. DeepSpeed's own per-step syncs (its overflow
check) are counted in tests/train/test_host_syncs.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from train import fault_injection
from train.nonfinite import StepHealth, loss_scale, loss_scale_collapse, nan_if_not_finite


@dataclass(frozen=True)
class LoopSettings:
    """What one call of run() does: where it stops, its cadences (in optimizer steps)."""
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


def _fp32_grad_norm(module: torch.nn.Module) -> torch.Tensor:
    norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return torch.stack(norms).norm() if norms else torch.zeros(())


def read_window(sums: dict[str, torch.Tensor], counts: dict[str, float], grad_norm, counters: dict[str, int],
                device: torch.device) -> dict[str, float]:
    """The log step's one host-device sync: the window's means of the logged 0-dim tensors
    (averaged over ranks), the gradient norm (a device tensor, a host float or None) and the
    data source's counters (host integers, summed over ranks) come back in one `.tolist()`;
    with a process group, means and counters share one all-reduce."""
    names = sorted(sums)
    parts = [torch.stack([sums[k] / counts[k] for k in names]).double()] if names else []
    reduce_counters = dist.is_initialized() and bool(counters)
    if reduce_counters:  # copied to the device without waiting for it
        parts.append(torch.tensor(list(counters.values()), dtype=torch.float64).to(device, non_blocking=True))
    if dist.is_initialized() and parts:
        reduced = torch.cat(parts)
        dist.all_reduce(reduced)
        reduced[:len(names)] /= dist.get_world_size()
        parts = [reduced]
    norm_on_device = isinstance(grad_norm, torch.Tensor)
    if norm_on_device:  # the same on every rank: joins after the all-reduce
        parts.append(grad_norm.detach().double().reshape(1).to(device, non_blocking=True))
    read = torch.cat(parts).tolist() if parts else []  # the sync
    metrics = dict(zip(names, read[:len(names)]))
    if reduce_counters:
        metrics.update(zip(counters, map(round, read[len(names):len(names) + len(counters)]), strict=True))
    else:
        metrics.update(counters)
    if norm_on_device:
        metrics["grad_norm"] = read[-1]
    elif grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    return metrics


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
) -> bool:
    """Train from state.step until settings.stop_step, counting steps in state.step; True when
    `should_stop` (a collective: train/preemption.py) ended it early, after a checkpoint of the
    step reached."""
    accum = engine.gradient_accumulation_steps()
    # ZeRO stages 1-3 and the mixed-precision optimizers report the norm they computed; a plain
    # fp32 stage-0 engine without clipping does not, so we measure it on log steps.
    manual_norm = engine.zero_optimization_stage() == 0 and not (engine.fp16_enabled() or engine.bfloat16_enabled())
    # An objective may own state the optimizer does not update (AdPE's adversaries, MLO-MAE's
    # masking network and head): after every optimizer step it gets the step's lr and micro-batches
    # and may return 0-dim tensors to log for that step.
    after_step = engine.module.after_optimizer_step
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, float] = {}  # optimizer steps each logged value covers in this window
    t_last, steps_since_log = time.perf_counter(), 0
    health = StepHealth(settings.max_nonfinite_steps)
    while state.step < settings.stop_step:
        log_now = (state.step + 1) % settings.log_every == 0 or state.step + 1 == settings.stop_step
        grad_norm, lr = None, 0.0
        batches: list[dict[str, torch.Tensor]] = []  # this step's micro-batches, as the objective saw them
        for micro in range(accum):
            batches.append(_to_device(next(data), device, dtype))
            out = engine(batches[-1])
            out["loss"] = fault_injection.poison_loss(out["loss"], state.step + 1)
            # a non-finite loss gives NaN gradients: the engine then skips the step (train/nonfinite.py)
            engine.backward(nan_if_not_finite(out["loss"]))
            boundary = micro == accum - 1  # this engine.step() updates weights
            if boundary:
                lr = engine.get_lr()[0]
                if log_now and manual_norm:
                    grad_norm = _fp32_grad_norm(engine.module)
            try:
                engine.step()
            except Exception as e:  # DeepSpeed's fp16 scaler at its minimum: a collapse, said as such
                collapse = loss_scale_collapse(e, engine, state.step + 1)
                if collapse is None:
                    raise
                raise collapse from e
            if boundary:
                health.step(engine, state.step + 1)
            for k, v in out.items():
                if v.ndim == 0:
                    sums[k] = sums.get(k, 0) + v.detach().float() / accum
                    counts[k] = counts.get(k, 0) + 1 / accum
            if boundary:  # objective state outside the optimizer
                for k, v in after_step(lr, batches).items():
                    sums[k] = sums.get(k, 0) + v.detach().float()
                    counts[k] = counts.get(k, 0) + 1
        state.step += 1
        steps_since_log += 1
        fault_injection.at("after_step", state.step)
        fault_injection.slow_down(state.step)
        if log_now:
            norm = grad_norm if manual_norm else engine.get_global_grad_norm()
            counters = data.counters() if hasattr(data, "counters") else {}  # host integers, this rank's
            metrics = read_window(sums, counts, norm, counters, device)
            elapsed = time.perf_counter() - t_last  # after the read: the device work is done
            metrics["lr"] = lr
            metrics["skipped_steps"] = engine.skipped_steps  # non-finite / overflow steps not applied, whole run
            metrics["step_time"] = elapsed / steps_since_log
            metrics["images_per_s"] = settings.global_batch * steps_since_log / elapsed
            scale = loss_scale(engine)  # fp16 only: a host float in DeepSpeed's loss scaler
            if scale is not None:
                metrics["loss_scale"] = scale
            on_log(state.step, metrics)
            sums, counts, t_last, steps_since_log = {}, {}, time.perf_counter(), 0
        last = state.step == settings.stop_step
        if on_evaluate is not None and (last or (settings.eval_every and state.step % settings.eval_every == 0)):
            on_evaluate(state.step)
        if settings.vis_every and (state.step % settings.vis_every == 0 or last):
            on_visualize(state.step)
        saved = state.step % settings.ckpt_every == 0 or last or settings.kept_for_later(state.step)
        if saved:
            t_save = time.perf_counter()
            on_checkpoint(state.step)
            # checkpoint time is not training throughput: the window's start moves by it (a reset
            # would drop the window's earlier steps from the time but not from the count)
            t_last += time.perf_counter() - t_save
        if not last and should_stop(state.step):
            if not saved:
                on_checkpoint(state.step)
            return True
    return False
