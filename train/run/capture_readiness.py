"""Whether a training step could be captured as a CUDA graph, judged on any machine.

A captured step replays its kernels with the device pointers and values of the capture, so it
must not: read a device value on the host (`.item()`, `bool(t)`, `.tolist()`: the host would wait,
and a replay cannot return the value), give a tensor a shape that depends on values (`nonzero`,
boolean indexing: the allocation differs per step), or feed a CPU tensor to a device op (its value
is copied at capture and frozen in every replay). `check_step` runs steps of the configured run on
PyTorch's `meta` device, where tensors have shapes but no values: the first two raise there, and a
dispatch mode records every op that takes a CPU tensor. Each step is the loop's: the objective's
forward, the engine's backward and optimizer step, the objective's after-step hook. The first
step is a warm-up, as before a capture: state that follows the model to its device once (AdPE's
adversaries, MLO-MAE's masking network, cached constants) moves there.
"""
from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train.config.options import PretrainConfig
from train.estimate.step_flops import step_batch
from train.run.build import build_engine

REPO = Path(__file__).resolve().parents[2]


class CpuInputs(TorchDispatchMode):
    """Records each op that takes a CPU tensor while the step runs on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*args, *(kwargs or {}).values()]
        flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in flat):
            self.found.append(f"{func.name()} at {where_in_repo()}")
        return func(*args, **(kwargs or {}))


def where_in_repo() -> str:
    """The innermost frame of this repository's code that is running (file:line)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if path.is_relative_to(REPO) and ".venv" not in path.parts and path.name != "capture_readiness.py":
            return f"{path.relative_to(REPO)}:{frame.lineno}"
    return "outside the repository"


def check_step(cfg: PretrainConfig, ds_config: dict, micro: int) -> list[str]:
    """What would keep the configured run's step out of a CUDA graph ([] when nothing): a warm-up
    step, then a checked step, of one rank on the meta device."""
    engine, _, _ = build_engine(cfg, ds_config, torch.device("meta"), peak_lr=1e-3, warmup_steps=1, total_steps=10)
    with torch.device("meta"):
        batch = step_batch(cfg, micro)

    def step() -> None:
        for _ in range(engine.accum):
            engine.backward(engine(batch)["loss"])
            engine.step()
        engine.after_optimizer_step(engine.get_lr(), [batch] * engine.accum)

    cpu_inputs = CpuInputs()
    try:
        step()
        with cpu_inputs:
            step()
    except (RuntimeError, NotImplementedError) as e:  # a host read or a value-dependent shape, on meta
        return [f"{type(e).__name__}: {str(e).splitlines()[0]} at {traceback_in_repo(e)}"]
    return sorted(set(cpu_inputs.found))


def traceback_in_repo(error: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if Path(f.filename).is_relative_to(REPO) and ".venv" not in Path(f.filename).parts]
    return f"{Path(frames[-1].filename).relative_to(REPO)}:{frames[-1].lineno}" if frames else "outside the repository"
