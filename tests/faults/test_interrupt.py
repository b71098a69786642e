"""Ctrl-C (SIGINT) and kill (SIGTERM) outside Slurm (train/run/preemption.py, train/run/early_signals.py):
the first one finishes the step, writes a checkpoint, prints one line naming it and the command
that continues it, and exits 130 / 143; the same signal again ends the run at once. Steps are
slowed (train/engine/fault_injection.py's slow_step) so that the signals land mid-run."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CPU_DS, DEBUG_PRESET, REPO

from train.run.folder import read_metrics

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))},
       "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PRETRAIN_FAULTS": "slow_step@1-100000"}
STOP_LINE = "stopped by SIG"


def options(run_dir: Path, *extra: str) -> list[str]:
    return ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(run_dir),
            "--run.progress", "false", "--optim.epochs", "1000", *extra]


def start(cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
    """In its own session, as a terminal's foreground job: os.killpg(pid, SIGINT) is a Ctrl-C."""
    return subprocess.Popen(cmd, cwd=REPO, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


# A run that must get its second Ctrl-C before the first one's step ends: 2 s slow steps, so that a
# descheduled test process on a loaded machine still sends it in time (0.3 s was not always enough).
WIDE_WINDOW = {**ENV, "PRETRAIN_SLOW_STEP_SECONDS": "2"}


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int = 1, within: float = 480) -> None:
    end = time.time() + within
    while time.time() < end and proc.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir)) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"no metrics line (exit {proc.poll()}): {proc.communicate()[1][-3000:]}")


