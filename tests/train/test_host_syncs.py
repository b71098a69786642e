"""Host-device syncs per training step, counted on CPU: every call that would make the host wait
for a CUDA device is patched with a counter, each counted call is attributed to the innermost
frame of our code or of DeepSpeed's that made it, and every objective trains 20 steps through
train/pretrain.py's real loop and DeepSpeed engine (ds_configs/cpu_debug.json: fp32, ZeRO-2; MAE
also with a shipped A100 file's bf16 settings under ZeRO 1, 2 and 3). AdamW is the fused one, as
on CUDA (the foreach one reads its host-side `step` tensors).

Counted: Tensor.item / tolist / __bool__ / __float__ / __int__ / __index__ / cpu / numpy /
__array__, data-dependent shapes (nonzero, argwhere, masked_select, unique, one-argument where,
repeat_interleave with tensor repeats, boolean-mask indexing and assignment), torch.cuda /
DeepSpeed accelerator synchronize, stream and event synchronize, and distributed barriers. Not
visible on CPU: blocking host-to-device copies (the loop's are non_blocking) and DeepSpeed's
branches that synchronize only where `get_accelerator().resolves_data_dependency()` is False,
which is CUDA (README, "Host-device syncs").
"""
from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import deepspeed
import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET, REPO
from torch.optim.optimizer import _get_value

CONFIGS = REPO / "train" / "configs"
DEEPSPEED = Path(deepspeed.__file__).resolve().parent
OURS = [REPO / d for d in ("train", "model", "data", "kernels")]
STEPS, LOG_EVERY = 20, 5
STEP_DONE_LINE = next(i for i, line in enumerate((REPO / "train" / "loop.py").read_text().splitlines(), 1)
                      if line.strip() == "state.step += 1")
# Not the training step: the callbacks the loop makes after it, and the data source (host work;
# its device part is non_blocking copies)
PHASES = {("train/loop.py", "read_window"): "log", ("train/trainer.py", "on_checkpoint"): "checkpoint",
          ("train/trainer.py", "on_visualize"): "visualize", ("train/trainer.py", "on_evaluate"): "evaluate"}


# torch.optim's read of AdamW's `step`, a host tensor unless the optimizer is capturable or fused
# (then it never reads it): host memory on CUDA too, so not counted (MLO-MAE's auxiliary AdamWs)
HOST_SCALAR_READ = _get_value.__code__


@dataclass(frozen=True)
class Sync:
    what: str  # the patched call
    owner: str  # "ours" or "deepspeed": whose code made the call
    where: str  # its file:line (function)
    # "step"; "log" (the loop's code after the step's work); "checkpoint", "visualize", "evaluate" (its
    # callbacks); "data" (the data source: host work); "outside" (not in the loop)
    phase: str
    step: int  # the optimizer step it belongs to (0 outside the loop)


@functools.lru_cache(maxsize=None)
def _source(filename: str) -> tuple[str | None, str | None]:
    """(path as shown, "deepspeed" or "ours") of a frame's file; (None, None) for any other."""
    path = Path(filename).resolve()
    if path.is_relative_to(DEEPSPEED):
        return f"deepspeed/{path.relative_to(DEEPSPEED)}", "deepspeed"
    if any(path.is_relative_to(d) for d in OURS):
        return str(path.relative_to(REPO)), "ours"
    return None, None


