"""Gradient communication hides behind the backward, on every ZeRO stage (the census of
tests/distributed/census_check.py on 2 gloo ranks: MAE at ViT-B depth and heads, width 48, the
A100 bf16 file's settings): every gradient reduction is issued while autograd's backward runs
(DDP's bucket all-reduces, FSDP2's reduce-scatter of each block), none after it returns but, on
sharded stages, the norm's 1-element sum of squares in the step; and the step stays lean:
no host sync, and fewer kernel launches than the plain PyTorch loop (tools/mae_baseline.py, fused
AdamW) on every rank."""
import json

import pytest
from conftest import REPO, run_ranks

pytestmark = pytest.mark.distributed
BLOCKS = 12 + 8  # ViT-B's encoder blocks and MAE's decoder blocks: one FSDP2 unit each, and the root


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    out = tmp_path_factory.mktemp("census")
    run_ranks(2, REPO / "tests" / "distributed" / "census_check.py", str(out))
    return json.loads((out / "census.json").read_text())


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_gradient_reductions_are_issued_inside_the_backward(census, stage):
    for rank, counts in enumerate(census[stage]["ranks"]):
        o = counts["overlap"]
        assert o["reductions_in_backward"] >= (1 if stage == "0" else BLOCKS + 1), (rank, o)
        if stage == "0":  # DDP: every bucket's all-reduce inside the backward, none after it
            assert o["reductions_after_backward"] == 0, (rank, o)
        else:  # the step's all-reduce of the norm's 1-element sum of squares (train/engine/sharded.py)
            assert (o["reductions_after_backward"], o["elements_reduced_after_backward"]) == (1, 1), (rank, o)
        collectives = o["collectives"]
        reduce_scatters = [c for c in collectives if "reduce_scatter" in c["op"]]
        assert all(c["in_backward"] for c in reduce_scatters), rank  # FSDP2: every unit's, inside the backward
        if stage != "0":
            assert len(reduce_scatters) == BLOCKS + 1 and all(c["phase"] == "backward" for c in reduce_scatters)


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_each_block_gathers_the_next_blocks_weights_before_it_computes(census, stage):
    """FSDP2's explicit forward prefetch: in a step's forward (every stage gathers the weights once
    per optimizer step), the first block issues its own all-gather and the second block's before it
    computes (only the second gather's copy-in between them), and every later gather follows one
    block's forward after the one before: each block's weights are on their way while the block
    before it runs. Without the prefetch the first two gathers are a whole block's forward apart."""
    for rank, counts in enumerate(census[stage]["ranks"]):
        gathers = [c for c in counts["overlap"]["collectives"] if c["phase"] == "forward" and "gather" in c["op"]]
        assert len(gathers) == BLOCKS + 1, (rank, len(gathers))  # the root's, then every block's
        gaps = [b["launches_before"] - a["launches_before"] for a, b in zip(gathers[1:], gathers[2:])]
        block_forward = gaps[1]  # a block's kernels and the next gather's copy-in
        assert gaps[0] <= 4 < block_forward, (rank, gaps)
        assert set(gaps[1:12]) == {block_forward}, (rank, gaps)  # the encoder's blocks, one ahead each


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_every_stage_launches_fewer_kernels_than_the_plain_loop_without_a_sync(census, stage):
    baseline = census["0"]["ranks"][0]["counts"]["baseline (fused AdamW)"]["total"]
    assert baseline["syncs"] == 1  # the plain loop reads its loss every step
    for rank, counts in enumerate(census[stage]["ranks"]):
        ours = counts["counts"]["ours"]["total"]
        assert ours["syncs"] == 0 and not counts["syncs"], (rank, counts["syncs"])
        assert ours["launches"] <= baseline["launches"], (stage, rank, ours, baseline)