def session_processes(sid: int) -> list[int]:
    """The live processes of a session (the job and everything it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if fields[3] == str(sid) and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


def the_stop_line(err: str) -> str:
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith(STOP_LINE)]
    return line


def checkpoint_named(line: str, run_dir: Path, world: int) -> tuple[int, Path]:
    """(the step the line names, its checkpoint), checked: complete and the latest."""
    step = int(line.split(" after step ")[1].split(":")[0])
    tag = Path(line.split(": checkpoint ")[1].split(";")[0])
    assert tag == run_dir / "checkpoints" / f"step{step:08d}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == tag.name
    assert json.loads((tag / "complete.json").read_text())["world_size"] == world
    assert max(r["step"] for r in read_metrics(run_dir)) == step  # the steps since the last ckpt_every are kept
    return step, tag



def test_ctrl_c_checkpoints_the_step_exits_130_and_the_printed_command_continues(tmp_path, rgb_shards):
    """A Ctrl-C reaches the whole foreground group, loader workers included (they ignore it)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "train.pretrain",
           *options(run_dir, "--data.source", "shards", "--data.train_index", str(rgb_shards), "--model.in_chans", "3",
                    "--data.num_workers", "2", "--run.ckpt_every", "1000", "--run.max_steps", "30")]
    proc = start(cmd)
    wait_for_steps(proc, run_dir, steps=2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    line = the_stop_line(err)
    step, _ = checkpoint_named(line, run_dir, world=1)
    assert 2 <= step < 30
    assert not session_processes(proc.pid)  # no loader worker left behind

    resume = shlex.split(line.split("; to continue: ")[1])
    assert resume[:3] == [sys.executable, "-m", "train.pretrain"] and resume[-2:] == ["--resume", "auto"]
    assert resume[3:-2] == cmd[3:]  # the same options
    done = subprocess.run(resume, cwd=REPO, env={**ENV, "PRETRAIN_FAULTS": ""}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step{step:08d} at step {step}" in done.stdout + done.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 31))


def test_kill_exits_143_with_a_checkpoint_and_a_second_ctrl_c_ends_the_run_at_once(tmp_path):
    killed = start([sys.executable, "-m", "train.pretrain", *options(tmp_path / "killed")])
    twice = start([sys.executable, "-m", "train.pretrain", *options(tmp_path / "twice")], env=WIDE_WINDOW)
    wait_for_steps(killed, tmp_path / "killed")
    killed.send_signal(signal.SIGTERM)
    wait_for_steps(twice, tmp_path / "twice")
    os.killpg(twice.pid, signal.SIGINT)
    handled(twice.pid, signal.SIGINT)  # the step it is finishing takes 2 s longer (WIDE_WINDOW)
    os.killpg(twice.pid, signal.SIGINT)
    t0 = time.time()
    _, err = twice.communicate(timeout=60)
    assert twice.returncode == -signal.SIGINT and time.time() - t0 < 1.0  # shell status 130, no wait for the step
    assert "Traceback" not in err and STOP_LINE not in err, err[-3000:]

    _, err = killed.communicate(timeout=60)
    assert killed.returncode == 143, err[-3000:]
    checkpoint_named(the_stop_line(err), tmp_path / "killed", world=1)
    assert not (tmp_path / "killed" / "encoder.safetensors").exists()  # a stopped run is continued, not exported


def test_two_ranks_under_the_deepspeed_launcher_stop_on_ctrl_c_with_one_checkpoint_and_no_process_left(tmp_path):
    """Ctrl-C reaches the `deepspeed` runner (which dies of it), its launch.py (which SIGTERMs each
    rank and SIGKILLs what is left after 30 s) and both ranks: they agree on the stop at a step,
    write one checkpoint together and end; nothing of the job is left."""
    run_dir = tmp_path / "run"
    launcher = str(Path(sys.executable).parent / "deepspeed")
    from ports import free_port

    proc = start([launcher, "--num_gpus", "2", "--master_port", str(free_port()), str(REPO / "train" / "pretrain.py"),
                  *options(run_dir, "--run.stop_check_every", "1")])
    wait_for_steps(proc, run_dir)
    os.killpg(proc.pid, signal.SIGINT)
    t0 = time.time()
    out, err = proc.communicate(timeout=60)  # EOF once every process holding the pipes has ended
    assert time.time() - t0 < 25, "the launcher's 30 s SIGKILL ended it, not the ranks"
    # deepspeed's runner either dies of the Ctrl-C or, when its launch.py (which exits 1 on SIGINT)
    # ends before the runner's interpreter runs its own pending SIGINT, exits 1 with that status
    assert proc.returncode in (-signal.SIGINT, 1), err[-3000:]
    end = time.time() + 10
    while session_processes(proc.pid) and time.time() < end:
        time.sleep(0.1)
    assert not session_processes(proc.pid)
    [line] = [x for x in (out + err).splitlines() if x.startswith(STOP_LINE)]  # rank 0's
    assert line.startswith("stopped by SIGINT") and line.endswith("run the same command again with --resume auto "
                                                                  "(without --run.overwrite)")
    checkpoint_named(line, run_dir, world=2)
    assert "Traceback" not in out + err.split("KeyboardInterrupt")[-1]  # none from the ranks (the runner's is deepspeed's)


def test_under_a_deepspeed_command_that_ignores_ctrl_c_the_launcher_ends_with_1_after_the_checkpoint(tmp_path):
    """A `deepspeed ... &` in a script ignores SIGINT (a non-interactive shell's background job):
    Ctrl-C then reaches only DeepSpeed's per-node launcher (launch.py) and the ranks. The ranks stop
    at a common step and write the checkpoint as above; the launcher, once they have ended, exits
    with 1 whatever their status (its own rule), and the `deepspeed` command passes that on.
    docs/RELIABILITY.md says so."""
    run_dir = tmp_path / "run"
    launcher = str(Path(sys.executable).parent / "deepspeed")
    from ports import free_port

    proc = start([launcher, "--num_gpus", "2", "--master_port", str(free_port()), str(REPO / "train" / "pretrain.py"),
                  *options(run_dir, "--run.stop_check_every", "1")],
                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    wait_for_steps(proc, run_dir)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    [line] = [x for x in (out + err).splitlines() if x.startswith(STOP_LINE)]
    checkpoint_named(line, run_dir, world=2)
    reliability = (REPO / "docs" / "RELIABILITY.md").read_text()
    assert "ends with 1" in reliability and "130" in reliability


def catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for sig (/proc/PID/status SigCgt)."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigCgt")).split()[1], 16)
    return bool(mask >> (sig - 1) & 1)


def handled(pid: int, sig: int, within: float = 60) -> None:
    """Wait until the run's handler has taken the first `sig`: it then gives the signal back its
    default action (train/run/early_signals.py abort_on_repeat), so the handler is gone from SigCgt.
    A fixed sleep raced on a loaded machine: two signals pending before the handler ran count as one."""
    end = time.time() + within
    while catches(pid, sig):
        assert time.time() < end, f"{within} s after the signal, process {pid} still has its handler"
        time.sleep(0.01)


