"""tools/phases/common.py: the one-GPU ds_config every phase writes, one in-process run of
train/bench.py (with MixedAE's PyTorch TopK composition forced when asked), and a study result's
compact form."""
import importlib
import json

import pytest


def _check(tmp_path):
    from tools.gpu_check import Check

    check = Check("bench", tmp_path, smoke=True, deadline=float("inf"), work=tmp_path / "work", log=tmp_path / "log")
    check.work.mkdir()
    return check


def test_the_one_gpu_ds_config_is_bf16_zero1_with_the_micro_batch_as_its_global_batch(tmp_path):
    """What the phases measure by default (the shipped H100 settings on one GPU): bf16 on, fp16 off,
    ZeRO-1, no accumulation, global batch = micro-batch."""
    from tools.phases.common import ds_config

    d = json.loads(ds_config(_check(tmp_path), "x", 128).read_text())
    assert d["bf16"] == {"enabled": True} and d["fp16"] == {"enabled": False}
    assert d["zero_optimization"]["stage"] == 1
    assert d["train_batch_size"] == d["train_micro_batch_size_per_gpu"] == 128
    assert "gradient_accumulation_steps" not in d


def test_the_fp16_ds_config_scales_the_loss_dynamically(tmp_path):
    from tools.phases.common import ds_config

    d = json.loads(ds_config(_check(tmp_path), "y", 64, "fp16", 2).read_text())
    assert d["bf16"] == {"enabled": False} and d["fp16"]["enabled"] is True
    assert d["fp16"]["loss_scale"] == 0  # 0: DeepSpeed's dynamic loss scaling
    assert d["zero_optimization"]["stage"] == 2 and d["train_batch_size"] == 64


def _fake_bench(tmp_path, seen):
    """train/bench.py stood in: it records what the attention dispatch says of the fused kernel and
    writes a minimal record."""
    attention = importlib.import_module("kernels.attention")

    def main(argv):
        seen.append(attention._fused_or_warn(None))
        path = tmp_path / "rec.json"
        path.write_text(json.dumps({"results": {"images_per_s": 1.0}, "batch": {"micro": 4}, "dtype": "bf16",
                                    "config": {"objective": "mixedae", "model": {"name": "m"}}}))
        return str(path)

    return main


@pytest.mark.parametrize("patch", [True, False])
def test_the_torch_topk_run_tells_the_dispatch_the_fused_kernel_is_out_and_restores_it(tmp_path, monkeypatch, patch):
    """MixedAE through the PyTorch TopK composition: during the run the dispatch is told the fused
    kernel is out (as on a GPU with Triton, where it would otherwise be taken); after it, the
    dispatch is as it was."""
    import train.bench
    from tools.phases.common import our_bench

    attention = importlib.import_module("kernels.attention")
    monkeypatch.setattr(attention, "_fused_or_warn", lambda q: True)  # a GPU with Triton
    seen = []
    monkeypatch.setattr(train.bench, "main", _fake_bench(tmp_path, seen))
    res = our_bench(_check(tmp_path), [], patch_torch_topk=patch)
    assert seen == [not patch]
    assert attention._fused_or_warn(None) is True  # restored
    assert res["images_per_s"] == 1.0 and res["micro_batch"] == 4 and res["objective"] == "mixedae"


def test_a_gpu_run_records_the_memory_left_before_it_and_its_own_peak(tmp_path, monkeypatch):
    """3 GiB left allocated by earlier runs when train/bench.py starts (in GiB, as every figure of
    the records), 7.5 GiB allocated at its peak: the run's own peak is 4.5 GiB, and the device's
    peak counter is reset before it (an earlier item's peak is not this run's)."""
    import torch

    import train.bench
    from tools.phases.common import our_bench

    events = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: events.append("reset"))

    def main(argv):
        events.append("bench")
        path = tmp_path / "rec.json"
        path.write_text(json.dumps({"results": {"images_per_s": 1.0, "peak_allocated_gib": 7.5}, "batch": {"micro": 4},
                                    "dtype": "bf16", "config": {"objective": "mae", "model": {"name": "m"}}}))
        return str(path)

    monkeypatch.setattr(train.bench, "main", main)
    check = _check(tmp_path)
    check.cuda = True
    res = our_bench(check, [])
    assert events == ["reset", "bench"]
    assert res["resident_gib_before"] == 3.0 and res["own_peak_gib"] == 4.5 and res["peak_allocated_gib"] == 7.5


def test_a_compact_study_result_keeps_the_loss_curve_s_first_and_last_points(tmp_path):
    from tools.phases.common import compact

    out = compact({"loss_curve": [1.0, 0.8, 0.5], "knn_top1": 50})
    assert out == {"knn_top1": 50, "loss_first_last": [1.0, 0.5]}
    assert compact({"knn_top1": 1}) == {"knn_top1": 1}
