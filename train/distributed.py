"""Process-group set-up shared by the deepspeed launcher, Slurm (launchers/slurm.py) and plain
single-process runs."""
from __future__ import annotations

import glob
import os
import socket

import torch

from train import slurm_env

if not torch.cuda.is_available():
    # DeepSpeed otherwise probes for accelerators and warns; say CPU outright.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def world_size_from_env() -> int:
    """Known before the process group exists: WORLD_SIZE (deepspeed / torchrun / our node
    launcher), else the task count of a one-task-per-GPU Slurm step (train/slurm_env.py)."""
    if "WORLD_SIZE" not in os.environ and slurm_env.in_task_step(os.environ):
        return int(slurm_env.task_env(os.environ)["WORLD_SIZE"])
    return int(os.environ.get("WORLD_SIZE", "1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init() -> tuple[int, int, torch.device]:
    """Start the process group; a plain `python` run becomes rank 0 of a world of 1.

    Returns (rank, world_size, device).
    """
    import deepspeed

    if "RANK" not in os.environ and slurm_env.in_task_step(os.environ):  # srun: one task per GPU
        os.environ.update(slurm_env.task_env(os.environ))  # DeepSpeed's init does not read SLURM_*
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    rank = torch.distributed.get_rank()
    release_shm_names(rank)
    return rank, torch.distributed.get_world_size(), device


def release_shm_names(rank: int) -> None:
    """DeepSpeed's CPU all-reduce maps a 69 MB /dev/shm buffer per rank and never unlinks it, so
    every CPU run leaks them until the machine runs out of memory. Once every rank has mapped
    every peer's buffer (init_distributed returns only then; the barrier makes it true for all),
    the names can go: the mappings stay valid until the processes exit, also after a crash."""
    torch.distributed.barrier()
    port = os.environ.get("MASTER_PORT", "")
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_{rank}"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def all_gather_object(obj):
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out
