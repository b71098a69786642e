"""Non-finite losses and gradients: the step is skipped and counted; a streak ends the run with
its last checkpoint kept; an fp16 loss-scale collapse is reported as one. (The engine's skip
itself, weights and moments unchanged, is tests/train/engine/test_engine.py.)"""
import json

import pytest
import torch
from conftest import CPU_DS, run_pretrain

from train.engine import EngineConfig, EngineCore, build
from train.engine.fault_injection import parse
from train.engine.loss_scale import LossScaleConfig
from train.engine.nonfinite import NonFiniteError, nan_if_not_finite
from train.engine.optim import WarmupCosineSchedule
from train.engine.state_files import read_tensors
from train.run.folder import read_metrics
from train.run.loop import LoopSettings, LoopState, run


def test_a_nonfinite_loss_poisons_every_gradient_and_a_finite_one_is_untouched():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    (w.sum() * 3 + torch.tensor(float("inf"))).backward()  # an inf term no weight feeds
    assert torch.isfinite(w.grad).all()  # so without the poison the step would be applied
    w.grad = None
    nan_if_not_finite(w.sum() * 3 + torch.tensor(float("inf"))).backward()
    assert torch.isnan(w.grad).all()
    w.grad = None
    loss = (w * w).sum()
    assert nan_if_not_finite(loss).item() == loss.item()
    nan_if_not_finite(loss).backward()
    assert torch.equal(w.grad, 2 * w.detach())


def test_fault_spec_parsing():
    assert parse("after_step@5:rank1, nan_loss@3-4") == {"after_step": [(5, 5, 1)], "nan_loss": [(3, 4, None)]}
    assert parse("slow_step@1-100") == {"slow_step": [(1, 100, None)]}
    with pytest.raises(ValueError, match="cannot read 'explode@3'"):
        parse("explode@3")


@pytest.mark.parametrize("stage", [0, 2])
def test_a_nan_loss_step_is_skipped_counted_and_training_goes_on(tmp_path, stage):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**json.loads(CPU_DS.read_text()), "zero_optimization": {"stage": stage}}))
    run_pretrain(tmp_path / "run", "--run.max_steps", "5", ds_config=ds, faults="nan_loss@3")
    rows = read_metrics(tmp_path / "run")
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1]
    assert rows[2]["loss"] is None and rows[2]["nonfinite_losses"] == 1  # no finite loss in its window: null, counted
    assert all(abs(r["loss"]) < 10 for r in rows[3:])  # the weights were not poisoned: training goes on


def test_a_streak_of_nonfinite_steps_ends_the_run_and_keeps_the_last_checkpoint(tmp_path):
    proc = run_pretrain(tmp_path, "--run.max_steps", "10", "--run.ckpt_every", "2", "--run.max_nonfinite_steps", "3",
                        faults="nan_loss@4-10", check=False)
    assert proc.returncode == 3
    assert "3 consecutive optimizer steps (4-6) had a non-finite loss or gradients" in proc.stderr
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step00000004"  # step 6 (the third bad one) wrote nothing
    assert not (root / "step00000006").exists()
    state = read_tensors(root / "step00000004")
    assert all(torch.isfinite(v).all() for v in state.values() if isinstance(v, torch.Tensor))
    assert not (tmp_path / "encoder.safetensors").exists()  # no export of a diverged run


