"""Slurm launching without Slurm: faked environments for 2 local ranks, a fake scontrol / sbatch."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET, REPO
from ports import free_port

from launchers.slurm import gpus_on_node, node_envs, run_node
from train.engine.slurm_env import hostnames, in_task_step, task_env
from train.run.folder import read_metrics


def test_hostlists_expand():
    assert hostnames("gpu[01-03,07],login-a") == ["gpu01", "gpu02", "gpu03", "gpu07", "login-a"]
    assert hostnames("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert hostnames("node001") == ["node001"]


def test_one_task_per_gpu_maps_slurm_to_torch_distributed():
    env = {"SLURM_PROCID": "13", "SLURM_LOCALID": "5", "SLURM_STEP_NUM_TASKS": "32", "SLURM_STEP_NUM_NODES": "4",
           "SLURM_STEP_NODELIST": "gpu[01-04]", "SLURM_JOB_ID": "123456"}
    assert in_task_step(env)
    assert task_env(env) == {"RANK": "13", "LOCAL_RANK": "5", "WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8",
                             "MASTER_ADDR": "gpu01", "MASTER_PORT": str(20000 + 123456 % 20000)}
    assert task_env({**env, "MASTER_PORT": "29999"})["MASTER_PORT"] == "29999"
    assert task_env({**env, "MASTER_ADDR": "head"})["MASTER_ADDR"] == "head"  # an exported address wins too
    # the batch script itself, or a 1-task step, is not a rank of a bigger world
    assert not in_task_step({"SLURM_PROCID": "0", "SLURM_JOB_ID": "1", "SLURM_NTASKS": "32"})
    assert not in_task_step({**env, "SLURM_STEP_NUM_TASKS": "1"})


def test_the_port_is_20000_plus_the_job_id_mod_20000():
    # 13456 mod 20000 and mod 10000 differ: a port range that is not 20000 wide shows
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n1", "SLURM_JOB_ID": "13456"}
    assert task_env(env)["MASTER_PORT"] == str(20000 + 13456 % 20000) == "33456"
    assert task_env({**env, "SLURM_JOB_ID": "53456"})["MASTER_PORT"] == str(20000 + 53456 % 20000) == "33456"


def test_a_step_on_part_of_the_job_uses_the_step_s_nodes():
    """A 2-node step inside a 4-node job: its rank 0 runs on the step's first node (not the job's),
    and its world and ranks per node are the step's."""
    env = {"SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_NNODES": "4", "SLURM_STEP_NODELIST": "gpu[03-04]",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
           "SLURM_JOB_ID": "7"}
    task = task_env(env)
    assert task["MASTER_ADDR"] == "gpu03" and task["WORLD_SIZE"] == "16"
    assert task["LOCAL_WORLD_SIZE"] == str(16 // 2)
    envs = node_envs({**env, "SLURM_NODEID": "1"}, 8)  # the same step, one task per node
    assert {e["WORLD_SIZE"] for e in envs} == {str(2 * 8)} and {e["MASTER_ADDR"] for e in envs} == {"gpu03"}
    assert [e["RANK"] for e in envs] == [str(8 + r) for r in range(8)]


def test_gpus_on_node_reads_slurm_s_gpu_counts():
    assert gpus_on_node({"SLURM_GPUS_ON_NODE": "4"}) == 4
    assert gpus_on_node({"SLURM_GPUS_PER_NODE": "a100:8"}) == 8  # typed request
    assert gpus_on_node({"SLURM_GPUS_PER_NODE": "8(x2)"}) == 8  # the same count on 2 nodes
    assert gpus_on_node({"SLURM_GPUS_ON_NODE": "2", "SLURM_GPUS_PER_NODE": "a100:8"}) == 2  # this node's count first


def test_the_world_size_before_the_process_group_is_mpirun_s_too(monkeypatch):
    """mpirun's ranks (DeepSpeed's openmpi launcher) planned the batch, lr and schedule for a world
    of 1 while `init` joined them into a world of 8."""
    from train.engine.distributed import rank_from_env, world_size_from_env

    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_")) or k in ("WORLD_SIZE", "RANK")]:
        monkeypatch.delenv(key)
    assert world_size_from_env() == 1 and rank_from_env() == 0
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert world_size_from_env() == 8 and rank_from_env() == 3
    monkeypatch.setenv("WORLD_SIZE", "4")  # a launcher's own variable wins, as in init()
    monkeypatch.setenv("RANK", "2")
    assert world_size_from_env() == 4 and rank_from_env() == 2


def test_mpirun_s_local_rank_becomes_local_rank(monkeypatch):
    """Rank 11 of 16 is the 4th on its node: it takes cuda:3, not cuda:11."""
    from train.engine import distributed

    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_")) or k in ("WORLD_SIZE", "RANK")]:
        monkeypatch.delenv(key)
    for key, value in (("OMPI_COMM_WORLD_RANK", "11"), ("OMPI_COMM_WORLD_SIZE", "16"),
                       ("OMPI_COMM_WORLD_LOCAL_RANK", "3"), ("MASTER_ADDR", "head"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(key, value)
    seen = {}

    def init_process_group(*args, **kwargs):  # what env:// would read
        seen.update({name: os.environ[name] for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: int(os.environ["RANK"]))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: int(os.environ["WORLD_SIZE"]))
    distributed.init()  # the autouse fixture restores RANK, LOCAL_RANK, WORLD_SIZE afterwards
    assert seen == {"RANK": "11", "LOCAL_RANK": "3", "WORLD_SIZE": "16"}


def test_mpirun_without_a_master_address_is_refused_in_one_line(monkeypatch):
    """DeepSpeed's openmpi launcher exports no MASTER_ADDR: the rendezvous failed in a traceback."""
    from train.config.errors import ConfigError
    from train.engine import distributed

    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "MASTER_")) or k in ("WORLD_SIZE", "RANK")]:
        monkeypatch.delenv(key)
    for key, value in (("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1")):
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"mpirun started this rank without MASTER_ADDR / MASTER_PORT.*"
                                          r"\.deepspeed_env"):
        distributed.init()
    assert "RANK" not in os.environ and not torch.distributed.is_initialized()


