"""tools/profile_step.py's count of host-device syncs: only PyTorch's per-sync warnings count, each
with the line that issued it; the debug mode's notice that it is a prototype is not a sync (the GPU
kit once counted it as one: "2 syncs in 5 steps" were that notice and the loop's one log read)."""
import warnings

import pytest

from tools.profile_step import sync_sites

PROTOTYPE = ("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
             "operations (Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:912.)")
SYNC = "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:162.)"


def test_only_sync_warnings_count_each_with_its_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(PROTOTYPE)
        warnings.warn_explicit(SYNC, UserWarning, "train/run/loop.py", 149)
        warnings.warn("an unrelated warning about synchronizing clocks")
        warnings.warn_explicit(SYNC, UserWarning, "/elsewhere/lib.py", 7)
    assert sync_sites(caught) == ["train/run/loop.py:149", "/elsewhere/lib.py:7"]


def test_merge_gives_the_union_of_nested_overlapping_and_touching_intervals():
    import random

    from tools.profile_step import _merge

    assert _merge([(0, 10), (2, 3), (5, 12)]) == [(0, 12)]  # (2, 3) inside (0, 10) must not cut it short
    assert _merge([(4, 6), (0, 1), (1, 2)]) == [(0, 2), (4, 6)]
    rng = random.Random(0)
    for _ in range(50):  # against a brute-force union on a grid of unit cells
        intervals = [(a, a + rng.randint(1, 8)) for a in (rng.randint(0, 30) for _ in range(rng.randint(1, 8)))]
        cells = {c for a, b in intervals for c in range(a, b)}
        merged = _merge(intervals)
        assert {c for a, b in merged for c in range(a, b)} == cells
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(merged, merged[1:]))  # disjoint, apart, in order


def test_on_cpu_kernels_per_step_counts_one_step_s_top_level_ops():
    import torch

    from tools.profile_step import attribution

    class TwoOpsAStep:  # a stand-in for a census Subject: two top-level aten ops per step
        x = torch.ones(4)

        def run(self, phase, steps):
            for _ in range(steps):
                with phase("forward"):
                    torch.mul(torch.add(self.x, 1), 2)

    out = attribution(TwoOpsAStep(), 3, torch.device("cpu"))
    assert out["kernels_per_step"] == 2
    assert {k["name"]: k["count"] for k in out["top_kernels"]} == {"aten::add": 3, "aten::mul": 3}


class TwoPhasesAStep:
    """A stand-in census Subject: a forward and a backward phase per step, each a small matmul;
    `tick` is called once per step (a stand-in clock's advance)."""

    def __init__(self, tick=lambda: None):
        import torch

        self.x, self.tick = torch.ones(32, 32), tick

    def run(self, phase, steps):
        for _ in range(steps):
            with phase("forward"):
                self.x @ self.x
            with phase("backward"):
                self.x @ self.x
            self.tick()


def test_the_phases_host_times_are_per_step_and_add_up_to_the_steps():
    import torch

    from tools.profile_step import attribution

    out = attribution(TwoPhasesAStep(), 3, torch.device("cpu"))
    assert set(out["host_ms_per_phase"]) == {"forward", "backward"}
    assert out["host_ms_per_step"] > 0
    assert sum(out["host_ms_per_phase"].values()) == pytest.approx(out["host_ms_per_step"], rel=1e-9)


def test_wall_time_is_per_step(monkeypatch):
    """A stand-in clock that advances 2 ms a step: 4 steps are 2 ms each, not 8 ms."""
    from types import SimpleNamespace

    import torch

    import tools.profile_step as tool

    clock = [0.0]

    def tick():
        clock[0] += 0.002

    monkeypatch.setattr(tool, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    out = tool.attribution(TwoPhasesAStep(tick), 4, torch.device("cpu"))
    assert out["wall_ms_per_step"] == pytest.approx(2.0)


class CountsItsSteps:
    """A stand-in census Subject that records each `run` call: whether it was profiled (the phase
    marker given) and how many steps it ran."""

    def __init__(self):
        self.calls = []

    def run(self, phase, steps):
        from train.run.loop import no_phases

        self.calls.append(("unprofiled" if phase is no_phases else "profiled", steps))
        for _ in range(steps):
            with phase("forward"):
                pass


@pytest.mark.parametrize("compiled, warmup", [(False, 1), (True, 3)])
def test_a_compiled_step_is_profiled_only_once_its_cuda_graphs_replay(compiled, warmup):
    """run.compile's blocks run as CUDA graphs that warm up on their first call, are recorded on the
    second and replay from the third: with one warm-up step the recording would be profiled."""
    import torch

    from tools.profile_step import attribution

    subject = CountsItsSteps()
    attribution(subject, 5, torch.device("cpu"), compiled=compiled)
    assert subject.calls == [("unprofiled", warmup), ("profiled", 5)]
