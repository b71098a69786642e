"""Optional accelerator packages are detected by what they must provide (kernels/accelerators.py)."""
import sys
from types import ModuleType

import pytest

from kernels import accelerators


@pytest.fixture
def fresh_apex_check(monkeypatch):
    """has_nvidia_apex is cached per process: cleared around the test, sys.modules restored after."""
    for name in ("apex", "apex.optimizers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    accelerators.has_nvidia_apex.cache_clear()
    yield monkeypatch
    accelerators.has_nvidia_apex.cache_clear()


def test_an_apex_without_fused_optimizers_is_not_nvidia_apex(fresh_apex_check):
    """PyPI's `apex` is an unrelated project: it imports, but has no apex.optimizers."""
    fresh_apex_check.setitem(sys.modules, "apex", ModuleType("apex"))
    assert not accelerators.has_nvidia_apex()


def test_an_apex_with_fused_optimizers_is_nvidia_apex(fresh_apex_check):
    apex, optimizers = ModuleType("apex"), ModuleType("apex.optimizers")
    apex.optimizers = optimizers
    fresh_apex_check.setitem(sys.modules, "apex", apex)
    fresh_apex_check.setitem(sys.modules, "apex.optimizers", optimizers)
    assert accelerators.has_nvidia_apex()
