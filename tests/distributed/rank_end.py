"""How the rank scripts of tests/distributed end, once their records are written."""
import os
import sys

import torch.distributed as dist


def end_rank() -> None:
    """Every rank reaches the barrier, the process group ends, and the process leaves without the
    interpreter's shutdown. These scripts build dozens of DDP / FSDP2 engines in one process; what
    they check is in the records they wrote, and the order in which the shutdown then frees gloo's,
    the store's and autograd's native objects is not under test (a rank that had written its
    records has been seen to abort there with "terminate called without an active exception", both
    with its gloo process group still alive and after ending it). How a training command ends is
    train/run/cli.py's, tested through the commands themselves."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
