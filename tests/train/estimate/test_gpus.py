"""train/estimate/gpus.py: the GPUs the ds_configs target, with the dense tensor-core peak that MFU
(train/bench.py) and the dry run's step times are taken against."""
import json

import pytest
from conftest import CPU_DS, DEBUG_PRESET

from train.estimate.gpus import GPUS, gpu_named

# Dense (no structured sparsity) fp16/bf16 tensor-core peaks, TFLOP/s, from NVIDIA's data sheets:
# V100 SXM2 "Tensor Performance 125" (fp16; Volta has no bf16); A100 SXM "BF16 Tensor Core 312" (624
# with sparsity); H100 SXM and H200 SXM "BF16 Tensor Core 1,979" with sparsity, half of it dense; H100
# PCIe 1,513 and H100 NVL 1,671 (per GPU) with sparsity, half of each dense.
DENSE_PEAK = {"v100": 125, "v100-16gb": 125, "a100": 312, "a100-40gb": 312, "h100": 1979 / 2,
              "h100-pcie": 1513 / 2, "h100-nvl": 1671 / 2, "h200": 1979 / 2}
BF16 = {"v100": False, "v100-16gb": False, "a100": True, "a100-40gb": True, "h100": True, "h100-pcie": True,
        "h100-nvl": True, "h200": True}


def test_every_gpu_holds_its_data_sheets_dense_peak():
    assert GPUS.keys() == DENSE_PEAK.keys()
    for key, peak in DENSE_PEAK.items():
        assert gpu_named(key).peak_tflops == pytest.approx(peak, abs=1), key  # the sheets round to whole TFLOP/s
        assert gpu_named(key).bf16 is BF16[key], key


def test_the_benchs_mfu_is_the_steps_flops_over_the_dense_peak(tmp_path):
    """One timed step of the debug MAE (micro-batch 8) with --gpu h100: MFU is its training FLOPs per
    second over the H100's 989 dense TFLOP/s, not the 1,979 of its sparse peak."""
    from train.bench import main

    path = main(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--steps", "1", "--warmup", "0",
                 "--gpu", "h100", "--out_dir", str(tmp_path)])
    res = json.loads(path.read_text())["results"]
    # the debug MAE's hand count (tests/train/estimate/test_costs.py): 2,359,040 forward FLOPs per image, x 3 to train
    flops_per_s = 3 * 2_359_040 * 8 / res["step_time_s"]
    assert res["mfu"] == pytest.approx(flops_per_s / (DENSE_PEAK["h100"] * 1e12), rel=1e-3)


# torch.cuda.get_device_name() and total memory (MiB, as nvidia-smi shows it) of the H100's three
# forms: the PCIe and NVL cards hold about the SXM part's memory, so only the name tells their peaks apart.
@pytest.mark.parametrize("device_name, mib, key, peak", [
    ("NVIDIA H100 80GB HBM3", 81559, "h100", 989),       # SXM5: "BF16 Tensor Core 1,979" with sparsity
    ("NVIDIA H100 PCIe", 81559, "h100-pcie", 756),       # "1,513" with sparsity
    ("NVIDIA H100 NVL", 95830, "h100-nvl", 835),         # "1,671" with sparsity, per GPU
    ("NVIDIA A100-SXM4-40GB", 40536, "a100-40gb", 312),  # one part in two sizes: memory tells them apart
])
def test_the_gpu_torch_names_is_the_entry_with_its_dense_peak(monkeypatch, device_name, mib, key, peak):
    import torch

    from train.estimate.gpus import current_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("Props", (), {"total_memory": mib * 2**20})())
    gpu = current_gpu()
    assert gpu is gpu_named(key)
    assert gpu.peak_tflops == pytest.approx(peak, abs=1)
