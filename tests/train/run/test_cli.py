"""train/run/cli.py: an entry point that ended well ends its process group before the interpreter's
shutdown; one that failed leaves it (its other ranks may still be inside a collective)."""
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
