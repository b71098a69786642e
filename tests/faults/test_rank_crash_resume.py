"""A rank SIGKILLed mid-run (two real CPU ranks, deepspeed launcher, gloo, ZeRO-2), then
`--resume auto`: training continues from the last complete checkpoint with the losses of an
uninterrupted run."""
import glob
import json

import pytest
from conftest import run_pretrain

from train.run.folder import read_metrics

pytestmark = pytest.mark.distributed
STEPS, CKPT_EVERY, KILL_AFTER = 6, 3, 5


def _shm_buffers() -> set[str]:
    return set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))


def test_rank_killed_at_step_5_resumes_from_step_3_with_the_uninterrupted_losses(tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    before = _shm_buffers()
    run_pretrain(straight, "--run.max_steps", str(STEPS), "--run.ckpt_every", str(CKPT_EVERY), ranks=2)
    assert _shm_buffers() <= before  # DeepSpeed's CPU all-reduce buffers are released (train/engine/distributed.py)

    # rank 1 is SIGKILLed once step 5 is done: no handler, no checkpoint, the launcher ends rank 0
    proc = run_pretrain(crashed, "--run.max_steps", str(STEPS), "--run.ckpt_every", str(CKPT_EVERY), ranks=2,
                        faults=f"after_step@{KILL_AFTER}:rank1", check=False)
    said = proc.stdout + proc.stderr
    # the launcher reports the killed rank 1 (-9): rank 0, whose collective failed when its peer
    # vanished, says so and ends 3 s later (train/run/cli.py), after the launcher's next look
    assert proc.returncode == 247 and f"[fault] rank 1 SIGKILLs itself at after_step@{KILL_AFTER}" in said
    assert "exits with return code = -9" in said and "rank 0 stopped: another rank ended the run" in said, said[-3000:]
    root = crashed / "checkpoints"
    assert (root / "latest").read_text() == "step00000003"
    assert not (root / "step00000006").exists()
    assert max(r["step"] for r in read_metrics(crashed)) < STEPS  # it really stopped early

    proc = run_pretrain(crashed, "--run.max_steps", str(STEPS), "--run.ckpt_every", str(CKPT_EVERY),
                        "--resume", "auto", ranks=2)
    assert "step00000003 at step 3" in proc.stdout + proc.stderr

    meta = json.loads((straight / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["batch"]["global"] == 16
    tag = root / "step00000003"
    assert {p.name for p in (tag / "optim").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # each rank its shard
    assert json.loads((tag / "complete.json").read_text())["zero_stage"] == 2

    want = {r["step"]: r for r in read_metrics(straight)}
    got = read_metrics(crashed)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # the crashed run's lines after step 3 replaced
    for r in got[CKPT_EVERY:]:
        assert r["loss"] == want[r["step"]]["loss"], f"step {r['step']}: {r['loss']} vs {want[r['step']]['loss']}"
        assert r["grad_norm"] == pytest.approx(want[r["step"]]["grad_norm"], rel=1e-6)
    # the losses moved: steps after the resume are not a replay of the first steps
    assert got[CKPT_EVERY]["loss"] != got[0]["loss"]
