"""Two real CPU ranks (deepspeed launcher, gloo), ZeRO-2: save, resume, same losses as straight."""
import glob
import json

import pytest
from conftest import run_pretrain

from train.run_dir import read_metrics

pytestmark = pytest.mark.distributed
STEPS, SPLIT = 6, 3


def _shm_buffers() -> set[str]:
    return set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))


def test_two_rank_zero2_resume_matches_uninterrupted(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    before = _shm_buffers()
    run_pretrain(straight, "--run.max_steps", str(STEPS), "--run.ckpt_every", str(SPLIT), ranks=2)
    assert _shm_buffers() <= before  # DeepSpeed's CPU all-reduce buffers are released (train/distributed.py)
    run_pretrain(split, "--run.max_steps", str(SPLIT), ranks=2)  # ends with a checkpoint at step 3
    proc = run_pretrain(split, "--run.max_steps", str(STEPS), "--resume", "auto", ranks=2)
    assert "resumed from" in proc.stdout + proc.stderr

    meta = json.loads((straight / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["batch"]["global"] == 16
    tag = split / "checkpoints" / "step00000003"
    assert {p.name for p in tag.glob("*optim_states.pt")} == {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}  # ZeRO-2 shards
    assert json.loads((tag / "complete.json").read_text())["zero_stage"] == 2

    want = {r["step"]: r for r in read_metrics(straight)}
    got = read_metrics(split)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r in got[SPLIT:]:
        assert r["loss"] == want[r["step"]]["loss"], f"step {r['step']}: {r['loss']} vs {want[r['step']]['loss']}"
        assert r["grad_norm"] == pytest.approx(want[r["step"]]["grad_norm"], rel=1e-6)
    # the losses moved: steps after the resume are not a replay of the first steps
    assert got[SPLIT]["loss"] != got[0]["loss"]
