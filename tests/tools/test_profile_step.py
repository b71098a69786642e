"""tools/profile_step.py's count of host-device syncs: only PyTorch's per-sync warnings count, each
with the line that issued it; the debug mode's notice that it is a prototype is not a sync (the GPU
kit once counted it as one: "2 syncs in 5 steps" were that notice and the loop's one log read)."""
import warnings

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
