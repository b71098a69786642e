"""Faults during a checkpoint save: a write that fails as on a full disk (ENOSPC) ends the run on
every rank with one line and exit status 3, removes the partial tag and keeps the previous
checkpoint as the latest, from which --resume auto continues; every file and folder of a save is
fsynced. The runs go through the real entry point (tests/faults/failing_saves.py) in processes of
their own."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_DS, DEBUG_PRESET, REPO
from ports import free_port

from train.engine.checkpoint import LATEST, PARTIAL, tag_for
from train.run.folder import read_metrics

SCRIPT = Path(__file__).with_name("failing_saves.py")
STEP4 = f"{tag_for(4)}{PARTIAL}"


def argv(out: Path, *args: str, ds: Path = CPU_DS) -> list[str]:
    return ["--ds_config", str(ds), "--config", str(DEBUG_PRESET), "--output_dir", str(out), "--run.progress", "false",
            "--run.tensorboard", "false", "--run.export", "false", *args]


def run_scenarios(tmp_path: Path, scenarios: list[dict], ranks: int = 1) -> list[list[dict]]:
    """The scenarios run one after the other in one process per rank (a gloo group for 2 ranks);
    per rank, per scenario: {"status", "stderr", "fsynced"}. A rank left waiting fails the test by
    the timeout."""
    (tmp_path / "scenarios.json").write_text(json.dumps(scenarios))
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        if ranks > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path / "record.json"),
                                       str(tmp_path / "scenarios.json")], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    return [json.loads((tmp_path / f"record_rank{r}.json").read_text()) for r in range(ranks)]


def stopped_line(result: dict) -> str:
    """The run's one line of exit status 3 (the log lines of the run before it are not refusals)."""
    assert result["status"] == 3, result["stderr"][-20:]
    lines = [line for line in result["stderr"] if line.startswith("training stopped:")]
    assert len(lines) == 1 and not any("Traceback" in line for line in result["stderr"]), result["stderr"][-20:]
    return lines[0]


def assert_previous_kept(out: Path) -> None:
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [LATEST, tag_for(2)]  # no partial tag left
    assert (root / LATEST).read_text() == tag_for(2)


FAILING = {  # the file whose write fails at the save of step 4, and the folder it is written in
    "model.safetensors": ("model.safetensors", STEP4),  # rank 0's weights writer
    "optimizer shard": ("__0_0.distcp", f"{STEP4}/optim"),  # DCP's writer (its failure arrives wrapped)
    "rng file": ("rng_rank0.pt", STEP4),  # torch.save of each rank
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One process: a 4-step run whose save of step 4 fails, for each file of FAILING; one more, then
    continued with --resume auto; a 2-step run with every fsync recorded."""
    tmp = tmp_path_factory.mktemp("saves")
    steps = ("--run.max_steps", "4", "--run.ckpt_every", "2")
    scenarios = [{"argv": argv(tmp / name, *steps), "fail": file, "in": folder}
                 for name, (file, folder) in FAILING.items()]
    scenarios.append({"argv": argv(tmp / "resumed", *steps), "fail": "state.pt", "in": STEP4})
    scenarios.append({"argv": argv(tmp / "resumed", *steps, "--resume", "auto")})
    scenarios.append({"argv": argv(tmp / "synced", "--run.max_steps", "2", "--run.ckpt_every", "2"), "fsync": True})
    [results] = run_scenarios(tmp, scenarios)
    return tmp, results


@pytest.mark.parametrize("which", list(FAILING))
def test_a_full_disk_during_a_save_stops_the_run_in_one_line_and_keeps_the_previous_checkpoint(one_rank, which):
    tmp, results = one_rank
    line = stopped_line(results[list(FAILING).index(which)])
    assert line.startswith("training stopped: the checkpoint of step 4 could not be written (No space left on device")
    assert ("in the optimizer state (optim/)" if which == "optimizer shard" else f"{STEP4}/{FAILING[which][0]}") in line
    assert f"the checkpoint {tag_for(2)} is kept as the latest" in line and line.endswith("--resume auto")
    assert_previous_kept(tmp / which)


def test_resume_auto_after_a_failed_save_continues_from_the_kept_checkpoint(one_rank):
    tmp, results = one_rank
    failed, resumed = results[len(FAILING):len(FAILING) + 2]
    assert f"{STEP4}/state.pt" in stopped_line(failed)
    assert resumed["status"] == 0, resumed["stderr"][-20:]
    [resume] = [json.loads(line) for line in (tmp / "resumed" / "resumes.jsonl").read_text().splitlines()]
    assert resume["step"] == 2 and resume["from"] == str(tmp / "resumed" / "checkpoints" / tag_for(2))
    rows, uninterrupted = read_metrics(tmp / "resumed"), read_metrics(tmp / "rng file")  # the same run, not resumed
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == [r["loss"] for r in uninterrupted]  # steps 3-4 again from step 2: the same
    root = tmp / "resumed" / "checkpoints"
    assert (root / LATEST).read_text() == tag_for(4) and (root / tag_for(4) / "complete.json").is_file()


def test_every_file_and_folder_of_a_save_is_fsynced_before_the_tag_is_declared_complete(one_rank):
    tmp, results = one_rank
    synced = results[-1]["fsynced"]
    root = tmp / "synced" / "checkpoints"
    partial = root / f"{tag_for(2)}{PARTIAL}"
    for name in ("model.safetensors", "state.pt", "rng_rank0.pt", "optim/__0_0.distcp", "optim/.metadata.tmp"):
        assert str(partial / name) in synced, name  # the tensors, the state, the RNG; DCP syncs its own files
    complete_tmp = [i for i, p in enumerate(synced) if p.startswith(str(partial / ".complete.json.tmp"))]
    latest_tmp = [i for i, p in enumerate(synced) if p.startswith(str(root / ".latest.tmp"))]
    folder = [i for i, p in enumerate(synced) if p == str(partial)]
    checkpoints = [i for i, p in enumerate(synced) if p == str(root)]
    assert str(partial / "optim") in synced and complete_tmp and latest_tmp and folder
    # complete.json reaches the disk, then the tag's folder; the rename, then `latest`: the checkpoints folder
    # after each
    assert complete_tmp[0] < folder[-1] < checkpoints[0] < latest_tmp[0] < checkpoints[-1]


@pytest.mark.distributed
def test_a_rank_whose_write_fails_stops_every_rank_without_a_wait(tmp_path):
    """2 ranks under ZeRO-3 (every weight a DTensor that rank 0 gathers to write): rank 1's RNG file
    fails while rank 0 has written everything, then rank 0's weights file fails while rank 1 joins
    its gathers. Neither leaves the other waiting; both stop with the same line."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0,
                              "zero_optimization": {"stage": 3}, "bf16": {"enabled": False}}))
    cases = {"rank1_rng": ("rng_rank1.pt", 1), "rank0_weights": ("model.safetensors", 0)}
    scenarios = [{"argv": argv(tmp_path / name, "--run.max_steps", "4", "--run.ckpt_every", "2", ds=ds), "fail": file,
                  "in": STEP4, "rank": rank} for name, (file, rank) in cases.items()]
    per_rank = run_scenarios(tmp_path, scenarios, ranks=2)
    for i, (name, (file, rank)) in enumerate(cases.items()):
        lines = {stopped_line(results[i]) for results in per_rank}
        assert len(lines) == 1, lines  # every rank says the same
        assert f"(rank {rank}: No space left on device: {tmp_path / name}/checkpoints/{STEP4}/{file};" in lines.pop()
        assert_previous_kept(tmp_path / name)
