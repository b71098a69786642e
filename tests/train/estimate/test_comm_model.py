"""train/estimate/comm_model.py against hand computation on small models: ring bytes, link bandwidths, what
each engine sends per step, and what can and cannot hide behind compute."""
import pytest

from train.estimate.comm_model import Compute, Model, Network, StepConfig, Unit, estimate, ring_factor

NET = Network()  # 8 GPUs per node, 360 GB/s NVLink, 800 Gb/s per node, 10 / 30 us
GPU = Compute(peak_tflops=1000.0, mfu=0.5)  # 500 TFLOP/s: 1 ms per 5e11 FLOPs


def toy(root_params=1_000, block_params=1_000_000, blocks=4, root_flops=1e11, block_flops=1e11) -> Model:
    return Model(Unit("root", root_params, root_flops),
                 tuple(Unit(f"b{i}", block_params, block_flops) for i in range(blocks)))


def seconds(kind: str, payload: float, world: int, net: Network = NET) -> float:
    """One ring collective by hand: latency + bytes each rank sends / bus bandwidth."""
    factor = {"all_reduce": 2 * (world - 1) / world, "reduce_scatter": (world - 1) / world,
              "all_gather": (world - 1) / world}[kind]
    one_node = world <= net.gpus_per_node
    bus = 360e9 if one_node else min(360e9, 800e9 / 8)
    return (10e-6 if one_node else 30e-6) + factor * payload / bus


def test_ring_factors():
    assert ring_factor("all_reduce", 4) == 1.5 and ring_factor("reduce_scatter", 4) == 0.75
    assert ring_factor("all_gather", 1) == 0 and ring_factor("all_reduce", 128) == pytest.approx(2 * 127 / 128)
    with pytest.raises(ValueError):
        ring_factor("broadcast", 8)


def test_a_ring_spanning_nodes_runs_at_the_nodes_inter_node_bandwidth():
    assert NET.bus_bytes_s(8) == 360e9 and NET.bus_bytes_s(9) == 100e9 and NET.nodes(32) == 4
    assert Network(inter_gbits_s=8 * 400 * 2).bus_bytes_s(16) == 360e9  # faster NICs than NVLink: NVLink bounds


def test_one_gpu_communicates_nothing():
    for engine in ("before", "after"):
        for stage in range(4):
            est = estimate(engine, toy(), StepConfig(stage, "bf16", "bf16", 2), 1, NET, GPU)
            assert est.sent == {} and est.comm_s == 0 and est.exposed_s == 0 and est.efficiency == 1


def test_before_zero0_one_blocking_fp32_all_reduce_after_the_last_micro_batch():
    m, world = toy(), 4
    n = 1_000 + 4 * 1_000_000
    est = estimate("before", m, StepConfig(0, "bf16", "bf16", 3), world, NET, GPU)
    assert est.sent == {"all_reduce gradients fp32": pytest.approx(2 * 3 / 4 * 4 * n)}
    assert est.calls == {"all_reduce gradients fp32": 1}
    compute = 3 * 3 * 5e11 / 5e14  # 3 micro-batches x 3 x (root + 4 blocks) forward FLOPs at 500 TFLOP/s
    assert est.compute_s == pytest.approx(compute)
    assert est.exposed_s == pytest.approx(seconds("all_reduce", 4 * n, world)) == pytest.approx(est.comm_s)
    assert est.overlapped_s == pytest.approx(0) and est.efficiency == pytest.approx(compute / (compute + est.comm_s))


def test_before_zero1_and_zero2_bytes_and_nothing_hidden():
    m, world, n = toy(), 16, 1_000 + 4 * 1_000_000
    z1 = estimate("before", m, StepConfig(1, "bf16", "bf16", 2), world, NET, GPU)
    assert z1.sent == pytest.approx({"reduce_scatter gradients fp32": 15 / 16 * 4 * n,
                                     "all_gather weights bf16": 15 / 16 * 2 * n,
                                     "all_reduce gradient norm fp32": 2 * 15 / 16 * 4})
    z2 = estimate("before", m, StepConfig(2, "bf16", "bf16", 2), world, NET, GPU)
    assert z2.sent["reduce_scatter gradients bf16"] == pytest.approx(2 * 15 / 16 * 2 * n)  # every micro-batch
    assert z2.calls["reduce_scatter gradients bf16"] == 2
    for est in (z1, z2):
        assert est.exposed_s == pytest.approx(est.comm_s)
    want = seconds("reduce_scatter", 4 * n, world) + seconds("all_gather", 2 * n, world) + seconds("all_reduce", 4, world)
    assert z1.comm_s == pytest.approx(want)


