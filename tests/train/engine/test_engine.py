"""train/engine/ on one rank against plain PyTorch: the same AdamW steps as a textbook loop (accumulation,
clipping, parameter groups with lr scales, fp32 master weights under bf16 / fp16), a skipped step
that changes nothing, and the fp16 scale following DeepSpeed's dynamic loss scaler (checkpoints:
test_engine_checkpoints.py)."""
import contextlib
import copy
from types import SimpleNamespace

import pytest
import tiny_engine
import torch
from tiny_engine import (SkipsB, Tiny, adamw, batches, engine_steps, groups_of, master_weights, reference_steps,
                         schedule)
from torch import nn

from train.engine import EngineConfig, build
from train.engine.loss_scale import DeviceLossScale, LossScaleConfig
from train.engine.optim import LARS
from train.engine.replicated import ReplicatedEngine


@pytest.mark.parametrize("stage", [0, 2])
def test_the_logged_lr_is_the_largest_any_group_takes(stage):
    """Under layer-wise decay the first group is layer 0's: the logged lr was decay^(depth + 1) times
    the schedule's (0.65^13 = 0.0037 at ViT-B), while the head trains at the schedule's own."""
    torch.manual_seed(0)
    engine = engine_steps(Tiny(), batches(3), 1, 0.0, "fp32", stage)
    assert [g.get("lr_scale", 1.0) for g in engine.optimizer.param_groups] == [0.5, 1.0]
    want = engine.schedule.lr_at(engine.schedule.last_step)  # the schedule's own (scale 1: the second group's)
    assert engine.get_lr() == pytest.approx(want, rel=1e-12) and want > 0


@contextlib.contextmanager
def world_of_one():
    """A gloo process group of one process, the sharded engine's ranks in miniature (left as found
    when one is already up)."""
    import socket

    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_sharded_engines_logged_lr_is_the_largest_any_group_takes(stage):
    """The same on FSDP2 (ZeRO-1/2/3; on one rank `build` picks the replicated engine, so the
    sharded one is built directly in a world of one process)."""
    from train.engine.sharded import ShardedEngine

    with world_of_one():
        torch.manual_seed(0)
        module = Tiny()
        engine = ShardedEngine(module, groups_of(module), adamw, schedule, EngineConfig(stage, "fp32", 1, 0.0),
                               torch.device("cpu"))
        engine.backward(engine(batches(1)[0])["loss"])
        engine.step()
        assert [g.get("lr_scale", 1.0) for g in engine.optimizer.param_groups] == [0.5, 1.0]
        want = engine.schedule.lr_at(engine.schedule.last_step)
        assert engine.get_lr() == pytest.approx(want, rel=1e-12) and want > 0


# (fp32, 1, 100.0): a clip far above the norm leaves the gradients as they are (never scales them up);
# (fp32, 2, 4.0): a clip between the micro-batches' mean's norm (2.5-3.2 here) and their sum's: only the mean is kept
@pytest.mark.parametrize("precision,accum,clip", [("fp32", 1, 0.0), ("fp32", 3, 0.5), ("bf16", 2, 0.0),
                                                  ("bf16", 1, 0.3), ("fp16", 2, 0.0), ("fp32", 1, 100.0),
                                                  ("fp32", 2, 4.0)])
