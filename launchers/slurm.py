"""Slurm -> torch.distributed: the variables the process group's env:// init reads, from the ones Slurm sets.

Two ways to start the ranks of a multi-node job (launchers/pretrain.sbatch uses either):

- one task per GPU (`srun --ntasks-per-node 8 python -m train.pretrain ...`): every task is a
  rank; train/engine/distributed.py calls `task_env` (train/engine/slurm_env.py) when RANK is unset: RANK = SLURM_PROCID,
  LOCAL_RANK = SLURM_LOCALID, WORLD_SIZE = SLURM_STEP_NUM_TASKS, MASTER_ADDR = the step's first
  node. Only inside an srun step with more than one task (SLURM_STEP_NUM_TASKS), so a plain
  `python` in the batch script or an salloc shell stays a world of one.
- one task per node (`srun --ntasks-per-node 1 python -m launchers.slurm node -- -m train.pretrain ...`):
  this module starts the node's ranks itself (RANK = SLURM_NODEID x ranks per node + local
  rank), passes SIGUSR1 / SIGTERM / SIGINT on to them, and exits with the first failure (the
  other ranks are then stopped).

MASTER_PORT is 20000 + SLURM_JOB_ID mod 20000, the same on every task without any
communication and different for concurrent jobs; a MASTER_PORT in the environment wins. The
environment is propagated by srun (--export=ALL, its default) and, in node mode, by this launcher
to each rank.

    python -m launchers.slurm env        # the variables this task would get, as shell exports
    python -m launchers.slurm hostfile F # a DeepSpeed hostfile of the job's nodes (deepspeed --hostfile F)
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import os
import signal
import subprocess
import sys
from typing import Mapping

# the task-environment mapping lives in train/ (train/engine/distributed.py needs it; launchers sit above train)
from train.engine.slurm_env import hostnames, master, task_env


def node_envs(env: Mapping[str, str], ranks_per_node: int) -> list[dict[str, str]]:
    """torch.distributed variables for each rank this node starts (one-task-per-node steps)."""
    addr, port = master(env)
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES", "1"))
    node = int(env.get("SLURM_NODEID", "0"))
    world = nodes * ranks_per_node
    return [{"RANK": str(node * ranks_per_node + local), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
             "LOCAL_WORLD_SIZE": str(ranks_per_node), "MASTER_ADDR": addr, "MASTER_PORT": port}
            for local in range(ranks_per_node)]


def gpus_on_node(env: Mapping[str, str]) -> int:
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        if env.get(key):
            return int(env[key].split(":")[-1].split("(")[0])  # 'a100:8' / '8(x2)'
    import torch

    return max(1, torch.cuda.device_count())


def run_node(command: list[str], ranks_per_node: int, env: Mapping[str, str] = os.environ) -> int:
    """Start this node's ranks, pass stop signals on to them, wait; the first failure ends the rest."""
    procs: list[subprocess.Popen] = []

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    # before any rank starts, so that the launcher never dies of them (a signal in the few ms before
    # the ranks exist reaches none: a rank that has not installed its handlers yet would die of it)
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    procs += [subprocess.Popen([sys.executable, *command], env={**env, **extra}) for extra in node_envs(env, ranks_per_node)]
    code = 0
    alive = list(procs)
    while alive:
        for p in list(alive):
            try:
                rc = p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                continue
            alive.remove(p)
            if rc and not code:
                code = rc
                for other in alive:  # a failed rank leaves the others waiting in collectives
                    other.terminate()
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    node = sub.add_parser("node", help="start this node's ranks: node [--ranks N] -- -m train.pretrain ARGS...")
    node.add_argument("--ranks", type=int, default=0, help="ranks on this node (default: the node's GPUs)")
    node.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("env", help="print this task's variables (one task per GPU) as shell exports")
    hostfile = sub.add_parser("hostfile", help="write a DeepSpeed hostfile of the job's nodes")
    hostfile.add_argument("path")
    hostfile.add_argument("--slots", type=int, default=0, help="GPUs per node (default: the node's)")
    a = p.parse_args(argv)
    job_nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not job_nodes:  # every command reads the job's nodes
        print(f"error: launchers.slurm {a.cmd} reads the variables of a Slurm job (SLURM_JOB_NODELIST is not set): "
              f"run it inside one (sbatch, salloc or srun; launchers/pretrain.sbatch does)", file=sys.stderr)
        return 2
    if a.cmd == "env":
        if "SLURM_PROCID" not in os.environ or "SLURM_STEP_NUM_TASKS" not in os.environ:
            print("error: launchers.slurm env prints one task's variables: run it inside a job step (srun ... "
                  "python -m launchers.slurm env), not in the batch script or an salloc shell", file=sys.stderr)
            return 2
        for k, v in task_env(os.environ).items():
            print(f"export {k}={v}")
        return 0
    if a.cmd == "hostfile":
        slots = a.slots or gpus_on_node(os.environ)
        nodes = hostnames(job_nodes)
        with open(a.path, "w") as f:
            f.writelines(f"{h} slots={slots}\n" for h in nodes)
        return 0
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("node needs the script to run: node -- -m train.pretrain ...")
    return run_node(command, a.ranks or gpus_on_node(os.environ))


if __name__ == "__main__":
    sys.exit(main())