@pytest.mark.parametrize("ranks, stage", [(1, 0), (2, 3)])
def test_an_update_that_overflows_the_weights_ends_the_run_before_a_checkpoint_keeps_them(tmp_path, ranks, stage):
    """Finite gradients, weights overflowed by the update (an absurd lr): nothing skips that step,
    so the checkpoint is where it is caught, on every rank (ZeRO-3: each rank holds a shard). Exit 3
    with one message; no tag or export of the broken weights (the export used to end in a traceback)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**json.loads(CPU_DS.read_text()), "zero_optimization": {"stage": stage}}))
    proc = run_pretrain(tmp_path / "run", "--run.max_steps", "4", "--run.ckpt_every", "2", "--optim.blr", "1e300",
                        "--run.log_every", "1", ranks=ranks, ds_config=ds, check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.count("the weights hold non-finite values after step 2") == ranks  # one line a rank
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    root = tmp_path / "run" / "checkpoints"
    assert not list(root.glob("step*")) and not (tmp_path / "run" / "encoder.safetensors").exists()
    # what the run logged before it stopped is kept: TensorBoard's buffered events were written out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]


class Diverging(torch.nn.Module):
    """An objective whose loss is NaN at the given calls (counted from 1; None: every call)."""

    def __init__(self, nan_at: set[int] | None = None, clock: list[float] | None = None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))
        self.nan_at, self.calls, self.clock = nan_at, 0, clock

    def forward(self, batch):
        self.calls += 1
        if self.clock is not None:
            self.clock[0] += 1.0  # each step takes a second of a fake clock
        nan = self.nan_at is None or self.calls in self.nan_at
        return {"loss": (self.w.float() * batch["image"]).sum() * (float("nan") if nan else 1.0)}

    def after_optimizer_step(self, lr, batches):
        return {}


def engine_for(module: Diverging, precision: str = "fp32", init_power: int = 16, hysteresis: int = 1) -> EngineCore:
    scale = LossScaleConfig(initial_scale_power=init_power, hysteresis=hysteresis, min_loss_scale=1)
    return build(module, [{"params": [module.w], "weight_decay": 0.0}],
                 lambda groups: torch.optim.AdamW(groups, lr=0.0, fused=True),
                 lambda opt: WarmupCosineSchedule(opt, 0.1, 0.0, 0, 100),
                 EngineConfig(0, precision, 1, 0.0, scale), torch.device("cpu"))


def fp16_engine(init_power: int, hysteresis: int = 1) -> EngineCore:
    return engine_for(Diverging(), "fp16", init_power, hysteresis)


def _run(engine, limit: int, log_every: int = 1) -> list[int]:
    saved: list[int] = []
    data = iter(lambda: {"image": torch.ones(2)}, None)
    settings = LoopSettings(40, log_every=log_every, ckpt_every=100, global_batch=4, max_nonfinite_steps=limit)
    run(engine, data, settings, LoopState(0), torch.device("cpu"), engine.dtype, lambda step, metrics: None, saved.append)
    return saved


def test_fp16_loss_scale_collapse_is_reported_as_such():
    engine = fp16_engine(init_power=3)  # 8 -> 4 -> 2 -> 1, then an overflow at the minimum
    with pytest.raises(NonFiniteError, match=r"fp16 loss-scale collapse by step 4: .* minimum loss scale \(1\)"):
        _run(engine, limit=0)
    assert engine.device_state()["skipped_steps"].item() == 4
    # with a streak limit below the collapse, the streak ends it first and names the scale
    with pytest.raises(NonFiniteError, match=r"2 consecutive optimizer steps \(1-2\).*fp16 loss scale is 2"):
        _run(fp16_engine(init_power=3), limit=2)


def test_a_streak_that_ended_between_two_reads_is_still_caught_at_the_next():
    """Log every 5 steps, limit 2: NaN at steps 2-3 only; the read at step 5 sees the streak it missed."""
    engine = engine_for(Diverging(nan_at={2, 3}))
    with pytest.raises(NonFiniteError, match=r"2 consecutive optimizer steps \(a run of them between steps 1 and 5\)"):
        _run(engine, limit=2, log_every=5)
    assert engine.steps == 5  # stopped at the read of step 5


def test_checkpoint_time_inside_a_log_window_is_left_out_of_throughput(monkeypatch):
    """A checkpoint mid-window (ckpt_every 3, log_every 4): images/s counts the window's 4 steps
    over their own time, without the save's; a fake clock where each step takes 1 s and the save 10 s."""
    import train.run.loop as loop

    clock = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])

    def save(step):
        clock[0] += 10.0

    logged = {}
    data = iter(lambda: {"image": torch.ones(2)}, None)
    settings = LoopSettings(8, log_every=4, ckpt_every=3, global_batch=4)
    run(engine_for(Diverging(nan_at=set(), clock=clock)), data, settings, LoopState(0), torch.device("cpu"),
        torch.float32, lambda step, metrics: logged.update({step: metrics}), save)
    assert [logged[s]["step_time"] for s in (4, 8)] == [1.0, 1.0]
    assert logged[4]["images_per_s"] == 4.0


def test_a_checkpoint_of_nonfinite_weights_is_refused_at_resume_and_an_earlier_tag_named(tmp_path):
    """A tag whose weights hold a NaN (saved before checkpoints were checked, or altered since,
    its checksums updated) trained on and then stopped saying no earlier tag existed. Now the
    resume stops at once (exit 3), naming the newest earlier tag; nothing is written or removed."""
    import struct

    from train.engine.checkpoint import crc32

    run = tmp_path / "run"
    run_pretrain(run, "--run.max_steps", "6", "--run.ckpt_every", "2")
    tag = run / "checkpoints" / "step00000006"
    raw = bytearray((tag / "model.safetensors").read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    start = next(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    raw[8 + size + start:8 + size + start + 4] = struct.pack("<f", float("nan"))  # one weight, in place
    (tag / "model.safetensors").write_bytes(raw)
    complete = json.loads((tag / "complete.json").read_text())
    complete["crc32"]["model.safetensors"] = crc32(tag / "model.safetensors")  # as if saved so
    (tag / "complete.json").write_text(json.dumps(complete))
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    rows = len(read_metrics(run))
    proc = run_pretrain(run, "--run.max_steps", "8", "--run.ckpt_every", "2", "--resume", "auto", check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"checkpoint {tag} holds non-finite weights" in proc.stderr
    assert f"resume from an earlier one instead, e.g. --resume {run / 'checkpoints' / 'step00000004'}" in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before and len(read_metrics(run)) == rows


def test_a_resumed_run_that_overflows_before_its_own_checkpoint_names_the_tag_it_resumed(tmp_path):
    """The tag a run resumed from is its last good one until it writes another (the message said
    no earlier checkpoint existed)."""
    run = tmp_path / "run"
    run_pretrain(run, "--run.max_steps", "4", "--run.ckpt_every", "2")
    proc = run_pretrain(run, "--run.max_steps", "6", "--run.ckpt_every", "2", "--resume", "auto", "--optim.blr",
                        "1e300", check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "the weights hold non-finite values after step 6" in proc.stderr
    assert "the last complete one, step00000004, is kept" in proc.stderr, proc.stderr[-3000:]


def test_a_run_resumed_from_another_folders_tag_names_that_tag_to_continue_from(tmp_path):
    """Its own folder holds no checkpoint yet, so `--resume auto` there would find nothing."""
    source, run = tmp_path / "source", tmp_path / "run"
    run_pretrain(source, "--run.max_steps", "2", "--run.ckpt_every", "2")
    tag = source / "checkpoints" / "step00000002"
    proc = run_pretrain(run, "--resume", str(tag), "--run.max_steps", "4", "--run.ckpt_every", "4", "--optim.blr",
                        "1e300", check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"the last complete one, {tag}, is kept" in proc.stderr and f"--resume {tag}" in proc.stderr
    assert "--resume auto" not in proc.stderr
