"""Non-finite losses and gradients: the step is skipped and counted; a streak stops the run with
its last checkpoint kept; an fp16 loss-scale collapse is reported as one."""
import json

import pytest
import torch
from conftest import CPU_DS, run_pretrain

from train.fault_injection import parse
from train.loop import LoopSettings, LoopState, run
from train.nonfinite import NonFiniteError, nan_if_not_finite, skip_nonfinite_steps
from train.run_dir import read_metrics


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


def test_zero0_fp32_optimizer_skips_and_flags_a_step_with_nonfinite_gradients():
    p = torch.nn.Parameter(torch.ones(3))
    opt = skip_nonfinite_steps(torch.optim.AdamW([p], lr=0.1))
    p.grad = torch.tensor([1.0, float("nan"), 1.0])
    opt.step()
    assert opt.overflow and torch.equal(p.detach(), torch.ones(3)) and not opt.state  # nothing moved, no moments
    p.grad = torch.ones(3)
    opt.step()
    assert not opt.overflow and (p.detach() < 1).all()


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
    assert rows[2]["loss"] != rows[2]["loss"]  # the NaN is logged for its step
    assert all(abs(r["loss"]) < 10 for r in rows[3:])  # the weights were not poisoned: training goes on


def test_a_streak_of_nonfinite_steps_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    proc = run_pretrain(tmp_path, "--run.max_steps", "10", "--run.ckpt_every", "2", "--run.max_nonfinite_steps", "3",
                        faults="nan_loss@4-10", check=False)
    assert proc.returncode == 3
    assert "3 consecutive optimizer steps (4-6) had a non-finite loss or gradients" in proc.stderr
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step00000004"  # step 6 (the third bad one) wrote nothing
    assert not (root / "step00000006").exists()
    state = torch.load(root / "step00000004" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    assert all(torch.isfinite(v).all() for v in state.values())
    assert not (tmp_path / "encoder.safetensors").exists()  # no export of a diverged run


class FakeFp16Engine:
    """The surface of a DeepSpeed fp16 engine the loop uses, with DeepSpeed's own dynamic loss
    scaler deciding: a non-finite gradient is an overflow (skip, halve the scale)."""

    def __init__(self, init_scale: float):
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

        self.scaler = DynamicLossScaler(init_scale=init_scale, scale_window=1000, min_scale=1, delayed_shift=1,
                                        consecutive_hysteresis=False)
        self.optimizer = self.scaler  # `cur_scale`, as DeepSpeed's fp16 optimizers expose it
        self.module = torch.nn.Linear(2, 1)
        self.module.after_optimizer_step = lambda lr, batches: {}  # the objective hook the loop calls
        self.skipped_steps, self.applied = 0, True

    def __call__(self, batch):
        return {"loss": self.module(batch["image"]).sum() * float("nan")}  # diverged: every loss is NaN

    def backward(self, loss):
        loss.backward()

    def step(self):
        overflow = not all(torch.isfinite(p.grad).all() for p in self.module.parameters())
        self.scaler.update_scale(overflow)  # raises at the minimum scale, as in DeepSpeed
        self.applied = not overflow
        self.skipped_steps += overflow
        self.module.zero_grad()

    def was_step_applied(self):
        return self.applied

    def gradient_accumulation_steps(self):
        return 1

    def zero_optimization_stage(self):
        return 2

    def fp16_enabled(self):
        return True

    def bfloat16_enabled(self):
        return False

    def get_lr(self):
        return [0.1]

    def get_global_grad_norm(self):
        return None


def _run_fake(engine, limit: int) -> list[int]:
    saved: list[int] = []
    data = iter(lambda: {"image": torch.ones(4, 2)}, None)
    settings = LoopSettings(40, log_every=100, ckpt_every=2, global_batch=4, max_nonfinite_steps=limit)
    run(engine, data, settings, LoopState(0), torch.device("cpu"), torch.float32, lambda step, metrics: None, saved.append)
    return saved


def test_fp16_loss_scale_collapse_is_reported_as_such(monkeypatch):
    import deepspeed.runtime.fp16.loss_scaler as loss_scaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)  # the scaler logs from rank 0 only
    engine = FakeFp16Engine(init_scale=8)  # 8 -> 4 -> 2 -> 1, then the scale cannot go lower
    with pytest.raises(NonFiniteError, match=r"fp16 loss-scale collapse at step 4: .* minimum loss scale \(1\)"):
        _run_fake(engine, limit=0)
    assert engine.skipped_steps == 3
    # with a streak limit below the collapse, the streak stops it first and names the scale
    with pytest.raises(NonFiniteError, match=r"2 consecutive optimizer steps \(1-2\).*fp16 loss scale is 2"):
        _run_fake(FakeFp16Engine(init_scale=8), limit=2)


def test_checkpoint_time_inside_a_log_window_is_left_out_of_throughput(monkeypatch):
    """A checkpoint mid-window (ckpt_every 3, log_every 4): images/s counts the window's 4 steps
    over their own time, without the save's; a fake clock where each step takes 1 s and the save 10 s."""
    import train.loop as loop

    clock = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])

    class Engine(FakeFp16Engine):
        def __call__(self, batch):
            clock[0] += 1.0
            return {"loss": self.module(batch["image"]).sum()}

        def fp16_enabled(self):
            return False

    def save(step):
        clock[0] += 10.0

    logged = {}
    data = iter(lambda: {"image": torch.ones(4, 2)}, None)
    settings = LoopSettings(8, log_every=4, ckpt_every=3, global_batch=4)
    run(Engine(init_scale=8), data, settings, LoopState(0), torch.device("cpu"), torch.float32,
        lambda step, metrics: logged.update({step: metrics}), save)
    assert [logged[s]["step_time"] for s in (4, 8)] == [1.0, 1.0]
    assert logged[4]["images_per_s"] == 4.0
