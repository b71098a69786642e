"""data.num_workers auto (-1, the default): fits the cores of the process (data/loader.py)."""
import os
import warnings

import pytest
from test_data_faults import image_shards, write_index

from data.loader import ShardLoader, cores_per_rank, resolve_num_workers
from data.shard_index import ShardSet
from train.config.options import DataConfig


def _cores(monkeypatch, n: int, local: int | None = None):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))


def test_the_default_is_auto_and_explicit_counts_are_kept(monkeypatch):
    assert DataConfig().num_workers == -1
    _cores(monkeypatch, 2)
    assert resolve_num_workers(-1) == 1  # 2 cores: one for training, one worker
    assert [resolve_num_workers(n) for n in (0, 3, 16)] == [0, 3, 16]
    with pytest.raises(ValueError, match="-1 for auto"):
        resolve_num_workers(-2)


@pytest.mark.parametrize("cores", [1, 2, 3, 5, 8, 64])
@pytest.mark.parametrize("local", [None, 1, 2, 8])
def test_auto_never_exceeds_the_cores_of_the_process(monkeypatch, cores, local):
    _cores(monkeypatch, cores, local)
    ranks = local or 1
    auto = resolve_num_workers(-1)
    assert 0 <= auto <= min(10, max(0, cores_per_rank() - 1))
    assert ranks * (auto + 1) <= max(cores, ranks)  # ranks and their workers fit the cores
    if cores >= 11 * ranks:  # MAE's official 10 workers per GPU, and the rank's own core
        assert auto == 10
    elif cores >= 2 * ranks:
        assert auto == cores // ranks - 1
    assert resolve_num_workers(-1, num_shards=3, world=2) == min(auto, 1)  # every worker gets a shard


@pytest.mark.parametrize("affinity, tasks, per_task, cores", [
    (5, 16, "5", 5),  # task mode, Slurm binds each task to its 5 CPUs: they are the rank's (was 5 // 8 = 1)
    (40, 16, "5", 5),  # task mode without binding: every task sees the node's 40, and may use its 5
    (40, 2, "40", 5),  # node mode: one task per node starts the node's 8 ranks, which share its 40
])
def test_a_slurm_task_s_own_cpus_are_not_divided_again(monkeypatch, affinity, tasks, per_task, cores):
    """submit.py asks for 5 CPUs per task for 4 loader workers and the rank; under task binding
    the rank divided its own 5 among the node's 8 ranks and decoded in the training process."""
    _cores(monkeypatch, affinity, local=8)
    for key, value in (("SLURM_PROCID", "0"), ("SLURM_STEP_NUM_TASKS", str(tasks)), ("SLURM_STEP_NUM_NODES", "2"),
                       ("SLURM_CPUS_PER_TASK", per_task)):
        monkeypatch.setenv(key, value)
    assert cores_per_rank() == cores and resolve_num_workers(-1) == 4


def test_a_loader_with_the_default_fits_a_2_core_machine_without_the_warning(monkeypatch, tmp_path):
    _cores(monkeypatch, 2)  # torch's DataLoader asks os.sched_getaffinity too
    index = write_index(tmp_path, image_shards(tmp_path, 4, 3))
    loader = ShardLoader(ShardSet.from_index(index), 8, batch_size=2, seed=0, rank=0, world=1,
                         num_workers=DataConfig().num_workers, shuffle_buffer=2)
    assert loader.num_workers == 1 and loader.state_dict()["num_workers"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "This DataLoader will create 4 worker processes ..." at the base
        batch = next(loader)
    loader.close()
    assert batch["image"].shape == (2, 3, 8, 8)
