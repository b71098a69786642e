import json

import pytest

from train.bench_objectives import main


def test_cpu_pairs_record_step_times_and_their_ratio(tmp_path):
    path = main(["--device", "cpu", "--dtype", "fp32", "--pairs", "mixedae", "adpe", "--model", "vit_mini_patch4",
                 "--batch", "4", "--iters", "1", "--warmup", "0", "--out_dir", str(tmp_path)])
    record = json.loads(path.read_text())
    assert record["dtype"] == "fp32" and set(record["e2e"]) == {"mixedae", "adpe"}
    mixed = record["e2e"]["mixedae"]
    assert mixed["images"] == [4, 3, 32, 32] and record["e2e"]["adpe"]["images"] == [4, 4, 3, 16, 16]
    ms = {k: v["ms"] for k, v in mixed["results"].items() if isinstance(v, dict)}
    assert set(ms) == {"mae", "mixedae"} and all(t > 0 for t in ms.values())
    assert mixed["results"]["mixedae_over_mae"] == pytest.approx(ms["mixedae"] / ms["mae"])