def test_ctrl_c_during_start_up_ends_the_run_at_once_without_a_traceback(tmp_path):
    """Before the first step there is nothing to save: the default action, no KeyboardInterrupt."""
    proc = start([sys.executable, "-m", "train.pretrain", *options(tmp_path / "run")])
    end = time.time() + 10  # train/pretrain.py's first lines ran: SIGUSR1 caught, SIGINT left to its default
    while time.time() < end and not (catches(proc.pid, signal.SIGUSR1) and not catches(proc.pid, signal.SIGINT)):
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)  # long before the engine exists
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT and "Traceback" not in err, err[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def recipe_options(entry: str, run_dir: Path, tmp_path: Path) -> list[str]:
    """finetune / linprobe on the debug preset's synthetic images, from random init (the control):
    the stop does not depend on where the encoder came from. LARS needs a ZeRO stage-0 engine."""
    opts = options(run_dir, f"--{entry}.num_classes", "10")
    if entry == "linprobe":
        ds = tmp_path / "stage0.json"
        ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                                  "gradient_clipping": 0.0, "zero_optimization": {"stage": 0}}))
        opts[opts.index("--ds_config") + 1] = str(ds)
    return opts


@pytest.mark.parametrize("entry", ["finetune", "linprobe"])
def test_ctrl_c_during_start_up_of_finetune_and_linprobe_ends_them_at_once_without_a_traceback(tmp_path, entry):
    """Their first lines are pretrain's: before the heavy imports SIGUSR1 is caught and SIGINT left
    to its default action, so a Ctrl-C during start-up is no KeyboardInterrupt traceback."""
    proc = start([sys.executable, "-m", f"train.{entry}", *recipe_options(entry, tmp_path / "run", tmp_path)])
    end = time.time() + 10
    while time.time() < end and not (catches(proc.pid, signal.SIGUSR1) and not catches(proc.pid, signal.SIGINT)):
        time.sleep(0.01)
    ready = catches(proc.pid, signal.SIGUSR1) and not catches(proc.pid, signal.SIGINT)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert ready, (f"10 s after train.{entry} started, SIGUSR1 is not caught or SIGINT still is (a Ctrl-C during its "
                   f"imports raises KeyboardInterrupt with a traceback): {err[-2000:]}")
    assert proc.returncode == -signal.SIGINT and "Traceback" not in err, err[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_finetune_and_linprobe_stop_on_ctrl_c_and_kill_like_pretrain(tmp_path):
    """Mid-run: a Ctrl-C (finetune) or kill (linprobe) checkpoints the step, prints the one line
    with the entry point's own resume command and exits 130 / 143; a second Ctrl-C (finetune
    again) ends it at once."""
    entries = {"finetune": "finetune", "linprobe": "linprobe", "twice": "finetune"}  # run name -> entry point
    runs = {name: tmp_path / name for name in entries}
    procs = {name: start([sys.executable, "-m", f"train.{entry}", *recipe_options(entry, runs[name], tmp_path)],
                         **({"env": WIDE_WINDOW} if name == "twice" else {}))
             for name, entry in entries.items()}
    wait_for_steps(procs["finetune"], runs["finetune"], steps=2)
    os.killpg(procs["finetune"].pid, signal.SIGINT)
    wait_for_steps(procs["linprobe"], runs["linprobe"], steps=2)
    procs["linprobe"].send_signal(signal.SIGTERM)
    wait_for_steps(procs["twice"], runs["twice"])
    os.killpg(procs["twice"].pid, signal.SIGINT)
    handled(procs["twice"].pid, signal.SIGINT)  # the step it is finishing takes 2 s longer (WIDE_WINDOW)
    os.killpg(procs["twice"].pid, signal.SIGINT)
    t0 = time.time()
    _, err = procs["twice"].communicate(timeout=60)
    assert procs["twice"].returncode == -signal.SIGINT and time.time() - t0 < 1.0, err[-3000:]
    assert "Traceback" not in err and STOP_LINE not in err, err[-3000:]

    for name, status in (("finetune", 130), ("linprobe", 143)):
        _, err = procs[name].communicate(timeout=60)
        assert procs[name].returncode == status, err[-3000:]
        line = the_stop_line(err)
        assert line.startswith(f"stopped by {'SIGINT' if status == 130 else 'SIGTERM'}")
        step, _ = checkpoint_named(line, runs[name], world=1)
        assert step >= 2
        resume = shlex.split(line.split("; to continue: ")[1])
        assert resume[:3] == [sys.executable, "-m", f"train.{name}"] and resume[-2:] == ["--resume", "auto"]
        assert not session_processes(procs[name].pid)
