"""The suite's own helpers for multi-process tests (tests/conftest.py run_ranks, tests/ports.py):
a failing rank ends the others at once with every rank's output, rather than leaving them waiting
for it until the timeout; ports for rank 0 come from outside the kernel's ephemeral range."""
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, run_ranks

import ports

RANK_SCRIPT = """import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} at port {os.environ['MASTER_PORT']}", flush=True)
if rank == int(sys.argv[1]):
    sys.exit(3)
time.sleep(float(sys.argv[2]))
if len(sys.argv) > 3:  # a folder: each rank that got this far says who it was
    open(os.path.join(sys.argv[3], f"rank{rank}"), "w").write(os.environ["WORLD_SIZE"])
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(RANK_SCRIPT)
    return path


def test_a_failing_rank_ends_the_others_and_shows_every_ranks_output(script):
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_ranks(2, script, "1", "300", timeout=120)
    assert time.monotonic() - start < 60  # not the waiting rank's 300 s, nor the timeout
    message = str(failure.value)
    assert "rank 0: killed; rank 1: exit 3" in message
    assert "rank 0 of 2 at port" in message and "rank 1 of 2 at port" in message


def test_ranks_past_the_timeout_are_killed_and_reported(script):
    with pytest.raises(AssertionError, match=r"rank 0: killed; rank 1: killed \(timeout 2 s"):
        run_ranks(2, script, "-1", "300", timeout=2)


def test_ranks_that_all_exit_0_pass_and_each_ran_with_its_rank(script, tmp_path):
    said = tmp_path / "said"
    said.mkdir()
    run_ranks(3, script, "-1", "0", str(said))
    assert {p.name: p.read_text() for p in said.iterdir()} == {"rank0": "3", "rank1": "3", "rank2": "3"}


def test_ports_lie_below_the_ephemeral_range_each_free_and_distinct():
    chosen = ports.free_ports(3) + [ports.free_port() for _ in range(3)]
    assert len(set(chosen)) == len(chosen)
    if ports._band().stop <= ports._ephemeral_start():
        assert all(p in ports._band() for p in chosen) and max(chosen) < ports._ephemeral_start()
    for port in chosen:
        with socket.socket() as s:
            s.bind(("", port))


def test_a_port_in_use_is_passed_over():
    taken = ports.free_port()
    with socket.socket() as holder:
        holder.bind(("", taken))
        holder.listen()
        band = ports._band()
        chosen = [ports.free_port() for _ in range(len(band))]  # once round the band
    assert taken not in chosen


SURROGATE_LOG_TEST = '''
import logging

def test_names_a_hostile_file():
    logging.getLogger("x").warning("passed over step1: /run/\\ud800.tar is missing")
'''


@pytest.mark.parametrize("with_hook", [True, False], ids=["with the hook", "without it"])
def test_a_captured_lone_surrogate_reaches_xdist_s_controller_escaped(tmp_path, with_hook):
    """tests/report_text.py: a passing test whose captured log holds a lone surrogate; under xdist
    the run passes with the hook, and without it ends in the INTERNALERROR the hook prevents."""
    (tmp_path / "test_hostile.py").write_text(SURROGATE_LOG_TEST)
    tests = str(REPO / "tests")
    hook = f"import sys\nsys.path.insert(0, {tests!r})\nfrom report_text import pytest_runtest_makereport\n"
    (tmp_path / "conftest.py").write_text(hook if with_hook else "")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", "--rootdir",
                           str(tmp_path), "-c", os.devnull, str(tmp_path / "test_hostile.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    if with_hook:
        assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    else:
        assert "INTERNALERROR" in proc.stdout + proc.stderr and "1 passed" not in proc.stdout, proc.stdout[-3000:]