def test_steps_equal_a_textbook_adamw_loop(precision, accum, clip):
    torch.manual_seed(0)
    module, data = Tiny(), batches(6)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    ref = dict(reference_steps(module, data, accum, clip, dtype).named_parameters())
    engine = engine_steps(module, data, accum, clip, precision)
    ours = master_weights(engine)
    assert ours.keys() == ref.keys()
    for name, value in ours.items():
        # fp16: the engine scales the loss by 2**16 and unscales inside AdamW (the reference does neither)
        tol = {"fp32": 1e-6, "bf16": 1e-5, "fp16": 2e-3}[precision]
        torch.testing.assert_close(value, ref[name].detach(), rtol=tol, atol=tol, msg=name)
    assert torch.equal(ours["unused"], module.unused.detach())  # no gradient, no weight decay: untouched
    for name, p in engine.module.named_parameters():  # the module computes with the master weights, cast
        assert p.dtype == dtype and torch.equal(p.detach(), ours[name].to(dtype)), name
        assert precision == "fp32" or p.grad is None, name  # 16-bit gradients moved into the fp32 sums
    assert engine.module.shift.dtype == dtype  # buffers are cast too, as DeepSpeed's engine does
    assert engine.steps == 6 // accum and engine.device_state()["skipped_steps"].item() == 0


def test_the_ds_configs_gradient_clipping_clips_the_engines_steps():
    """An engine built from a ds_config clips at its gradient_clipping (0.5 here, below this model's
    norm of 2.5-3.2): its steps are the textbook loop's with that clip, not the unclipped loop's."""
    torch.manual_seed(0)
    module, data = Tiny(), batches(3)
    cfg = EngineConfig.from_ds_config({"gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
                                       "zero_optimization": {"stage": 0}})
    trained = copy.deepcopy(module)
    engine = build(trained, groups_of(trained), adamw, schedule, cfg, torch.device("cpu"))
    for batch in data:
        engine.backward(engine(batch)["loss"])
        engine.step()
    clipped = dict(reference_steps(module, data, 1, 0.5, torch.float32).named_parameters())
    unclipped = dict(reference_steps(module, data, 1, 0.0, torch.float32).named_parameters())
    assert not torch.allclose(clipped["a.weight"], unclipped["a.weight"], rtol=1e-4, atol=1e-4)  # the clip matters
    for name, value in master_weights(engine).items():
        torch.testing.assert_close(value, clipped[name].detach(), rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("clip", [0.0, 0.5, 100.0])
def test_the_fp16_gradient_norm_is_unscaled_and_clips_as_fp32s(clip, monkeypatch):
    """fp16's gradients carry the loss scale (2**8 here): the logged norm and the clip coefficient
    are the unscaled gradients', so a clip of 100 (far above the norm) clips nothing. AdamW's
    moments see the unscaled, clipped gradients too (its update alone would hide a scale error)."""
    torch.manual_seed(0)
    module, data = Tiny(), batches(6)
    fp16 = engine_steps(module, data, 1, clip, "fp16")
    fp32 = engine_steps(module, data, 1, clip, "fp32")
    torch.testing.assert_close(fp16.grad_norm, fp32.grad_norm, rtol=2e-2, atol=0)
    made = []  # the reference loop's optimizer, to read its moments
    monkeypatch.setattr(tiny_engine, "adamw", lambda groups: made.append(adamw(groups)) or made[-1])
    ref = dict(reference_steps(module, data, 1, clip, torch.float16).named_parameters())
    for name, value in master_weights(fp16).items():
        torch.testing.assert_close(value, ref[name].detach(), rtol=2e-3, atol=2e-3, msg=name)
    ref_opt, = made
    for ref_group, group in zip(ref_opt.param_groups, fp16.optimizer.param_groups, strict=True):
        for p_ref, p in zip(ref_group["params"], group["params"], strict=True):
            for key in ("exp_avg", "exp_avg_sq") if p_ref in ref_opt.state else ():
                torch.testing.assert_close(fp16.optimizer.state[p][key], ref_opt.state[p_ref][key],
                                           rtol=2e-3, atol=1e-6, msg=key)


def test_accumulated_micro_batches_give_their_mean_gradient():
    """Two micro-batches of one batch: the step's gradient, and the norm logged and clipped, is
    that batch's own, not the sum of the two."""
    torch.manual_seed(0)
    module, batch = Tiny(), batches(1)[0]
    engine = engine_steps(module, [batch, batch], 2, 0.0, "fp32")
    plain = copy.deepcopy(module)
    plain(batch)["loss"].backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in plain.parameters() if p.grad is not None]))
    torch.testing.assert_close(engine.grad_norm, want)