def test_zero3_bytes_per_step_before_and_after():
    """Per micro-batch: the weights gathered in forward (every unit) and again in backward (the
    blocks: the root keeps its own), the gradients reduce-scattered; then the norm's scalar."""
    m, world, accum = toy(root_params=5_000), 8, 2
    n, blocks = 5_000 + 4 * 1_000_000, 4 * 1_000_000
    for engine, r in (("before", 4), ("after", 2)):
        est = estimate(engine, m, StepConfig(3, "bf16", "bf16", accum), world, NET, GPU)
        f = 7 / 8
        assert est.sent["all_gather weights bf16"] == pytest.approx(accum * f * 2 * (n + blocks))
        grads = "reduce_scatter gradients " + ("fp32" if r == 4 else "bf16")
        assert est.sent[grads] == pytest.approx(accum * f * r * n)
        assert est.calls == {"all_gather weights bf16": accum * (5 + 4), grads: accum * 5,
                             "all_reduce gradient norm fp32": 1}


def test_after_zero1_gathers_and_reduces_once_per_step_zero2_reduces_every_micro_batch():
    m, world, accum = toy(), 8, 4
    n = 1_000 + 4 * 1_000_000
    z1 = estimate("after", m, StepConfig(1, "bf16", "fp32", accum), world, NET, GPU)
    assert z1.sent["all_gather weights bf16"] == pytest.approx(7 / 8 * 2 * n)
    assert z1.sent["reduce_scatter gradients fp32"] == pytest.approx(7 / 8 * 4 * n)  # communication_data_type fp32
    z2 = estimate("after", m, StepConfig(2, "bf16", "bf16", accum), world, NET, GPU)
    assert z2.sent["reduce_scatter gradients bf16"] == pytest.approx(accum * 7 / 8 * 2 * n)
    assert z2.calls["reduce_scatter gradients bf16"] == accum * 5 and z2.calls["all_gather weights bf16"] == 5


def test_after_zero2_hides_all_but_the_first_gather_and_the_last_reductions_when_compute_is_long():
    """Compute far longer than any collective: what stays exposed is the root's all-gather at the
    start of the step, and at the end of every backward the reduce-scatters of the last block and
    the root (their gradients are ready only then), then the norm's all-reduce."""
    m, world, accum = toy(block_flops=1e13, root_flops=1e13), 32, 3
    est = estimate("after", m, StepConfig(2, "bf16", "bf16", accum), world, NET, GPU)
    want = (seconds("all_gather", 2 * 1_000, world)
            + accum * (seconds("reduce_scatter", 2 * 1_000_000, world) + seconds("reduce_scatter", 2 * 1_000, world))
            + seconds("all_reduce", 4, world))
    assert est.exposed_s == pytest.approx(want)
    assert est.overlapped_s == pytest.approx(est.comm_s - want) and est.overlapped_s > 0


def test_communication_beyond_the_compute_window_is_exposed():
    m = toy(block_flops=1e6, root_flops=1e6)  # nanoseconds of compute
    for stage in range(4):
        est = estimate("after", m, StepConfig(stage, "bf16", "bf16", 2), 32, NET, GPU)
        assert est.overlapped_s <= est.compute_s + 1e-12
        assert est.exposed_s >= est.comm_s - est.compute_s - 1e-12


