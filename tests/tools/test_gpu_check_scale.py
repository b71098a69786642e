"""tools/gpu_check.py's `scale` phase in its CPU smoke mode (2 gloo ranks, the debug model, fp32,
a step per ZeRO stage, one torchrun launch per rank count) and what its JSON holds."""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

STAGES = ("zero0", "zero1", "zero2", "zero3")


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_scale")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "GPU_CHECK_COMMIT": ""}
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "scale", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("gpu_check_scale_*.json")
    (log,) = out.glob("gpu_check_scale_*.log")
    return json.loads(path.read_text()), log.read_text()


def test_the_record_says_device_dtype_shapes_commit_and_versions(record):
    r, _ = record
    assert r["phase"] == "scale" and r["mode"] == "smoke" and r["commit"] and "cores" in r["device"]
    assert r["versions"]["torch"] == torch.__version__ and "phase_error" not in r
    config = r["summary"]["config"]
    assert config == {"model": "vit_debug_patch4", "objective": "mae", "micro_batch": 8, "accumulation": 2,
                      "dtype": "fp32", "image_shape": [8, 1, 28, 28], "gloo_ranks": 2}


def test_every_stage_runs_on_one_and_two_ranks_through_the_bench_entry_point(record):
    r, log = record
    items = r["items"]
    for ranks in (1, 2):
        item = items[f"gpus{ranks}"]
        assert item["returncode"] == 0 and f"--nproc_per_node {ranks} -m tools.phases.scale_ranks" in log
        for stage in STAGES:
            run = item[stage]
            assert run["world_size"] == ranks and run["batch"] == {"micro": 8, "accum": 2, "world": ranks,
                                                                   "global": 16 * ranks}
            assert run["dtype"] == "float32" and run["loss"] > 0
            assert run["images_per_s_per_gpu"] == pytest.approx(run["images_per_s"] / ranks)
    for count in (4, 8):
        assert "not measured" in items[f"gpus{count}"]["skipped"]
    assert r["summary"]["multi_gpu"] == "measured"


def test_efficiency_is_per_gpu_throughput_against_one_rank_with_the_models_prediction_beside(record):
    r, _ = record
    items, summary = r["items"], r["summary"]
    assert set(summary["targets"]) == {"efficiency_8_gpus_of_a_node", "efficiency_4_nodes_by_the_model"}
    for stage in STAGES:
        one, two = (items[f"gpus{k}"][stage]["images_per_s_per_gpu"] for k in (1, 2))
        assert summary[stage]["images_per_s_per_gpu"] == {"1": one, "2": two}
        assert summary[stage]["efficiency"] == {"2": pytest.approx(two / one)}
        model = items["model"][stage]
        assert set(model["by_world_size"]) == {"8", "32"} and model["mfu"] == 0.4  # none measured on the CPU
        for world, engines in model["by_world_size"].items():
            assert set(engines) == {"before", "after"}
            assert 0 < engines["after"]["efficiency"] <= 1 and engines["after"]["sent_gb_per_rank"] > 0
            assert summary[stage]["model_efficiency_after"][world] == engines["after"]["efficiency"]


def test_the_gpu_counts_are_those_present():
    from tools.phases.scale import gpu_counts

    assert gpu_counts(1) == [1] and gpu_counts(2) == [1, 2] and gpu_counts(6) == [1, 2, 4]
    assert gpu_counts(16) == [1, 2, 4, 8]
