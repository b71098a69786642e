"""Slurm's task environment -> the torch.distributed variables the process group's env:// init reads.

Pure functions of an environment mapping, used by train/engine/distributed.py (a one-task-per-GPU srun
step: each task is a rank) and by the node launcher in launchers/slurm.py (one task per node
that starts the node's ranks). MASTER_PORT is 20000 + SLURM_JOB_ID mod 20000, the same on every
task without any communication and different for concurrent jobs; a MASTER_PORT in the
environment wins.
"""
from __future__ import annotations

import re
from typing import Mapping


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist: 'gpu[01-03,07],login-a' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login-a']."""
    hosts = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        parts = re.split(r"\[([^\]]*)\]", item)  # prefix, range list, middle, range list, ..., suffix
        expanded = [""]
        for k, part in enumerate(parts):
            if k % 2 == 0:
                expanded = [e + part for e in expanded]
                continue
            values = []
            for rng in part.split(","):
                lo, _, hi = rng.partition("-")
                values += [str(v).zfill(len(lo)) for v in range(int(lo), int(hi or lo) + 1)]
            expanded = [e + v for e in expanded for v in values]
        hosts += expanded
    return hosts


def master(env: Mapping[str, str]) -> tuple[str, str]:
    """(MASTER_ADDR, MASTER_PORT) of the job step: its first node, a port derived from the job id."""
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodes:
        raise ValueError("no SLURM_STEP_NODELIST / SLURM_JOB_NODELIST: not inside a Slurm job")
    port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    return env.get("MASTER_ADDR") or hostnames(nodes)[0], port


def in_task_step(env: Mapping[str, str]) -> bool:
    """A task of an srun step that has several tasks: each task is a rank."""
    return "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1


def task_env(env: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed variables for one task of a one-task-per-GPU step."""
    addr, port = master(env)
    tasks = int(env["SLURM_STEP_NUM_TASKS"])
    nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
    return {"RANK": env["SLURM_PROCID"], "LOCAL_RANK": env.get("SLURM_LOCALID", "0"), "WORLD_SIZE": str(tasks),
            "LOCAL_WORLD_SIZE": str(tasks // nodes), "MASTER_ADDR": addr, "MASTER_PORT": port}
