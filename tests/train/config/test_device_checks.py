"""What the pre-start checks decide on the GPUs the ds_configs target, faked (tests/fake_gpu.py:
CI has no GPU): every GPU x torch build x precision x attention backend x objective, through
train/pretrain.py's own checks up to the process group; and the rule that says which GPUs a
torch build has kernels for (train/config/device_checks.py)."""
import json
from pathlib import Path

import pytest
import torch
from fake_gpu import CU126_ARCHS, CU130_ARCHS, GPUS, fake_flash_attn, fake_gpu

from model.objectives import build_objective, list_objectives
from train.config.device_checks import CudaDevice, kernels_cover, runs_on, this_device
from train.config.parsing import parse_args
from train.config.plan import build_encoder
from train.engine import distributed
from train.pretrain import main
from train.run.cli import cli

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("arch,capability,runs", [
    ("sm_70", (7, 0), True),
    ("sm_75", (7, 0), False),  # a cubin never runs on an earlier minor ...
    ("sm_80", (8, 6), True),  # ... and runs on later minors of its major
    ("sm_86", (8, 0), False),
    ("sm_90", (10, 0), False),  # nor across majors
    ("sm_120", (12, 1), True),
    ("compute_90", (10, 0), True),  # PTX: the driver JIT-compiles it for later GPUs
    ("compute_90", (8, 0), False),
    ("sm_90a", (9, 0), True),  # architecture-specific: that one capability only
    ("compute_90a", (10, 0), False),
    ("sm_100f", (10, 3), True),  # family-specific: like a plain cubin
    ("gfx90a", (9, 0), None),  # not a CUDA target
])
def test_which_gpus_an_arch_list_entry_runs_on(arch, capability, runs):
    assert runs_on(arch, capability) is runs


def test_which_gpus_the_torch_builds_cover():
    def covers(archs, capability):
        return kernels_cover(CudaDevice("gpu", capability, archs, native_bf16=True))

    assert not covers(CU130_ARCHS, (7, 0)) and covers(CU126_ARCHS, (7, 0))  # V100
    assert all(covers(archs, cap) for archs in (CU130_ARCHS, CU126_ARCHS) for cap in ((8, 0), (8, 6), (9, 0)))
    assert not covers(CU126_ARCHS, (10, 0)) and covers((*CU126_ARCHS, "compute_90"), (10, 0))  # B200: PTX only
    assert covers((), (7, 0)) and covers(("gfx90a",), (7, 0))  # nothing readable: no refusal


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_this_device_reads_torch_and_ignores_emulated_bf16(gpu):
    name, capability, _ = GPUS[gpu]
    with fake_gpu(gpu, CU126_ARCHS):
        device = this_device()
        assert torch.cuda.is_bf16_supported()  # torch's default answer counts emulation: True even on sm70
    assert device == CudaDevice(name, capability, CU126_ARCHS, native_bf16=capability >= (8, 0))
    assert (this_device() is None) == (not torch.cuda.is_available())  # the fake is gone


def vit_b_run(name: str) -> tuple[str | None, str]:
    """(its ViT-B preset in train/configs, or None for the defaults' ViT-B; the stem of the shipped
    ds_configs it takes: its own `<name>_vit_b_*` when it has them, else the common `vit_b_*`)."""
    preset = f"{name}/vit_b.json" if (REPO / "train" / "configs" / name / "vit_b.json").is_file() else None
    own = any((REPO / "ds_configs").glob(f"{name}_vit_b_8x*.json"))
    return preset, f"{name}_vit_b" if own else "vit_b"


# every pretraining method (a registered objective with a debug preset) -> vit_b_run(method)
OBJECTIVES = {name: vit_b_run(name) for name in list_objectives()
              if (REPO / "train" / "configs" / name / "debug.json").is_file()}