def test_env_in_the_batch_script_says_it_needs_a_step_in_one_line(monkeypatch, capsys):
    from launchers.slurm import main

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-02]")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert main(["env"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run it inside a job step (srun ... python -m launchers.slurm env)" in err
    monkeypatch.setenv("SLURM_PROCID", "0")  # the batch script is task 0 of the job, but in no step
    assert main(["env"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run it inside a job step (srun ... python -m launchers.slurm env)" in err


def test_env_in_a_step_prints_shell_exports(monkeypatch, capsys):
    """`eval "$(srun python -m launchers.slurm env)"`: every line an export."""
    from launchers.slurm import main

    for key in [k for k in os.environ if k.startswith(("SLURM_", "MASTER_"))]:
        monkeypatch.delenv(key)
    for key, value in (("SLURM_JOB_NODELIST", "gpu[01-02]"), ("SLURM_JOB_ID", "7"), ("SLURM_PROCID", "9"),
                       ("SLURM_LOCALID", "1"), ("SLURM_STEP_NUM_TASKS", "16"), ("SLURM_STEP_NUM_NODES", "2")):
        monkeypatch.setenv(key, value)
    assert main(["env"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "export RANK=9", "export LOCAL_RANK=1", "export WORLD_SIZE=16", "export LOCAL_WORLD_SIZE=8",
        "export MASTER_ADDR=gpu01", f"export MASTER_PORT={20000 + 7}"]


def test_hostfile_lists_every_node_of_the_job(tmp_path, monkeypatch):
    from launchers.slurm import main

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-02]")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    assert main(["hostfile", str(tmp_path / "hosts")]) == 0
    assert (tmp_path / "hosts").read_text() == "gpu01 slots=8\ngpu02 slots=8\n"


def test_one_task_per_node_starts_its_ranks():
    env = {"SLURM_NODEID": "2", "SLURM_STEP_NUM_NODES": "4", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_ID": "7"}
    envs = node_envs(env, 8)
    assert [e["RANK"] for e in envs] == [str(r) for r in range(16, 24)]
    assert {e["WORLD_SIZE"] for e in envs} == {"32"} and [e["LOCAL_RANK"] for e in envs] == [str(r) for r in range(8)]
    assert {e["MASTER_ADDR"] for e in envs} == {"n1"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"8"}


def test_one_failing_rank_ends_the_node_with_its_exit_code():
    """Rank 0 fails while rank 1 would wait (for a collective) for a minute: the launcher stops
    rank 1 and exits with rank 0's code, so srun --kill-on-bad-exit ends the other nodes too."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))},
           "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURM_NNODES": "1"}
    command = ["-c", "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '0' else time.sleep(60)"]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    start = time.time()
    try:
        assert run_node(command, 2, env) == 3
    finally:
        for sig, handler in handlers.items():  # run_node forwards these to its ranks: pytest's own again
            signal.signal(sig, handler)
    assert time.time() - start < 20


def fake_slurm_bin(tmp_path):
    """A `scontrol` and an `sbatch` that record their arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, reply in (("scontrol", ""), ("sbatch", "Submitted batch job 4242")):
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/{name}.log\necho {reply}\n")
        script.chmod(0o755)
    return bin_dir


def wait_for_steps(run_dir, n, procs, timeout=240):
    end = time.time() + timeout
    while time.time() < end:
        if (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= n:
            return
        assert all(p.poll() is None for p in procs), "a rank ended early"
        time.sleep(0.1)
    raise AssertionError(f"no {n} logged steps within {timeout} s")


def test_requeue_on_sigusr1_writes_a_resumable_checkpoint_node_then_task_mode(tmp_path):
    run_dir = tmp_path / "run"
    bin_dir = fake_slurm_bin(tmp_path)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost",
             "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    args = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(run_dir),
            "--run.progress", "false", "--data.epoch_size", "100000", "--run.stop_check_every", "1"]
    # one task per node: the node launcher starts 2 ranks and forwards the signal to them
    node = subprocess.Popen([sys.executable, "-m", "launchers.slurm", "node", "--ranks", "2", "--",
                             "train/pretrain.py", *args],
                            cwd=REPO, env={**base, **slurm, "SLURM_NODEID": "0", "SLURM_NNODES": "1",
                                           "MASTER_PORT": str(free_port())},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_steps(run_dir, 2, [node])
    node.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=USR1@180` does ahead of the time limit
    out, _ = node.communicate(timeout=240)
    assert node.returncode == 0, out[-3000:]
    assert "requeued Slurm job 4242" in out
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    stopped = read_metrics(run_dir)[-1]["step"]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step{stopped:08d}"
    assert json.loads((run_dir / "checkpoints" / latest / "complete.json").read_text())["world_size"] == 2
    assert not (run_dir / "encoder.safetensors").exists()  # stopped, not finished: nothing exported

    # the requeued job, one task per GPU: each faked task is a rank (RANK etc. from SLURM_*)
    port = str(free_port())
    tasks = [subprocess.Popen([sys.executable, "train/pretrain.py", *args, "--resume", "auto",
                               "--run.max_steps", str(stopped + 2)], cwd=REPO,
                              env={**base, **slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r),
                                   "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1", "MASTER_PORT": port},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [t.communicate(timeout=240)[0] for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outs[0][-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / latest} at step {stopped}" in outs[0]
    assert [r["step"] for r in read_metrics(run_dir)][-3:] == [stopped, stopped + 1, stopped + 2]
    assert json.loads((run_dir / "meta.json").read_text())["world_size"] == 2


def test_a_requeue_that_fails_ends_the_job_non_zero_naming_its_checkpoint(tmp_path):
    """`scontrol requeue` refused (requeue disabled): the run logged it and every rank exited 0, so
    the job ended COMPLETED in mid-schedule and never continued."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'Requeue of job is disabled' >&2\nexit 1\n")
    (bin_dir / "scontrol").chmod(0o755)
    run_dir = tmp_path / "run"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    proc = subprocess.Popen([sys.executable, "train/pretrain.py", "--ds_config", str(CPU_DS), "--config",
                             str(DEBUG_PRESET), "--output_dir", str(run_dir), "--run.progress", "false",
                             "--data.epoch_size", "100000", "--run.stop_check_every", "1"], cwd=REPO,
                            env={**base, "SLURM_JOB_ID": "4243", "PATH": f"{bin_dir}:{os.environ['PATH']}",
                                 "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(run_dir, 2, [proc])
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=240)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert proc.returncode == 75, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"stopped by Slurm's warning signal after step {int(latest[4:])}: "
                                                   f"checkpoint {run_dir / 'checkpoints' / latest}; the requeue failed "
                                                   f"(scontrol requeue 4243 failed (1): Requeue of job is disabled)")


def test_submit_checks_snapshots_and_calls_sbatch(tmp_path, monkeypatch, capsys):
    from launchers.submit import main

    monkeypatch.setenv("PATH", f"{fake_slurm_bin(tmp_path)}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    common = ["--gpu", "a100", "--", "--ds_config", str(REPO / "ds_configs" / "vit_b_8xa100_bf16_zero1.json"),
              "--model.name", "vit_base_patch16", "--data.source", "synthetic", "--output_dir", str(run_dir)]
    assert main(["--nodes", "3", *common]) == 2  # 4096 / (256 x 24) is no whole accumulation
    assert "not submitted" in capsys.readouterr().err
    assert not run_dir.exists() and not (tmp_path / "sbatch.log").exists()

    assert main(["--nodes", "2", "--partition", "gpu", *common]) == 0
    launch = next((run_dir / "launch").iterdir())
    record = json.loads((launch / "submit.json").read_text())
    assert record["job"] == "4242" and record["world_size"] == 16 and len(record["commit"]) == 40
    assert (launch / "code" / "train" / "pretrain.py").read_text() == (REPO / "train" / "pretrain.py").read_text()
    test_only, sbatch = [line.split() for line in (tmp_path / "sbatch.log").read_text().splitlines()]
    assert test_only[0] == "--test-only"  # Slurm's verdict first, then the submission
    assert sbatch[:8] == ["--nodes", "2", "--ntasks-per-node", "8", "--cpus-per-task", "11", "--gpus-per-node", "8"]
    assert "--partition" in sbatch and str(launch / "pretrain.sbatch") in sbatch
    ds_copy = sbatch[sbatch.index("--ds_config") + 1]
    assert ds_copy.startswith(str(launch)) and json.loads(open(ds_copy).read())["train_batch_size"] == 4096


@pytest.mark.parametrize("command", [["env"], ["hostfile", "{d}/hosts"], ["node", "--ranks", "1", "--", "-c", "pass"]])
def test_outside_a_slurm_job_each_command_says_so_in_one_line(tmp_path, monkeypatch, capsys, command):
    from launchers.slurm import main

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    assert main([c.format(d=tmp_path) for c in command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"launchers.slurm {command[0]} reads the variables of a Slurm job (SLURM_JOB_NODELIST is not set)" in err
    assert not list(tmp_path.iterdir())
