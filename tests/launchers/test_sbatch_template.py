"""launchers/pretrain.sbatch run by bash with a faked srun: which code it runs, the step it asks
for in node mode, and a USR1 sent to the batch shell (what a real cluster does)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import CPU_DS, DEBUG_PRESET, REPO

from launchers.submit import job_script, snapshot

FAKE_SRUN = """#!{python}
# records its arguments and exits FAKE_SRUN_EXIT (0); FAKE_SRUN=run: runs the program after the srun
# options (one task); FAKE_SRUN=wait: waits for a signal, records it, exits 0
import json, os, signal, subprocess, sys, time
log = os.environ["FAKE_SRUN_LOG"]
with open(log, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
mode = os.environ.get("FAKE_SRUN", "log")
if mode == "run":
    program = sys.argv[1:]
    while program and program[0].startswith("-"):
        program = program[1:]
    sys.exit(subprocess.run(program).returncode)
if mode == "wait":
    def record(signum, frame):
        with open(log, "a") as f:
            f.write(json.dumps(["signal", signum]) + "\\n")
        sys.exit(0)
    signal.signal(signal.SIGUSR1, record)
    time.sleep(60)
    sys.exit(1)
sys.exit(int(os.environ.get("FAKE_SRUN_EXIT", "0")))
"""


def template_env(tmp_path, **extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "srun").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    return {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SRUN_LOG": str(tmp_path / "srun.log"),
            "PYTHON": sys.executable, "SLURM_JOB_ID": "31", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_SUBMIT_DIR": str(REPO),
            "PYTHONWARNINGS": "ignore", **extra}


def srun_calls(tmp_path) -> list[list]:
    return [json.loads(line) for line in (tmp_path / "srun.log").read_text().splitlines()]


NODE_MODE = {"LAUNCH_MODE": "node", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NTASKS": "16",
             "SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_CPUS_ON_NODE": "80", "SLURM_CPUS_PER_TASK": "10"}


def test_node_mode_by_hand_asks_for_one_task_per_node(tmp_path):
    """`sbatch --nodes 2 pretrain.sbatch` (8 tasks per node from its #SBATCH line) with
    LAUNCH_MODE=node: one launcher per node, each starting the node's 8 ranks on all its CPUs."""
    env = template_env(tmp_path, **NODE_MODE)
    proc = subprocess.run(["bash", str(REPO / "launchers" / "pretrain.sbatch"), "--output_dir", "/x"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [args] = srun_calls(tmp_path)
    opts = args[:args.index(sys.executable)]
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=80"} <= set(opts), opts
    launcher = args[args.index(sys.executable):]
    assert launcher[launcher.index("--ranks") + 1] == "8"


def test_task_mode_gives_each_rank_the_job_s_cpus_per_task(tmp_path):
    """srun of Slurm 22.05 to 23.02 reads no SLURM_CPUS_PER_TASK: without the option each rank
    was bound to one CPU and the loader's automatic worker count fell to 0."""
    env = template_env(tmp_path, LAUNCH_MODE="task", SLURM_CPUS_PER_TASK="10")
    proc = subprocess.run(["bash", str(REPO / "launchers" / "pretrain.sbatch"), "--output_dir", "/x"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [args] = srun_calls(tmp_path)
    opts = args[:args.index(sys.executable)]
    assert "--cpus-per-task=10" in opts, opts

    (tmp_path / "srun.log").unlink()  # a job without --cpus-per-task: srun keeps Slurm's default
    del env["SLURM_CPUS_PER_TASK"]
    proc = subprocess.run(["bash", str(REPO / "launchers" / "pretrain.sbatch"), "--output_dir", "/x"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [args] = srun_calls(tmp_path)
    assert not [a for a in args[:args.index(sys.executable)] if a.startswith("--cpus-per-task")], args


@pytest.mark.parametrize("mode", ["task", "node"])
def test_every_mode_resumes_and_ends_the_step_when_a_task_fails(tmp_path, mode):
    """--resume auto: a requeued job continues from its checkpoint instead of starting over;
    --kill-on-bad-exit: a failed rank ends the step instead of leaving the others in a collective."""
    env = template_env(tmp_path, **(NODE_MODE if mode == "node" else {"LAUNCH_MODE": "task"}))
    proc = subprocess.run(["bash", str(REPO / "launchers" / "pretrain.sbatch"), "--output_dir", "/x"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [args] = srun_calls(tmp_path)
    opts, program = args[:args.index(sys.executable)], args[args.index(sys.executable):]
    assert "--kill-on-bad-exit=1" in opts, opts
    pretrain = program[program.index("train.pretrain") + 1:]
    assert pretrain[pretrain.index("--resume") + 1] == "auto" and pretrain[-2:] == ["--output_dir", "/x"], program


def test_the_job_exits_with_the_step_s_exit_code(tmp_path):
    """A configuration error (exit 2) in the ranks: the job ends FAILED, not COMPLETED."""
    proc = subprocess.run(["bash", str(REPO / "launchers" / "pretrain.sbatch"), "--output_dir", "/x"],
                          env=template_env(tmp_path, FAKE_SRUN_EXIT="2"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr


def sbatch_directives(script: str) -> list[str]:
    """The #SBATCH options sbatch reads: those before the script's first command."""
    options = []
    for line in script.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            options += line.split()[1:]
        elif line.strip() and not line.startswith("#"):
            break
    return options


def test_the_submitted_script_asks_for_the_warning_signal_and_a_requeue():
    """Without --signal=USR1@180 Slurm kills the job at its time limit without a checkpoint."""
    for script in ((REPO / "launchers" / "pretrain.sbatch").read_text(), job_script()):
        assert {"--signal=USR1@180", "--requeue"} <= set(sbatch_directives(script))


def test_a_usr1_to_the_batch_shell_reaches_the_step(tmp_path):
    """`scancel --batch --signal=USR1`: the shell traps it and passes it on to srun (which forwards
    it to the ranks) instead of dying of it (the job ended FAILED 0:10, not requeued)."""
    env = template_env(tmp_path, FAKE_SRUN="wait")
    shell = subprocess.Popen(["bash", str(REPO / "launchers" / "pretrain.sbatch"), "--output_dir", "/x"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    end = time.time() + 30
    while not (tmp_path / "srun.log").exists() and time.time() < end:
        time.sleep(0.05)
    time.sleep(0.5)  # the fake srun installs its handler
    shell.send_signal(signal.SIGUSR1)
    out, _ = shell.communicate(timeout=60)
    assert shell.returncode == 0, out
    assert srun_calls(tmp_path)[-1] == ["signal", signal.SIGUSR1]


def test_the_job_runs_the_snapshot_and_records_it(tmp_path):
    """The template runs the code in $VITPRETRAIN_CODE, not the installed checkout, and the run
    folder says which code ran (a one-step run on one CPU rank)."""
    from train.run.code_version import source_hash

    code = tmp_path / "launch" / "code"
    code.mkdir(parents=True)
    snapshot(code)
    with open(code / "train" / "config" / "options.py", "a") as f:  # an import the checkout would not print
        f.write("\nprint('config imported from the snapshot')\n")
    env = template_env(tmp_path, FAKE_SRUN="run", VITPRETRAIN_CODE=str(code), SLURM_JOB_NUM_NODES="1",
                       OMP_NUM_THREADS="1")
    run_dir = tmp_path / "run"
    proc = subprocess.run(["bash", str(code / "launchers" / "pretrain.sbatch"), "--ds_config", str(CPU_DS),
                           "--config", str(DEBUG_PRESET), "--output_dir", str(run_dir), "--run.progress", "false",
                           "--run.max_steps", "1", "--run.export", "false"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "config imported from the snapshot" in proc.stdout
    ran = json.loads((run_dir / "meta.json").read_text())["code"]
    assert ran["path"] == str(code) and ran["source_sha256"] == source_hash(code) != source_hash(REPO)
    assert ran["git_commit"] is None  # a snapshot, not a checkout


def test_a_machine_without_git_describes_the_code_by_its_hash(monkeypatch, tmp_path):
    """Every start failed on a machine without git (a minimal container): `config error: [Errno 2]
    No such file or directory: 'git'`."""
    import subprocess

    from train.run import code_version

    def no_git(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "git")

    monkeypatch.setattr(subprocess, "run", no_git)
    described = code_version.describe()
    assert described["git_commit"] is None and described["source_sha256"] == code_version.source_hash(code_version.ROOT)