def test_a_parameter_no_micro_batch_reaches_takes_a_zero_gradient_not_the_last_steps():
    """bf16: the step's gradients are fp32 sums kept across steps; one that this step's backward
    never reached (b, on a skip_b batch) must be zero, as if b's gradient were zeros: AdamW still
    moves b by its momentum and weight decay, not by the previous step's gradient again."""
    torch.manual_seed(0)
    module = SkipsB()
    first, second = batches(2)
    data = [first, {**second, "skip_b": True}]
    engine = engine_steps(module, data, 1, 0.0, "bf16")
    for name in ("b.weight", "b.bias"):
        assert torch.count_nonzero(engine.master_grads[engine.names.index(name)]) == 0, name
    reference = copy.deepcopy(module)
    reference.reach_b = True
    ref = dict(reference_steps(reference, data, 1, 0.0, torch.bfloat16).named_parameters())
    for name, value in master_weights(engine).items():
        torch.testing.assert_close(value, ref[name].detach(), rtol=1e-5, atol=1e-5, msg=name)


def test_the_comm_hook_averages_over_ranks_in_its_dtype_and_casts_back(monkeypatch):
    """ZeRO-0 with a communication_data_type other than the compute dtype reduces DDP's buckets in
    reduce_in's hook, which replaces DDP's own averaging, so it must divide by the world size. Two
    ranks holding the same bf16 gradient stand in: the all-reduce (in fp32) sums the two, and their
    mean, cast back into the bf16 bucket, is that gradient."""
    import torch.distributed as dist

    from train.engine.replicated import reduce_in

    reduced = []

    def all_reduce(t, group=None, async_op=False):
        reduced.append(t.dtype)
        t.add_(t.clone())  # the other rank's equal contribution
        fut = torch.futures.Future()
        fut.set_result([t])
        return SimpleNamespace(get_future=lambda: fut)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    grads = torch.randn(10, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    buffer = grads.clone()
    out = reduce_in(torch.float32)(object(), SimpleNamespace(buffer=lambda: buffer)).wait()
    assert reduced == [torch.float32]
    assert out is buffer and out.dtype == torch.bfloat16 and torch.equal(out, grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_sharded_reduce_scatter_gives_the_mean_over_ranks_in_its_dtype(monkeypatch, dtype):
    """ZeRO-1/2/3's reduce-scatter in a narrower dtype than FSDP2 holds (ReduceScatterIn): the shard
    that comes back is the ranks' mean. fp16 sums (op SUM) between a division before and one after,
    whose product is the world size; every rank here holds the same gradients, so the mean is the
    input's own shard. 1e4 summed over 8 or 16 ranks (8e4, 1.6e5) is past fp16's 65504: only the
    division before the sum keeps it finite."""
    import torch.distributed as dist

    from train.engine.sharded import ReduceScatterIn

    def reduce_scatter_tensor(output, input, op=None, group=None):  # `world` equal contributions, rank 0's shard
        assert input.dtype == output.dtype == dtype
        mine = input[:output.numel()].view_as(output)
        output.copy_(mine * group.size() if op == dist.ReduceOp.SUM else mine)  # (AVG: their mean is one of them)

    monkeypatch.setattr(dist, "reduce_scatter_tensor", reduce_scatter_tensor)
    grads = torch.randn(32, generator=torch.Generator().manual_seed(0))
    for world in (2, 4, 8, 16):
        group = SimpleNamespace(size=lambda world=world: world)
        for given in (grads, torch.full((32,), 1e4)):
            out = torch.empty(32 // world)  # FSDP2's fp32 output shard
            ReduceScatterIn(dtype)(out, given, group, dist.ReduceOp.AVG)
            want = given[:32 // world].to(dtype).float()  # the mean, rounded once to the reduce dtype
            torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-3, msg=f"world {world}")


def optimizer_state(engine: ReplicatedEngine) -> list[torch.Tensor]:
    return [v.clone() for t in engine.masters for v in engine.optimizer.state[t].values()]


# poison: NaN, or 1e30, whose gradients are finite in fp32 / bf16 but their norm overflows to inf
@pytest.mark.parametrize("poison", [float("nan"), 1e30])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_poisoned_step_changes_nothing_and_is_counted(precision, poison):
    torch.manual_seed(0)
    module, data = Tiny(), batches(3)
    engine = engine_steps(module, data[:2], 1, 1.0, precision)
    weights, state = master_weights(engine), optimizer_state(engine)
    params = [p.detach().clone() for p in engine.module.parameters()]
    poisoned = engine({"image": data[2]["image"].to(engine.dtype), "target": data[2]["target"]})["loss"] * poison
    engine.backward(poisoned)
    engine.step()
    if poison == 1e30 and precision != "fp16":  # (fp16's gradients themselves overflow, to NaN)
        assert engine.grad_norm.item() == float("inf")  # inf, not NaN: the norm is what overflowed
    assert all(torch.equal(master_weights(engine)[k], v) for k, v in weights.items())
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(engine), state))  # moments and step count
    assert all(torch.equal(p.detach(), q) for p, q in zip(engine.module.parameters(), params))
    read = {k: v.item() for k, v in engine.device_state().items()}
    assert read["skipped_steps"] == 1 and read["nonfinite_streak"] == 1
    engine.backward(engine({"image": data[2]["image"].to(engine.dtype), "target": data[2]["target"]})["loss"])
    engine.step()  # the next finite step is applied
    assert not torch.equal(master_weights(engine)["a.weight"], weights["a.weight"])
    assert engine.device_state()["nonfinite_streak"].item() == 0


@pytest.mark.parametrize("precision,loss_dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                                  ("fp16", torch.bfloat16)])
def test_a_16_bit_loss_is_refused_with_the_fix(precision, loss_dtype):
    """fp16's loss scale (2**16 by default) is inf in fp16: an objective's loss must be fp32."""
    module, scale = Tiny(), LossScaleConfig(initial_scale_power=8)  # 2**16 overflows this model's fp16 gradients
    engine = build(module, groups_of(module), adamw, schedule, EngineConfig(0, precision, 1, 0.0, scale),
                   torch.device("cpu"))
    batch = batches(1)[0]
    loss = engine({"image": batch["image"].to(engine.dtype), "target": batch["target"]})["loss"]
    with pytest.raises(TypeError) as refused:
        engine.backward(loss.to(loss_dtype))
    message = str(refused.value)
    assert "\n" not in message and str(loss_dtype) in message and "logits.float()" in message
    assert all(p.grad is None for p in engine.module.parameters())  # refused before any backward
    engine.backward(loss.double())  # fp64 is as safe as fp32
    engine.step()
    assert engine.device_state()["skipped_steps"].item() == 0


def test_lars_skips_a_flagged_step_and_unscales_its_gradients():
    p = nn.Parameter(torch.randn(3, 4))
    opt = LARS([{"params": [p], "weight_decay": 0.1}], lr=0.1)
    opt.state[p] = LARS.init_state(p)
    p.grad = torch.randn(3, 4) * 8
    before, mu = p.detach().clone(), opt.state[p]["mu"].clone()
    opt.grad_scale, opt.found_inf = torch.tensor(8.0), torch.tensor(1.0)
    opt.step()
    assert torch.equal(p.detach(), before) and torch.equal(opt.state[p]["mu"], mu)
    ref = nn.Parameter(before.clone())
    ref_opt = LARS([{"params": [ref], "weight_decay": 0.1}], lr=0.1)
    ref.grad = p.grad / 8
    ref_opt.step()
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    torch.testing.assert_close(p.detach(), ref.detach())
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # the engine's path (found_inf set) carries momentum as the plain one does
        ref.grad = torch.randn(3, 4, generator=gen)
        p.grad = ref.grad * 8
        ref_opt.step()
        opt.step()
        torch.testing.assert_close(p.detach(), ref.detach())
        torch.testing.assert_close(opt.state[p]["mu"], ref_opt.state[ref]["mu"])


def test_the_fp16_scale_follows_deepspeeds_dynamic_loss_scaler(monkeypatch):
    from deepspeed.runtime.fp16 import loss_scaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)  # it logs from rank 0
    # (initial_scale_power, min_loss_scale, hysteresis, consecutive); a minimum above the initial scale
    # (the ds_config checks accept it) makes the first shrink jump up to the minimum, not a collapse
    cases = ((6, 2.0, 1, False), (6, 2.0, 2, False), (6, 2.0, 3, True), (4, 1024.0, 1, False), (4, 1024.0, 2, True),
             (4, 1000.0, 1, False))
    for power, minimum, hysteresis, consecutive in cases:
        cfg = LossScaleConfig(initial_scale_power=power, loss_scale_window=3, hysteresis=hysteresis,
                              consecutive_hysteresis=consecutive, min_loss_scale=minimum)
        ours = DeviceLossScale(cfg, torch.device("cpu"))
        theirs = loss_scaler.DynamicLossScaler(init_scale=2.0 ** power, scale_window=3, min_scale=minimum,
                                               delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                                               raise_error_at_min_scale=True)
        overflows = [1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1]
        for i, overflow in enumerate(overflows):
            try:
                theirs.update_scale(bool(overflow))
            except Exception as e:  # at the minimum: DeepSpeed raises, ours raises its flag
                assert "minimum" in str(e)
                ours.update(torch.tensor(float(overflow)))
                assert ours.collapsed.item() == 1.0, (power, minimum, hysteresis, consecutive, i)
                break
            ours.update(torch.tensor(float(overflow)))
            assert ours.scale.item() == theirs.cur_scale, (power, minimum, hysteresis, consecutive, i)
            assert ours.collapsed.item() == 0.0, (power, minimum, hysteresis, consecutive, i)
    static = DeviceLossScale(LossScaleConfig(loss_scale=128.0), torch.device("cpu"))
    static.update(torch.tensor(1.0))
    assert static.scale.item() == 128.0
    # a resume with a static scale configured keeps it: the dynamic run's 65536 stayed forever
    static.load_state_dict(DeviceLossScale(LossScaleConfig(), torch.device("cpu")).state_dict())
    static.update(torch.tensor(0.0))
    assert static.scale.item() == 128.0
    dynamic = DeviceLossScale(LossScaleConfig(), torch.device("cpu"))  # ... and a dynamic one continues from 128
    dynamic.load_state_dict(static.state_dict())
    assert dynamic.scale.item() == 128.0


def test_the_fp16_collapse_flag_stays_raised_after_later_finite_steps():
    """The loop reads `collapsed` only at its log steps: an overflow at the minimum scale followed
    by finite steps before that read must still stop the run, as DeepSpeed raises at once."""
    scaler = DeviceLossScale(LossScaleConfig(initial_scale_power=1, hysteresis=1, min_loss_scale=1),
                             torch.device("cpu"))
    scaler.update(torch.tensor(1.0))  # 2 -> 1, the minimum: no collapse yet
    assert scaler.scale.item() == 1.0 and scaler.collapsed.item() == 0.0
    scaler.update(torch.tensor(1.0))  # an overflow at the minimum
    assert scaler.collapsed.item() == 1.0
    for _ in range(3):  # finite steps, the scale grows back: the flag stays
        scaler.update(torch.tensor(0.0))
    assert scaler.collapsed.item() == 1.0


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_fp32_sums_start_in_memory_of_their_own_under_cuda_graphs(cuda_graphs):
    """A compiled block replayed as a CUDA graph hands autograd gradients in the graphs' memory
    pool, which the next micro-batch's replay overwrites; fp32 on one rank sums micro-batches in
    `.grad`, so with graphs the first micro-batch's gradient is copied out (and only then), and
    the step is unchanged."""
    torch.manual_seed(0)
    module, data = Tiny(), batches(4)
    module_copy = copy.deepcopy(module)
    engine = build(module_copy, groups_of(module_copy), adamw, schedule,
                   EngineConfig(0, "fp32", 2, 0.0, LossScaleConfig()), torch.device("cpu"))
    engine.cuda_graphs = cuda_graphs
    produced: dict[str, int] = {}  # the storage autograd left in .grad after each backward
    for name, p in engine.module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: produced.__setitem__(name, p.grad.data_ptr()))
    kept = []
    for batch in data:
        engine.backward(engine(batch)["loss"])
        kept.append({n: p.grad.data_ptr() == produced[n] for n, p in engine.module.named_parameters()
                     if p.grad is not None})
        engine.step()
    first_micro, last_micro = kept[0], kept[1]
    assert set(first_micro.values()) == {not cuda_graphs}  # copied out under graphs, autograd's own otherwise
    assert all(last_micro.values())  # the second micro-batch adds into the copy: no second copy
    ref = dict(reference_steps(module, data, 2, 0.0, torch.float32).named_parameters())
    for name, value in master_weights(engine).items():
        torch.testing.assert_close(value, ref[name].detach(), rtol=1e-6, atol=1e-6, msg=name)


