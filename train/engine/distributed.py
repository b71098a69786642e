"""Process-group set-up shared by the deepspeed launcher (and torchrun, mpirun), Slurm
(launchers/slurm.py) and plain single-process runs."""
from __future__ import annotations

import os

import torch

from train.engine import slurm_env

if not torch.cuda.is_available():
    # DeepSpeed (its launcher, its config classes) otherwise probes for accelerators and warns: say CPU outright
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


# mpirun (DeepSpeed's openmpi / mvapich launchers) says who is who in its own variables
MPI_ENV = {"RANK": "OMPI_COMM_WORLD_RANK", "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
           "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK"}


def world_size_from_env() -> int:
    """Known before the process group exists: WORLD_SIZE (deepspeed / torchrun / our node
    launcher), else the task count of a one-task-per-GPU Slurm step (train/engine/slurm_env.py),
    else mpirun's (MPI_ENV), as `init` reads them."""
    if "WORLD_SIZE" not in os.environ and slurm_env.in_task_step(os.environ):
        return int(slurm_env.task_env(os.environ)["WORLD_SIZE"])
    if "WORLD_SIZE" not in os.environ and MPI_ENV["WORLD_SIZE"] in os.environ:
        return int(os.environ[MPI_ENV["WORLD_SIZE"]])
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    """This process's global rank before the process group exists, read as `world_size_from_env`
    reads the world size (0 for a plain single-process run)."""
    if "RANK" not in os.environ and slurm_env.in_task_step(os.environ):
        return int(slurm_env.task_env(os.environ)["RANK"])
    if "RANK" not in os.environ and MPI_ENV["RANK"] in os.environ:
        return int(os.environ[MPI_ENV["RANK"]])
    return int(os.environ.get("RANK", "0"))


def cuda_device_index(local_rank: int) -> int:
    """The CUDA ordinal this rank trains on: cuda:LOCAL_RANK when the task sees all of its node's
    GPUs, cuda:0 when the cluster binds one GPU per task (CUDA_VISIBLE_DEVICES set per task, so
    every rank sees a single device, whatever its LOCAL_RANK)."""
    visible = torch.cuda.device_count()
    if visible == 1:
        return 0
    if local_rank < visible:
        return local_rank
    from train.config.errors import ConfigError

    raise ConfigError(f"LOCAL_RANK {local_rank} has no GPU of its own: this task sees {visible} GPUs "
                      f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<not set>')}); start at most "
                      f"{visible} ranks per node, or let each task see all its node's GPUs or exactly one "
                      f"(srun --gpus-per-task=1)")


def init() -> tuple[int, int, torch.device]:
    """Start the process group (NCCL on GPUs, gloo on CPU); a plain `python` run becomes rank 0 of
    a world of 1. Returns (rank, world_size, device)."""
    if "RANK" not in os.environ and slurm_env.in_task_step(os.environ):  # srun: one task per GPU
        os.environ.update(slurm_env.task_env(os.environ))
    if "RANK" not in os.environ and MPI_ENV["RANK"] in os.environ:
        if "MASTER_ADDR" not in os.environ:  # DeepSpeed's openmpi launcher exports none
            from train.config.errors import ConfigError

            raise ConfigError("mpirun started this rank without MASTER_ADDR / MASTER_PORT, where rank 0 listens: "
                              "put MASTER_ADDR=<first host> and MASTER_PORT=<free port> in .deepspeed_env (DeepSpeed "
                              "passes it on), or launch with deepspeed's default pdsh launcher, torchrun or Slurm")
        os.environ.update({k: os.environ[v] for k, v in MPI_ENV.items() if v in os.environ})
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        index = cuda_device_index(local_rank)
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    if not torch.distributed.is_initialized():
        backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)
        if os.environ.get("WORLD_SIZE") == "1":
            # a world of one: its store lives in this process and binds no port, so runs side by side
            # on one machine (or under an exported MASTER_PORT another run holds) cannot collide
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1,
                                                 device_id=device_id)
        else:
            torch.distributed.init_process_group(backend, device_id=device_id)
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def all_gather_object(obj):
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out
