"""train/engine/distributed.py: a world of one starts its process group without binding a port, so
a port another run holds (an exported MASTER_PORT, a second run on the machine) cannot stop it."""
import socket

import pytest
import torch
import torch.distributed as dist

from train.engine import distributed


@pytest.fixture
def held_port():
    """A port some other run listens on."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.mark.parametrize("launched", [{}, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}],
                         ids=["plain python", "a launcher's world of one"])
def test_a_world_of_one_starts_beside_a_run_that_holds_its_port(held_port, launched, monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(held_port), **launched}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.init() == (0, 1, torch.device("cpu"))
    total = torch.tensor([2.0])
    dist.all_reduce(total)
    assert total.item() == 2.0
    dist.destroy_process_group()


@pytest.mark.parametrize("local_rank, visible, index", [(0, 8, 0), (5, 8, 5), (5, 1, 0), (0, 1, 0), (3, 4, 3)],
                         ids=["rank 0 of 8 GPUs", "rank 5 of 8 GPUs", "rank 5 bound to its GPU",
                              "rank 0 bound to its GPU", "rank 3 of 4 GPUs"])
def test_each_rank_takes_its_own_gpu_or_the_one_it_is_bound_to(local_rank, visible, index, monkeypatch):
    """A cluster that binds one GPU per task (CUDA_VISIBLE_DEVICES per task) shows each rank one
    device, cuda:0: LOCAL_RANK 5 is no ordinal there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert distributed.cuda_device_index(local_rank) == index


def test_a_local_rank_past_the_visible_gpus_is_refused_in_one_line(monkeypatch):
    from train.config.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ConfigError) as refused:
        distributed.cuda_device_index(3)
    message = str(refused.value)
    assert "\n" not in message
    assert "LOCAL_RANK 3" in message and "2 GPUs" in message and "CUDA_VISIBLE_DEVICES=4,5" in message
    assert "at most 2 ranks per node" in message



def test_a_local_rank_equal_to_the_visible_gpu_count_is_refused(monkeypatch):
    """Ordinals run 0..n-1: with 4 GPUs visible, LOCAL_RANK 4 is a fifth rank on the node, no cuda:4."""
    from train.config.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ConfigError, match="LOCAL_RANK 4 has no GPU of its own"):
        distributed.cuda_device_index(4)

def test_init_puts_a_rank_bound_to_one_gpu_on_cuda_0(monkeypatch):
    """srun with --gpus-per-task / --gpu-bind: rank 5 of 8 sees one GPU; it used to ask for cuda:5."""
    for key, value in {"RANK": "5", "LOCAL_RANK": "5", "WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "5"}.items():
        monkeypatch.setenv(key, value)
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # the group itself is not what this checks
    monkeypatch.setattr(dist, "get_rank", lambda: 5)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    assert distributed.init() == (5, 8, torch.device("cuda", 0))
    assert chosen == [0]