class SyncCounter:
    def __init__(self):
        self.syncs: list[Sync] = []
        self._inside = threading.local()

    def record(self, what: str) -> None:
        frame = sys._getframe(2)  # the caller of the patched function
        if frame.f_code is HOST_SCALAR_READ:
            return
        owner = where = None
        phase, step = "outside", 0
        while frame is not None:
            rel, kind = _source(frame.f_code.co_filename)
            if rel is not None:
                if owner is None:  # torch's and other libraries' frames are skipped to the one that called them
                    owner, where = kind, f"{rel}:{frame.f_lineno} ({frame.f_code.co_name})"
                if rel.startswith("data/") and phase == "outside":
                    phase = "data"
                if (rel, frame.f_code.co_name) in PHASES and phase in ("outside", "data"):
                    phase = PHASES[rel, frame.f_code.co_name]
                if rel == "train/loop.py" and frame.f_code.co_name == "run":
                    # the loop counts a step done (state.step += 1) before its log and callbacks
                    after = frame.f_lineno > STEP_DONE_LINE
                    if phase == "outside":
                        phase = "log" if after else "step"
                    step = frame.f_locals["state"].step + (0 if after else 1)
                    break
            frame = frame.f_back
        self.syncs.append(Sync(what, owner or "other", where or "?", phase, step))

    def wrap(self, what: str, fn, counts=None):
        """`fn` counted when called from outside another counted call, and `counts(*args)` (if
        given) says its arguments make it a sync."""
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if getattr(self._inside, "on", False):  # a counted call inside another counted call
                return fn(*args, **kwargs)
            if counts is None or counts(*args, **kwargs):
                self.record(what)
            self._inside.on = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside.on = False
        return counted


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextmanager
def counting_syncs():
    counter = SyncCounter()
    methods = {name: None for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu",
                                       "numpy", "__array__", "nonzero", "argwhere", "masked_select", "unique")}
    methods["__getitem__"] = lambda self, index: _bool_index(index)
    methods["__setitem__"] = lambda self, index, value: _bool_index(index)
    methods["repeat_interleave"] = lambda self, repeats, *a, **k: isinstance(repeats, torch.Tensor) and \
        k.get("output_size") is None
    functions = {name: None for name in ("nonzero", "argwhere", "masked_select", "unique")}
    functions["where"] = lambda *args, **kwargs: len(args) + len(kwargs) == 1
    functions["repeat_interleave"] = lambda x, repeats=None, *a, **k: isinstance(repeats, torch.Tensor) and \
        k.get("output_size") is None
    accelerator = type(deepspeed.get_accelerator())
    with ExitStack() as stack:
        for name, counts in methods.items():
            fn = getattr(torch.Tensor, name)
            stack.enter_context(mock.patch.object(torch.Tensor, name, counter.wrap(f"Tensor.{name}", fn, counts)))
        for name, counts in functions.items():
            fn = getattr(torch, name)
            stack.enter_context(mock.patch.object(torch, name, counter.wrap(f"torch.{name}", fn, counts)))
        for owner, name, label in ((torch.cuda, "synchronize", "torch.cuda.synchronize"),
                                   (torch.cuda.Stream, "synchronize", "Stream.synchronize"),
                                   (torch.cuda.Event, "synchronize", "Event.synchronize"),
                                   (accelerator, "synchronize", "accelerator.synchronize"),
                                   (torch.distributed, "barrier", "dist.barrier")):
            stack.enter_context(mock.patch.object(owner, name, counter.wrap(label, getattr(owner, name))))
        yield counter


def test_the_counter_sees_and_attributes_each_kind_of_sync():
    from train.loop import read_window

    x = torch.arange(6.0)
    with counting_syncs() as counter:
        x.sum().item(), float(x[0]), bool(x.any()), x.tolist(), x[x > 2], x.nonzero(), torch.where(x > 1)
        torch.where(x > 1, x, 0.0), x[1:3], x.cumsum(0)  # not syncs
        deepspeed.get_accelerator().synchronize()
        metrics = read_window({"loss": x.sum(), "acc": x.mean()}, {"loss": 1.0, "acc": 1.0}, x.norm(),
                              {"data_skipped_io": 3}, torch.device("cpu"))
    assert [s.what for s in counter.syncs] == [
        "Tensor.item", "Tensor.__float__", "Tensor.__bool__", "Tensor.tolist", "Tensor.__getitem__",
        "Tensor.nonzero", "torch.where", "accelerator.synchronize", "Tensor.tolist"]
    assert {s.owner for s in counter.syncs} == {"other", "ours"}  # this file, then train/loop.py
    assert counter.syncs[-1].owner == "ours" and counter.syncs[-1].where.startswith("train/loop.py:")
    assert metrics == {"acc": 2.5, "loss": 15.0, "data_skipped_io": 3, "grad_norm": pytest.approx(x.norm().item())}


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """The runs here share the process group the first one starts (train/distributed.py: a world
    of 1); it ends with this module and the environment it set goes back, so that later tests and
    the processes they start see neither."""
    env = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


