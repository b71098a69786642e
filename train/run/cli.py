"""What the command-line entry points share: their exit statuses and the extraction of an entry
point's own flags (--dry-run, --world_size, --loader_only, ...) from the run options."""
from __future__ import annotations

import errno
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from data.cli import InputError, one_line
from data.faults import CorruptDataError, ShardIndexError
from train.config.errors import ConfigError
from train.engine.errors import CheckpointWriteError, NonFiniteError
from train.run import early_signals
from train.run.preemption import Interrupted

# A training run stopped by corrupt data writes no checkpoint then (a collective other ranks may not reach)
KEPT_AFTER_CORRUPT_DATA = ("A training run keeps its last complete checkpoint, if any: once the shards are fixed, run "
                           "the same command again with --resume auto.")


def cli(main_fn) -> int:
    """Run an entry point; returns the size of the process group it ended (0 if none). A
    configuration problem exits with status 2 and a one-line message; a run stopped by what it
    detected (diverged: train/engine/nonfinite.py; too much corrupt data: data/faults.py; a
    checkpoint that could not be written: train/engine/checkpoint.py) with status 3, its last
    checkpoint kept; a run stopped by Ctrl-C or kill outside Slurm (train/run/preemption.py) with
    130 / 143 and one line naming its checkpoint and how to resume. On several ranks, a rank whose
    collective fails because another rank ended first says so in one line and exits 1 (`PeerGone`):
    the first rank's status and message are the run's (the launchers report the first failure, srun
    the highest)."""
    try:
        main_fn()
        return end_process_group()
    except Interrupted as e:
        if e.message:  # rank 0's
            print(e.message, file=sys.stderr)
        raise SystemExit(e.status) from None
    except (ConfigError, InputError, FileNotFoundError, NotADirectoryError, ShardIndexError) as e:
        print(f"config error: {one_line(str(e))}", file=sys.stderr)
        raise SystemExit(2) from None
    except (NonFiniteError, CheckpointWriteError) as e:  # its message says what is kept and how to continue
        print(f"training stopped: {e}", file=sys.stderr)
        raise SystemExit(3) from None
    except BrokenPipeError:  # the reader of standard output went away (`--help | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush of stdout must not fail again
        raise SystemExit(1) from None
    except OSError as e:
        if e.errno not in WRITE_FAILURES:
            raise
        print(f"stopped: {write_failure(e)}", file=sys.stderr)
        raise SystemExit(3) from None
    except CorruptDataError as e:  # a data/ message: it knows shards, not checkpoints
        print(f"training stopped: {e}\n{KEPT_AFTER_CORRUPT_DATA}", file=sys.stderr)
        raise SystemExit(3) from None
    except RuntimeError as e:
        rank = peer_lost(e)
        if rank is None:
            raise
        # the rank that ended first (its data, a kill) said why; this one only lost it mid-collective
        print(f"rank {rank} stopped: another rank ended the run and its connection closed (that rank's message "
              f"says why)", file=sys.stderr)
        raise PeerGone(1) from None


class PeerGone(SystemExit):
    """Exit 1 of a rank whose collective failed because another rank's process had ended."""


# The deepspeed launcher polls its ranks once a second (launchers/slurm.py's node mode waits up to a
# second on each in turn) and reports the first failed one it meets, in no set order when two have
# ended since its last look: a rank that only lost its peer (which sees that within milliseconds)
# ends this much later, so the rank that failed first is the one reported
PEER_GONE_GRACE_S = 3.0


# A file system that takes no more writes: the command stops with one line (checkpoint saves say their own)
WRITE_FAILURES = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def write_failure(e: OSError) -> str:
    """One line on a write the file system refused: the file, the reason, the room left, the way on."""
    target = Path(e.filename) if isinstance(e.filename, str) else None
    room = ""
    if target is not None:
        existing = next((p for p in (target, *target.parents) if p.exists()), None)
        if existing is not None:
            room = f"; {shutil.disk_usage(existing).free / 2**20:.1f} MiB free there"
    return (f"could not write {target or 'a file'} ({e.strerror}{room}): make room (or mend the file system) and run "
            f"the same command again; a training run continues from its last complete checkpoint with --resume auto")