def test_the_optimizer_step_runs_no_autograd_on_sharded_gradients(monkeypatch):
    """FSDP2's gradients are DTensors: reading a shard with `to_local()` while grad mode is on runs
    an autograd Function per parameter (252 at ViT-B MAE, about 1 ms of host time a step). The
    step runs under no_grad, so none runs. A world of one process stands in for the ranks."""
    from train.engine.sharded import ShardedEngine

    with world_of_one():
        torch.manual_seed(0)
        module = Tiny()
        engine = ShardedEngine(module, groups_of(module), adamw, schedule, EngineConfig(1, "fp32", 1, 0.5),
                               torch.device("cpu"))
        batch = batches(1)[0]
        engine.backward(engine(batch)["loss"])
        from torch.distributed.tensor import _api  # DTensor.to_local's autograd Function

        applied = []
        apply = _api._ToTorchTensor.apply
        monkeypatch.setattr(_api._ToTorchTensor, "apply", lambda *a, **k: applied.append(1) or apply(*a, **k))
        engine.step()
        assert engine.steps == 1 and torch.isfinite(engine.grad_norm) and engine.grad_norm > 0
        assert applied == []


@pytest.mark.parametrize("precision,reduce,accumulate,unsynced", [
    ("bf16", "", "", torch.bfloat16),  # DeepSpeed's default: the compute dtype
    ("bf16", "", "fp32", torch.float32),
    ("bf16", "fp32", "", torch.float32),  # FSDP2 sums in its reduce dtype: never narrower than it
    ("fp16", "bf16", "", torch.bfloat16),
    ("fp32", "", "", torch.float32),
])
def test_zero1_sums_unsynced_micro_batches_in_the_wider_of_the_reduce_and_accumulation_dtypes(precision, reduce,
                                                                                               accumulate, unsynced):
    cfg = EngineConfig(1, precision, 4, 0.0, reduce=reduce, accumulate=accumulate)
    assert cfg.unsynced_dtype == unsynced
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[unsynced]
    assert f"on the step's last micro-batch (the earlier ones summed in {name})" in cfg.describe(8)
    assert "summed in" not in EngineConfig(1, precision, 1, 0.0, reduce=reduce, accumulate=accumulate).describe(8)
