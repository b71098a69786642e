import json

import pytest

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