def _train(objective: str, options: list[str], out: Path, ds_config: Path = CPU_DS) -> SyncCounter:
    from train.pretrain import main

    argv = ["--ds_config", str(ds_config), "--config", str(DEBUG_PRESET), *options, "--output_dir", str(out),
            "--run.max_steps", str(STEPS), "--run.log_every", str(LOG_EVERY), "--run.ckpt_every", str(STEPS),
            "--run.progress", "false", "--run.tensorboard", "false", "--run.export", "false",
            "--data.epoch_size", str(8 * STEPS), "--optim.fused", "yes"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only contends (and CI has 2 cores)
    try:
        with counting_syncs() as counter:
            main(argv)
    finally:
        torch.set_num_threads(threads)
    return counter


OBJECTIVES = {
    "mae": [],
    "mixedae": ["--config", str(CONFIGS / "mixedae/debug.json")],
    "maeplus": ["--config", str(CONFIGS / "maeplus/debug.json")],
    "adpe": ["--config", str(CONFIGS / "maeplus/debug.json"), "--config", str(CONFIGS / "maeplus" / "variants" / "rpe_embed.json")],
    "mlomae": ["--config", str(CONFIGS / "mlomae/debug.json")],
    "energy": ["--config", str(CONFIGS / "energy/debug.json")],
}


def assert_syncs(counter: SyncCounter, deepspeed_per_step: dict[str, int], steps=range(1, STEPS + 1)) -> None:
    """Ours: none inside a step, read_window's one on a log step. DeepSpeed: exactly
    `deepspeed_per_step` (function -> syncs per optimizer step), none at log steps; on a CUDA
    machine also the stream / device synchronizes of its branches that CPU skips."""
    def listing(owner):
        return sorted(Counter((s.phase, s.what, s.where) for s in counter.syncs if s.owner == owner).items())

    in_loop = [s for s in counter.syncs if s.phase in ("step", "log") and s.step in steps]
    assert not [s for s in in_loop if s.owner == "other"], listing("other")
    ours = Counter((s.step, s.phase) for s in in_loop if s.owner == "ours")
    assert ours == {(step, "log"): 1 for step in steps if step % LOG_EVERY == 0}, listing("ours")
    assert all(s.where.startswith("train/loop.py:") and s.where.endswith("(read_window)") and s.what == "Tensor.tolist"
               for s in in_loop if s.owner == "ours")
    for step in steps:
        theirs = [s for s in in_loop if s.owner == "deepspeed" and s.step == step]
        if torch.cuda.is_available():  # overlap_comm, ZeRO-3's streams: README, "Host-device syncs"
            theirs = [s for s in theirs if not s.what.endswith("synchronize")]
        assert Counter(s.where.split("(")[1][:-1] for s in theirs) == deepspeed_per_step, (step, listing("deepspeed"))


# ZeRO-1/2 in fp32 check the gradients through their norm: utils.is_invalid_grad_norm's bool(),
# the check that skips a non-finite step (train/nonfinite.py)
FP32_ZERO12 = {"is_invalid_grad_norm": 1}


@pytest.mark.parametrize("name", OBJECTIVES)
def test_syncs_per_step_of_every_objective(name, tmp_path):
    """cpu_debug.json: fp32, ZeRO-2, accumulation 1."""
    assert_syncs(_train(name, OBJECTIVES[name], tmp_path), FP32_ZERO12)


def bf16_ds_config(tmp_path, stage: int, timers: bool = False) -> Path:
    """A shipped A100 file's settings (bf16, overlap_comm, contiguous gradients) at a CPU-sized batch,
    accumulation 2, with buckets the size of the debug model."""
    sys.path.insert(0, str(REPO / "ds_configs"))
    try:
        from generate import config
    finally:
        sys.path.remove(str(REPO / "ds_configs"))
    ds = config("pretrain_actckpt" if stage == 3 else "pretrain", "b" if stage < 3 else "h", "a100", stage)
    ds.update(train_batch_size=8, train_micro_batch_size_per_gpu=4)
    ds.pop("activation_checkpointing", None)
    for key, value in (("reduce_bucket_size", 100_000), ("allgather_bucket_size", 100_000),
                       ("stage3_prefetch_bucket_size", 100_000), ("stage3_param_persistence_threshold", 0)):
        if key in ds["zero_optimization"]:  # ZeRO-3: every parameter partitioned
            ds["zero_optimization"][key] = value
    if timers:
        ds["timers"] = {"throughput": {"enabled": True}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    return tmp_path / "ds.json"


# bf16 (and fp16) ZeRO-1/2 also check for overflow before the step: has_overflow's .item(). ZeRO-3
# keeps its overflow flag on the device and checks the norm only.
BF16 = {1: {"has_overflow": 1, "is_invalid_grad_norm": 1}, 2: {"has_overflow": 1, "is_invalid_grad_norm": 1},
        3: {"is_invalid_grad_norm": 1}}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_syncs_per_step_bf16_zero(stage, tmp_path):
    counter = _train("mae", [], tmp_path / "run", bf16_ds_config(tmp_path, stage))
    # ZeRO-3's first step records and checks its parameter-fetch trace (one .item() per entry): once per run
    assert_syncs(counter, BF16[stage], range(2 if stage == 3 else 1, STEPS + 1))


def test_deepspeeds_throughput_timer_would_sync_twice_per_micro_batch(tmp_path):
    """What every shipped ds_config now switches off; the counter sees it when it is on."""
    counter = _train("mae", [], tmp_path / "run", bf16_ds_config(tmp_path, 1, timers=True))
    timer = Counter((s.step, s.where.split("(")[1][:-1]) for s in counter.syncs
                    if s.where.startswith("deepspeed/utils/timer.py:"))
    # accumulation 2: a synchronize as each micro-batch starts and stops, from step 3 (its start_step 2)
    assert timer == {(step, name): 2 for step in range(3, STEPS + 1) for name in ("start", "stop")}


def test_every_shipped_ds_config_turns_the_throughput_timer_off(tmp_path):
    from train.config import PretrainConfig
    from train.ds_config import resolve

    for path in sorted((REPO / "ds_configs").glob("*.json")):
        assert json.loads(path.read_text())["timers"] == {"throughput": {"enabled": False}}, path.name
    # a ds_config of the user's without the section gets it too; one that sets it keeps its choice
    mine = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0}
    (tmp_path / "ds.json").write_text(json.dumps(mine))
    for timers, enabled in (({}, False), ({"timers": {"throughput": {"enabled": True}}}, True)):
        (tmp_path / "ds.json").write_text(json.dumps({**mine, **timers}))
        final, _ = resolve(PretrainConfig(ds_config=str(tmp_path / "ds.json")), 1)
        assert final["timers"]["throughput"]["enabled"] is enabled
