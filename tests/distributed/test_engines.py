"""Every ZeRO stage on every world size takes the same steps (tests/distributed/engine_check.py
runs them on 1-4 gloo ranks): stage 0 on DDP (or no wrapper on one rank), stages 1-3 on FSDP2.

fp32: the losses of three optimizer steps agree to 1e-6 relative for every stage, world size
(3 and 4 shard the debug ViT's tensors unevenly) and accumulation 1 and 3, for MAE and
fine-tuning. bf16: to 5e-4 relative, because the gradients are rounded to bf16 (8 bits of
mantissa: 4e-3 relative) before they are reduced, in bf16, and the ranks' shares are summed in
an order that depends on the world size and the engine; after two AdamW steps the losses differ
by about 1e-4 (measured: 7e-5 at most). The gradient norm each step's clipping divides by agrees
too (1e-5 fp32, 2e-3 bf16): AdamW's update hardly changes when every gradient is scaled alike, so
the losses alone would not show a norm taken over one rank's shards.
"""
import json

import pytest
from conftest import REPO, run_ranks

from model.objectives import list_objectives

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "distributed" / "engine_check.py"
EQUALITY = ("equality-mae-fp32", "equality-finetune-fp32", "equality-mae-bf16")
AT_TWO_RANKS = ("objective-energy", "objective-mlomae", "poison", "sweep", "compile-mae", "float8-mae")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's record, by (case, world size): one process group per world size."""
    out = tmp_path_factory.mktemp("engines")
    for world in (1, 2, 3, 4):
        run_ranks(world, SCRIPT, str(out), ",".join(EQUALITY + (AT_TWO_RANKS if world == 2 else ())))
    return {(case, world): json.loads((out / f"{case}_{world}.json").read_text())
            for case in EQUALITY + AT_TWO_RANKS for world in (1, 2, 3, 4) if (out / f"{case}_{world}.json").exists()}


def test_every_objective_trains_on_every_stage_through_the_loop(results):
    """Every objective's debug preset (AdPE's RPE-coordinate adversary, MLO-MAE's levels, energy's
    double backward, fine-tuning's layer-decay groups; the linear probe's LARS on ZeRO-0) through
    the real loop and data source at 2 ranks: the same first loss on every stage (the same weights
    and data), then a finite second one."""
    runs = results["sweep", 2]
    names = {key.split()[0] for key in runs}
    assert names == set(list_objectives()) | {"adpe"}  # every registered objective, and AdPE's adversary
    assert {"mae", "mixedae", "maeplus", "mlomae", "energy", "finetune", "linprobe"} <= names
    for name in names:
        stages = ["0"] if name == "linprobe" else ["0", "1", "2", "3"]
        first = runs[f"{name} 0"][0]
        for stage in stages:
            losses = runs[f"{name} {stage}"]
            assert len(losses) == 2 and all(v == v and abs(v) < 100 for v in losses), (name, stage, losses)
            assert losses[0] == pytest.approx(first, rel=1e-5), (name, stage)


def test_float8_blocks_train_alike_on_ddp_and_every_fsdp2_stage(results):
    """run.float8 at 2 ranks, fp32 masters: DDP (stage 0) and FSDP2 (stages 1-3) gather the same
    whole weights and cast the same local batches, so their losses agree to 1e-5 relative; and
    they are not the plain run's (the float8 matmuls ran)."""
    pytest.importorskip("torchao")
    runs = results["float8-mae", 2]
    for stage in "0123":
        assert len(runs[stage]) == 3 and runs[stage] == pytest.approx(runs["0"], rel=1e-5), stage
    assert runs["0"] != runs["0 plain"] and runs["0"] == pytest.approx(runs["0 plain"], rel=0.05)


def test_compiled_blocks_take_the_eager_steps_on_two_ranks_and_compile_nothing_after_the_first(results):
    """run.compile on DDP (stage 0) and FSDP2 (stages 1-3), 2 ranks, fp32: the losses of three
    optimizer steps agree with the eager blocks' to 1e-5 relative (inductor reorders float sums),
    and every block graph was compiled in the first step."""
    runs = results["compile-mae", 2]
    for stage in "0123":
        eager, compiled = runs[f"{stage} eager"], runs[f"{stage} compiled"]
        assert len(compiled) == 3 and eager[2] != pytest.approx(eager[0], rel=1e-4)
        assert compiled == pytest.approx(eager, rel=1e-5), stage
        after_first, after_last = runs[f"{stage} graphs"]
        assert after_first >= 2 and after_last == after_first, stage  # encoder and decoder graphs, then none


# bf16's norms to 2e-3: after the first step the weights differ as the losses do (measured: 5.5e-4 at most)
@pytest.mark.parametrize("case,rel,norm_rel", [("equality-mae-fp32", 1e-6, 1e-5), ("equality-finetune-fp32", 1e-6, 1e-5),
                                               ("equality-mae-bf16", 5e-4, 2e-3)])
def test_every_stage_world_size_and_accumulation_takes_the_same_steps(results, case, rel, norm_rel):
    reference = results[case, 1]["0_1"]  # one rank, no wrapper, no accumulation
    assert len(reference) == 3 and reference[2] != pytest.approx(reference[0], rel=1e-4)  # the steps changed the model
    # gradient_clipping 1.0 acts on some step, so the steps depend on the norm of the whole gradient,
    # which no rank of a sharded stage holds alone: the norms must agree as well as the losses
    reference_norms = results[case, 1]["grad_norm"]["0_1"]
    assert max(reference_norms) > 1.0 and all(0 < v < 1e3 for v in reference_norms), reference_norms
    for world in (1, 2, 3, 4):
        runs = dict(results[case, world])
        norms = runs.pop("grad_norm")
        assert sorted(runs) == sorted(norms) == [f"{s}_{a}" for s in range(4) for a in (1, 3)]
        for key, losses in runs.items():
            assert losses == pytest.approx(reference, rel=rel), (world, key)
            assert norms[key] == pytest.approx(reference_norms, rel=norm_rel), (world, key)


@pytest.mark.parametrize("objective", ["energy", "mlomae"])
def test_energy_and_mlomae_take_the_same_steps_on_ddp_and_fsdp2(results, objective):
    """Energy's double backward (FSDP2 keeps the weights gathered through it) and MLO-MAE's levels
    II-III (after the step, on the gathered weights) at 2 ranks: stage 0 on DDP, 1-3 on FSDP2."""
    runs = results[f"objective-{objective}", 2]
    assert sorted(runs) == ["0", "1", "2", "3"]
    for stage in ("1", "2", "3"):
        assert runs[stage] == pytest.approx(runs["0"], rel=1e-5), stage
    assert runs["0"][2] != pytest.approx(runs["0"][0], rel=1e-3)  # the steps changed the loss


def test_a_poisoned_step_changes_nothing_and_is_counted_on_every_stage(results):
    """Rank 1's loss is NaN: every rank skips the step (the NaN reaches every rank through the
    reduction), weights and moments stay, the skip is counted, and the next step applies."""
    runs = results["poison", 2]
    assert sorted(runs) == ["0", "1", "2", "3"]
    for stage, r in runs.items():
        assert r["weights_unchanged"] and r["moments_unchanged"], stage
        assert r["skipped"] == 1.0 and r["next_step_applied"], stage
