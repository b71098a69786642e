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
