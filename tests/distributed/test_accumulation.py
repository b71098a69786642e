"""ZeRO-1's micro-batch sums (tests/distributed/accumulation_check.py runs them on two gloo ranks):
DeepSpeed's default sums a step's micro-batches in the compute dtype, where gradients under half a
unit in the last place of the sum are lost; data_types.grad_accum_dtype fp32 sums them in fp32
and still communicates in the compute dtype (one cast before the reduce-scatter), as DeepSpeed's
BF16_Optimizer does; communication_data_type fp32 sums and reduces in fp32. ZeRO-0 (DDP) reduces
fp32 gradients once per step, on its last micro-batch, and bf16 ones every micro-batch."""
import json

import pytest
import torch
from accumulation_check import ACCUM, DDP_ACCUM, MANTISSA, WIDTH  # beside this file: pytest puts its folder on sys.path
from conftest import REPO, run_ranks

pytestmark = pytest.mark.distributed
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("accumulation")
    run_ranks(2, REPO / "tests" / "distributed" / "accumulation_check.py", str(out))
    return json.loads((out / "accumulation.json").read_text())


def micro_batches(precision: str, rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s micro-batch gradients of one step, in fp32 (the check's module and inputs)."""
    small = 2.0 ** -(MANTISSA[precision] + 2)
    return [torch.tensor((rank + 1) * (1.0 if m == 0 else small) / ACCUM) for m in range(ACCUM)]


def summed_in(dtype: torch.dtype, grads: list[torch.Tensor]) -> torch.Tensor:
    total = grads[0].to(dtype)
    for g in grads[1:]:
        total = total + g.to(dtype)
    return total


def mean_over_ranks(precision: str, sum_dtype: torch.dtype, comm_dtype: torch.dtype) -> float:
    """The plain reference: each rank's sum in `sum_dtype`, cast to `comm_dtype`, averaged."""
    sums = [summed_in(sum_dtype, micro_batches(precision, r)).to(comm_dtype) for r in (0, 1)]
    return float(((sums[0] + sums[1]) / 2).float())


def shard_values(record: dict) -> set[float]:
    return {v for shard in record["shards"] for v in shard}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_by_default_micro_batches_add_up_in_the_compute_dtype(records, precision):
    """DeepSpeed's default (grad_accum_dtype = the model's dtype): the seven small micro-batches
    vanish from the sum, on both steps (the accumulators restart after each)."""
    dtype = DTYPES[precision]
    record = records[f"{precision} - -"]
    expected = mean_over_ranks(precision, dtype, dtype)
    assert expected == 1.5 / ACCUM  # the reference itself: only the first micro-batch counted
    assert shard_values(record) == {expected}
    assert record["communicated"] == []  # FSDP2's own reduce-scatter


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_grad_accum_dtype_fp32_sums_in_fp32_and_communicates_in_the_compute_dtype(records, precision):
    dtype = DTYPES[precision]
    record = records[f"{precision} fp32 -"]
    expected = mean_over_ranks(precision, torch.float32, dtype)
    assert expected > 1.5 / ACCUM  # the small micro-batches count
    assert shard_values(record) == {expected}
    # one reduce-scatter per optimizer step (the module is one FSDP2 unit), in the compute dtype
    assert record["communicated"] == [str(dtype).removeprefix("torch.")] * 2


def test_communication_data_type_fp32_sums_and_reduces_in_fp32(records):
    record = records["bf16 - fp32"]
    expected = mean_over_ranks("bf16", torch.float32, torch.float32)
    assert expected != mean_over_ranks("bf16", torch.float32, torch.bfloat16)  # not rounded to bf16 anywhere
    assert shard_values(record) == {expected}
    assert record["communicated"] == []


def test_an_fp16_mean_is_divided_before_the_sum_so_it_does_not_overflow(records):
    """ReduceScatterIn in fp16 (FSDP2's rule for an fp16 reduce dtype): two ranks' 40000 average to
    40000, though their sum is past fp16's largest value."""
    assert torch.isinf(torch.tensor(40000.0, dtype=torch.float16) * 2)  # the sum alone would overflow
    assert records["fp16 mean of 40000"] == [40000.0] * 4


@pytest.mark.parametrize("precision, buckets", [("fp32", [0] * (DDP_ACCUM - 1) + [1]), ("bf16", [1] * DDP_ACCUM)])
def test_ddp_reduces_fp32_gradients_once_per_step_and_16_bit_ones_every_micro_batch(records, precision, buckets):
    """fp32 sums a step's micro-batches in `.grad` and all-reduces the sum in the last one's
    backward (DDP's no_sync, which DDP reads in the forward); bf16 reduces each micro-batch into
    the fp32 masters. Either way the step's gradient is the mean over ranks of the micro-batches'
    sum: rank r's micro-batch m gives (r + 1) * (m + 1) / DDP_ACCUM."""
    record = records[f"ddp {precision}"]
    assert record["buckets"] == buckets  # the module is one bucket
    expected = sum((r + 1) * (m + 1) / DDP_ACCUM for r in (0, 1) for m in range(DDP_ACCUM)) / 2
    assert record["grad"] == [pytest.approx(expected, rel=1e-6)] * WIDTH