# precision -> the shipped ds_config a user of it takes (fp32: the bf16 file with bf16 switched off)
DS_FILES = {"fp16": "8xv100_fp16_zero1", "bf16": "8xa100_bf16_zero1", "fp32": "8xa100_bf16_zero1"}
# a GPU and the torch build installed with it: PyPI's CUDA 13.0 wheels or the CUDA 12.6 ones
MACHINES = {"v100+cu130": ("v100", CU130_ARCHS), "v100+cu126": ("v100", CU126_ARCHS),
            "a100+cu130": ("a100", CU130_ARCHS), "h100+cu130": ("h100", CU130_ARCHS)}


def test_every_pretraining_method_is_checked_with_its_vit_b_files():
    assert {"mae", "mixedae", "maeplus", "mlomae", "energy"} <= set(OBJECTIVES)
    assert OBJECTIVES["mae"] == (None, "vit_b") and OBJECTIVES["mlomae"] == ("mlomae/vit_b.json", "mlomae_vit_b")


def expected_refusal(gpu: str, archs: tuple[str, ...], precision: str, backend: str) -> str | None:
    """The decision the checks must reach, in the order they run: options (the backend), then the
    ds_config against the GPU. A phrase of the refusal, or None when the run may start."""
    sm80 = GPUS[gpu][1] >= (8, 0)
    if backend == "flash_attn" and not sm80:
        return "needs the flash-attn package and a GPU with compute capability >= 8.0, but this GPU is Tesla V100"
    if not kernels_cover(CudaDevice(gpu, GPUS[gpu][1], archs, sm80)):
        return "has no kernels for this GPU"
    if precision == "bf16" and not sm80:
        return "bf16, which this GPU lacks"
    if backend == "flash_attn" and precision == "fp32":
        return "flash_attn runs only in fp16/bf16"
    return None


class Started(Exception):
    """Raised in place of distributed.init: every pre-start check has passed."""


def _argv(tmp_path, objective: str, precision: str, backend: str) -> list[str]:
    preset, stem = OBJECTIVES[objective]
    ds = json.loads((REPO / "ds_configs" / f"{stem}_{DS_FILES[precision]}.json").read_text())
    if precision == "fp32":
        ds["bf16"] = {"enabled": False}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return ["--ds_config", str(path), *(["--config", str(REPO / "train" / "configs" / preset)] if preset else []),
            "--data.source", "synthetic", "--model.attn_backend", backend, "--output_dir", str(tmp_path / "run")]


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
@pytest.mark.parametrize("backend", ["sdpa", "math", "flash_attn"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_pre_start_decision(tmp_path, capsys, monkeypatch, machine, precision, backend, objective):
    gpu, archs = MACHINES[machine]
    fake_flash_attn(monkeypatch)  # flash-attn installed (it only imports; nothing runs)
    monkeypatch.setenv("WORLD_SIZE", "8")

    def started():
        raise Started

    monkeypatch.setattr(distributed, "init", started)
    want = expected_refusal(gpu, archs, precision, backend)
    with fake_gpu(gpu, archs), pytest.raises((SystemExit, Started)) as outcome:
        cli(lambda: main(_argv(tmp_path, objective, precision, backend)))
    if want is None:
        assert outcome.type is Started, capsys.readouterr().err
    else:
        assert outcome.type is SystemExit and outcome.value.code == 2
        assert want in capsys.readouterr().err
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
@pytest.mark.parametrize("backend", ["auto", "sdpa", "math", "flash_attn"])
def test_attention_backend_every_block_gets(tmp_path, monkeypatch, backend, objective):
    """On an A100 with flash-attn: the backend asked for, in encoder and decoder, except for energy,
    whose double backward needs the math path whatever was asked."""
    fake_flash_attn(monkeypatch)
    with fake_gpu("a100"):
        cfg = parse_args(_argv(tmp_path, objective, "bf16", backend))
        with torch.device("meta"):
            model = build_objective(cfg.objective, build_encoder(cfg), getattr(cfg, cfg.objective))
    backends = {m.backend for m in model.modules() if hasattr(m, "backend") and isinstance(m.backend, str)}
    assert backends == ({"math"} if objective == "energy" else {"sdpa" if backend == "auto" else backend})
