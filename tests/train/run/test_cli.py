"""train/run/cli.py: an entry point that ended well ends its process group before the interpreter's
shutdown; one that failed leaves it (its other ranks may still be inside a collective), and a
command run as a script then ends without the interpreter's teardown, with its own status."""
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from train.config.errors import ConfigError
from train.engine import distributed
from train.run.cli import cli


@pytest.fixture
def one_rank_group(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # records the variable's state, restored afterwards: init() sets it
        monkeypatch.delenv(name)
    distributed.init()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_run_that_ended_well_ends_its_process_group(one_rank_group):
    ran = []
    cli(lambda: ran.append(dist.is_initialized()))
    assert ran == [True]
    assert not dist.is_initialized()


def test_a_failed_run_leaves_its_process_group(one_rank_group):
    def fails():
        raise ConfigError("--model.name: no such model")

    with pytest.raises(SystemExit) as e:
        cli(fails)
    assert e.value.code == 2
    assert dist.is_initialized()


@pytest.mark.parametrize("command", ["train/pretrain.py", "train/finetune.py"])
def test_help_into_a_closed_pipe_ends_quietly(command):
    """`--help | true`: the reader is gone before the help is written (as `| head -1` once the help
    outgrows the pipe's buffer); that was a BrokenPipeError traceback."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run(f"{sys.executable} {command} --help | true", shell=True, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.stderr == "", proc.stderr[-2000:]


# A command run as a script (train/pretrain.py's shape) whose run starts a process group, writes to
# standard output without a newline, then ends as argv[1] says. An object of __main__ reports the
# interpreter's teardown from its finalizer; an atexit handler reports that Python's exit ran.
SCRIPT = r"""
import atexit, os, sys
from train.run.cli import run_script

class Teardown:
    def __del__(self, write=os.write):
        write(2, b"interpreter teardown\n")

witness = Teardown()
atexit.register(lambda: print("atexit handlers ran", file=sys.stderr))

def main():
    from train.engine import distributed
    distributed.init()
    sys.stdout.write("written, not yet flushed")
    if sys.argv[1] == "config":
        from train.config.errors import ConfigError
        raise ConfigError("--run.max_steps must be positive")
    if sys.argv[1] == "bug":
        raise ValueError("an unforeseen bug")
    if sys.argv[1] == "message":
        sys.exit("stopped with a message")

run_script(main)
"""


def run_as_a_script(how: str) -> subprocess.CompletedProcess:
    """SCRIPT in a process of its own, a plain run (no launcher's rank variables)."""
    from conftest import PROCESS_GROUP_ENV, REPO

    env = {k: v for k, v in os.environ.items() if k not in PROCESS_GROUP_ENV}
    return subprocess.run([sys.executable, "-c", SCRIPT, how], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("how, status, says", [
    ("config", 2, "config error: --run.max_steps must be positive"),
    ("bug", 1, "ValueError: an unforeseen bug"),
    ("message", 1, "stopped with a message"),
])
def test_a_failed_script_with_its_group_alive_ends_with_its_status_before_the_teardown(how, status, says):
    """The teardown of a live gloo process group can abort the process (SIGABRT: a launcher then
    reports 250 where the run said 3); a failed run skips it, after its message, the flush of its
    output and the atexit handlers (the loader's workers, logging)."""
    proc = run_as_a_script(how)
    assert proc.returncode == status, proc.stderr[-3000:]
    assert says in proc.stderr and "atexit handlers ran" in proc.stderr, proc.stderr[-3000:]
    assert ("Traceback" in proc.stderr) == (how == "bug")
    assert "interpreter teardown" not in proc.stderr
    assert proc.stdout == "written, not yet flushed"


def test_a_script_that_ended_well_ends_through_the_interpreter():
    """The witness of the test above: a run that ended well ended its group, and the interpreter's
    teardown runs (its finalizers print)."""
    proc = run_as_a_script("well")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "atexit handlers ran" in proc.stderr and "interpreter teardown" in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout == "written, not yet flushed"


def test_a_script_that_ended_well_on_two_ranks_leaves_before_the_teardown():
    """What gloo leaves behind a group that ended well (its work objects, threads) has aborted a
    rank in the interpreter's teardown once (SIGABRT, the launcher's 250): on several ranks a run
    that ended well leaves after its output's flush and the atexit handlers, as a failed one does."""
    from conftest import REPO
    from ports import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    env |= {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, "well"], cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    for out, err in outputs:
        assert out == "written, not yet flushed" and "atexit handlers ran" in err, err[-3000:]
        assert "interpreter teardown" not in err, err[-3000:]


# Two ranks of one gloo group: rank 1 meets a configuration error while rank 0 waits for it in a
# collective, which then fails because rank 1's process ended. Each rank's last atexit handler
# (run just before the process ends) prints when it ran.
TWO_RANKS = r"""
import atexit, sys, time
from train.run.cli import run_script

atexit.register(lambda: print(f"ended at {time.monotonic()}", file=sys.stderr))

def main():
    import torch.distributed as dist
    from train.engine import distributed
    distributed.init()
    if dist.get_rank() == 1:
        time.sleep(1.0)  # rank 0 is inside the barrier by then
        from train.config.errors import ConfigError
        raise ConfigError("--data.train_index: no such file")
    dist.barrier()

run_script(main)
"""


def test_a_rank_that_lost_its_peer_ends_after_the_launchers_next_look():
    """The deepspeed launcher looks at its ranks once a second and reports the first failed one it
    meets, in no set order when both have ended by then: a run stopped by a configuration error on
    rank 1 was once reported as exit 1, rank 0's. Rank 0 now ends more than a look later."""
    from conftest import REPO
    from ports import free_port

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS], cwd=REPO, text=True, stderr=subprocess.PIPE,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [1, 2], errors
    assert "config error: --data.train_index: no such file" in errors[1]
    said, ended = errors[0].strip().splitlines()
    assert said == "rank 0 stopped: another rank ended the run and its connection closed (that rank's message says why)"
    ended_at = [float(e.strip().splitlines()[-1].removeprefix("ended at ")) for e in (ended, errors[1])]
    assert ended_at[0] - ended_at[1] > 2.0, errors