# What a collective raises on a rank whose peer process has gone (gloo's TCP pairs; NCCL's abort)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")


def peer_lost(e: RuntimeError) -> int | None:
    """This rank's number when `e` is a collective failing because another rank's process ended
    (in a process group of several ranks), else None."""
    import torch.distributed as dist

    if not (group_alive() and dist.get_world_size() > 1):
        return None
    gone = isinstance(e, dist.DistNetworkError) or any(s in str(e) for s in PEER_GONE)
    return dist.get_rank() if gone else None


def end_process_group() -> int:
    """After a run that ended well on every rank: the process group ends here, while the
    interpreter is whole, rather than in its shutdown (where NCCL warns that nothing ended it, and
    the backends' threads are torn down in whatever order the interpreter frees them); its size, 0
    when there was none. A failed run skips this: a rank that raised must not wait in a collective
    for ranks still training."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    ranks = dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    return ranks


def run_script(main_fn) -> None:
    """`cli(main_fn)` for a training command run as a script, whose first line was
    `early_signals.at_script_start()`: ending with its own status, the process then ignores Slurm's
    stop signals, so a SIGTERM during Python's shutdown (srun --kill-on-bad-exit, after another rank
    failed) cannot turn exit 2 into 143. A run that fails with its process group still alive
    (`end_process_group` is for runs that ended well), and one that ended well on several ranks,
    leave through `leave_before_teardown`."""
    try:
        ranks = cli(main_fn)
    except (SystemExit, Exception) as e:
        early_signals.ignore_stop_signals()
        status = exit_status(e)
        if isinstance(e, PeerGone):
            # Slurm's SIGTERM (srun --kill-on-bad-exit) is ignored by now: the status stays 1; outside
            # Slurm the launcher's SIGTERM ends the wait, once it holds the first rank's status
            time.sleep(PEER_GONE_GRACE_S)
        if status != 0 and group_alive():
            print_as_the_interpreter(e)
            leave_before_teardown(status)
        raise
    finally:
        early_signals.ignore_stop_signals()
    if ranks > 1:  # what gloo leaves behind its ended group (work objects, threads) can abort the teardown too
        leave_before_teardown(0)


def exit_status(e: SystemExit | Exception) -> int:
    """The status the interpreter ends with once `e` has left the script."""
    if isinstance(e, SystemExit) and (e.code is None or isinstance(e.code, int)):
        return e.code or 0
    return 1  # an exception, or sys.exit("message")


def print_as_the_interpreter(e: SystemExit | Exception) -> None:
    """What the interpreter writes for `e` leaving the script: an exception's traceback, the
    message of sys.exit("message"), nothing for an exit status."""
    if not isinstance(e, SystemExit):
        traceback.print_exception(e)
    elif e.code is not None and not isinstance(e.code, int):
        print(e.code, file=sys.stderr)


def group_alive() -> bool:
    """Whether this process is in a process group that nothing has ended (a failed run's)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def leave_before_teardown(status: int) -> None:
    """End the process now with `status`, after what Python's exit does for the program (standard
    output and error flushed, atexit: the loader's worker processes, logging's handlers), without
    the interpreter's teardown of native objects. There, a live gloo process group's threads and
    the store have been seen to abort the process ("terminate called without an active exception"):
    a rank that reported exit 3 then ended with SIGABRT, and the launcher reported 250; so was, once
    in a loaded suite, a rank of a 2-rank run that had ended well and destroyed its group. Threads
    still running (one blocked in a collective for a peer that ended) are not waited for."""
    import atexit

    flush_standard_streams()
    atexit._run_exitfuncs()
    flush_standard_streams()
    os._exit(status)


def flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a closed stream: nothing more to write
            pass
