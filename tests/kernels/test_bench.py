import json
from types import SimpleNamespace

import pytest
import torch

from kernels.bench import main


def test_cpu_bench_records_setup_and_ratios_from_its_own_timings(tmp_path):
    path = main(["--device", "cpu", "--dtype", "fp32", "--shapes", "2,2,17,16", "--iters", "2", "--warmup", "1",
                 "--out_dir", str(tmp_path)])
    record = json.loads(path.read_text())
    assert record["dtype"] == "fp32" and record["device"] and len(record["commit"]) in (40, 7) or record["commit"] == "unknown"
    shape = record["shapes"]["2,2,17,16"]
    assert shape["shape"] == {"B": 2, "H": 2, "T": 17, "d": 16} and shape["topk"] == 4 and shape["groups"] == 4
    ms = {k: v["ms"] for k, v in shape["results"].items()}
    assert set(ms) == {"dense_sdpa", "topk_torch", "segment_sdpa"}  # no fused kernels on CPU
    assert all(t > 0 for t in ms.values())
    assert shape["ratios"]["topk_torch_over_dense"] == pytest.approx(ms["topk_torch"] / ms["dense_sdpa"])
    assert "peak_mib" not in shape["results"]["dense_sdpa"]  # memory is measured on GPUs only


def test_measure_reports_the_mean_of_the_timed_calls_after_the_warmup(monkeypatch):
    """A stand-in clock that each call advances by its own duration: the warm-up calls (1 s each)
    run first and are not timed; the mean is over the timed calls alone."""
    from kernels import bench

    durations = [1.0, 1.0] + [0.001, 0.002, 0.003, 0.006]  # warmup 2, iters 4
    now, calls = [0.0], []
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    x = torch.ones(3, requires_grad=True)

    def fn():
        now[0] += durations[len(calls)]
        calls.append(1)
        return x * 2

    result = bench.measure(fn, [x], iters=4, warmup=2, device=torch.device("cpu"))
    assert len(calls) == 2 + 4
    assert result["ms"] == pytest.approx(sum(durations[2:]) * 1000 / 4)


def test_bench_shape_makes_cls_global_and_k_of_the_patches(monkeypatch):
    """K = round(ratio x patches), the cls token not counted: 0.25 x 17 -> 4 (0.25 x 18 would give 5);
    the segments put the cls token (column 0) in GLOBAL, the patches in one of round(1 / ratio) groups."""
    from kernels import bench
    from kernels.masked import GLOBAL

    seen = {}

    def variants(q, k, v, segments, topk, device):
        seen.update(segments=segments.clone(), topk=topk)
        return {"dense_sdpa": lambda: q * k * v}

    monkeypatch.setattr(bench, "variants", variants)
    out = bench.bench_shape("x", (3, 1, 18, 8), torch.float32, torch.device("cpu"), 0.25, 1, 0)
    assert out["topk"] == seen["topk"] == int(0.25 * 17 + 0.5) == 4
    segments = seen["segments"]
    assert segments.shape == (3, 18) and bool((segments[:, 0] == GLOBAL).all())
    assert bool(((segments[:, 1:] >= 0) & (segments[:, 1:] < 4)).all())