def test_ddp_buckets_every_micro_batch_in_bf16_once_per_step_in_fp32():
    m, world = toy(blocks=4, block_params=10_000_000), 8
    n = 1_000 + 40_000_000
    bf16 = estimate("after", m, StepConfig(0, "bf16", "bf16", 2), world, NET, GPU)
    assert bf16.sent == {"all_reduce gradients bf16": pytest.approx(2 * 2 * 7 / 8 * 2 * n)}
    # 80 MB of bf16 gradients per backward in 25 MiB buckets: 3 full ones, the last with the rest
    assert bf16.calls["all_reduce gradients bf16"] == 2 * (int(2 * n // (25 * 2**20)) + 1) == 8
    fp32 = estimate("after", m, StepConfig(0, "fp32", "fp32", 2), world, NET, GPU)
    assert fp32.sent == {"all_reduce gradients fp32": pytest.approx(2 * 7 / 8 * 4 * n)}  # no_sync on the first
    small = estimate("after", m, StepConfig(0, "fp32", "fp32", 1, bucket_elements=1_000_000), world, NET, GPU)
    assert small.calls["all_reduce gradients fp32"] == 41  # 4 MB buckets of 160 MB (+ the root's, the last)


def test_a_units_forward_is_a_third_of_its_compute_a_quarter_when_checkpointed():
    """Training is 3 x the forward FLOPs; a checkpointed block runs its forward again in backward,
    so of the same total the forward takes 1/4 and the backward (with the recompute) 3/4."""
    flops = 2e11
    total = 3 * flops / (0.5 * 1000e12)  # at 500 TFLOP/s
    plain, ckpt = Unit("b", 1, flops), Unit("b", 1, flops, checkpointed=True)
    assert plain.forward_s(GPU) == pytest.approx(total / 3) and plain.backward_s(GPU) == pytest.approx(2 * total / 3)
    assert ckpt.forward_s(GPU) == pytest.approx(total / 4) and ckpt.backward_s(GPU) == pytest.approx(3 * total / 4)


def test_a_ddp_bucket_that_fills_mid_block_is_issued_then_and_hides_behind_the_rest_of_the_block():
    """One block of 1M bf16 gradients in buckets of half of them: the first bucket is full halfway
    through the block's backward (0.2 ms of it left, far more than its all-reduce), so only the
    second (issued at the block's end) and the root's last bucket stay exposed."""
    m, world = toy(blocks=1, block_params=1_000_000, root_params=1_000, block_flops=1e11), 8
    est = estimate("after", m, StepConfig(0, "bf16", "bf16", 1, bucket_elements=500_000), world, NET, GPU)
    assert est.calls == {"all_reduce gradients bf16": 3}
    second, root = seconds("all_reduce", 2 * 500_000, world), seconds("all_reduce", 2 * 1_000, world)
    assert est.exposed_s == pytest.approx(second + root)


def test_ddp_buckets_are_counted_in_elements_of_the_reduce_dtype():
    """reduce_bucket_size is in elements: 1M of them are 2 MB in bf16, 4 MB in fp32, so a bf16
    backward of half the bytes needs as many buckets as the fp32 one."""
    assert StepConfig(0, "bf16", "bf16", 1, 1_000_000).bucket_bytes() == 2_000_000
    assert StepConfig(0, "bf16", "fp32", 1, 1_000_000).bucket_bytes() == 4_000_000
    m, world = toy(blocks=4, block_params=10_000_000), 8
    for dtype in ("bf16", "fp32"):
        est = estimate("after", m, StepConfig(0, dtype, dtype, 1, bucket_elements=1_000_000), world, NET, GPU)
        assert est.calls == {f"all_reduce gradients {dtype}": 40 + 1}  # 40M elements in 1M-element buckets + the root's


def test_after_exposes_less_than_before_across_nodes_at_every_stage():
    """A ViT-B-like model: 20 blocks of 7M parameters, a 1.4M root, 50 ms of compute per step."""
    m = toy(root_params=1_400_000, block_params=7_000_000, blocks=20, root_flops=5e11, block_flops=1.2e12)
    for stage in range(4):
        for world in (16, 32, 128):
            step = StepConfig(stage, "bf16", "bf16", 1)
            before, after = (estimate(e, m, step, world, NET, GPU) for e in ("before", "after"))
            assert after.exposed_s < before.exposed_s, (stage, world)
            assert after.efficiency > before.efficiency


def test_unknown_engine_or_stage_is_refused():
    with pytest.raises(ValueError, match="engine"):
        estimate("deepspeed", toy(), StepConfig(1, "bf16", "bf16", 1), 8)
    with pytest.raises(ValueError, match="stage"):
        estimate("after", toy(), StepConfig(4, "bf16", "bf16", 1), 8)
