"""run.float8: the ViT blocks' linear layers train in float8 through torchao (train/engine/execution.py
`float8_blocks`), on CPU as on a GPU: which layers convert, that their matmuls are float8, that a run
tracks the compute dtype's and writes the same files, and what is refused before start."""
import importlib.util

import pytest
import torch
from conftest import CPU_DS, REPO

from model.objectives import build_objective
from model.objectives.mae import MAEConfig
from model.registry import create_model
from model.vit import Block
from train.config.ds_config import resolve
from train.config.errors import ConfigError
from train.config.parsing import parse_args
from train.engine.execution import float8_blocks
from train.pretrain import main
from train.run.cli import cli
from train.run.folder import read_metrics

pytest.importorskip("torchao", reason="run.float8 needs torchao (the test extra installs it)")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


def mae_objective():
    torch.manual_seed(0)
    return build_objective("mae", create_model("vit_debug_patch4", in_chans=1),
                           MAEConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2))


def test_the_blocks_linear_layers_and_nothing_else_convert_keeping_the_checkpoints_names():
    objective = mae_objective()
    names = {k: v.shape for k, v in objective.state_dict().items()}
    assert float8_blocks(objective) == 12  # qkv, proj, fc1, fc2 in 2 encoder blocks and 1 decoder block
    for name, module in objective.named_modules():
        inside_block = any(isinstance(m, Block) for m in [objective.get_submodule(name.rsplit(".", i)[0])
                                                          for i in range(1, name.count(".") + 1)])
        if isinstance(module, torch.nn.Linear):
            assert isinstance(module, Float8Linear) == inside_block, name  # decoder_embed / decoder_pred stay
    assert {k: v.shape for k, v in objective.state_dict().items()} == names
    assert float8_blocks(Block(24, 2)) == 0  # 24 is not a multiple of float8's tile of 16


def test_the_converted_layers_multiply_in_float8():
    block = Block(32, 2)
    float8_blocks(block)
    from torch.profiler import profile

    with profile() as prof:
        block(torch.randn(2, 5, 32, requires_grad=True)).sum().backward()
    scaled = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")
    assert scaled == 4 * 3  # four layers, forward + two backward matmuls each


def pretrain(out, *options):
    argv = ["--ds_config", str(CPU_DS), "--config", "train/configs/mae/debug.json", "--output_dir", str(out),
            "--run.max_steps", "8", "--run.log_every", "1", "--run.tensorboard", "false", "--run.progress", "false",
            *options]
    try:
        cli(lambda: main(argv))
    except SystemExit as e:
        raise AssertionError(f"the run exited with status {e.code}") from None
    return [m["loss"] for m in read_metrics(out) if "loss" in m]


def test_a_float8_run_tracks_the_compute_dtype_and_exports_the_same_encoder(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", "1")
    plain = pretrain(tmp_path / "plain")
    float8 = pretrain(tmp_path / "float8", "--run.float8", "true")
    assert len(float8) == len(plain) == 8 and all(torch.isfinite(torch.tensor(float8)))
    assert float8 != plain  # the matmuls did change
    assert float8 == pytest.approx(plain, rel=0.02)  # float8's rounding, not another model
    exported = [load_file(tmp_path / run / "encoder.safetensors") for run in ("plain", "float8")]
    assert {k: v.shape for k, v in exported[0].items()} == {k: v.shape for k, v in exported[1].items()}


def config(*options: str):
    return parse_args(["--ds_config", str(CPU_DS), *options])


@pytest.mark.parametrize("preset, said", [
    ("train/configs/mlomae/debug.json", "finite differences of fp32 copies"),
    ("train/configs/energy/debug.json", "differentiates through input gradients"),
])
def test_objectives_that_cannot_take_float8_are_refused_with_the_reason(preset, said):
    with pytest.raises(ConfigError, match=said):
        config("--config", preset, "--run.float8", "true")


def test_without_torchao_it_is_refused_with_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[float8\]'"):
        config("--config", "train/configs/mae/debug.json", "--run.float8", "true")


def test_a_gpu_without_float8_tensor_cores_is_refused_before_start(monkeypatch):
    from train.config import ds_config
    from train.config.device_checks import CudaDevice

    cfg = config("--config", "train/configs/mae/debug.json", "--run.float8", "true")
    a100 = CudaDevice("NVIDIA A100-SXM4-80GB", (8, 0), ("sm_80", "sm_90"), native_bf16=True)
    monkeypatch.setattr(ds_config, "this_device", lambda: a100)
    with pytest.raises(ConfigError, match=r"compute capability >= 8\.9.*A100-SXM4-80GB, compute capability 8\.0"):
        resolve(cfg, 1)
    monkeypatch.setattr(ds_config, "this_device", lambda: CudaDevice("NVIDIA H100", (9, 0), ("sm_90",), True))
    resolve(cfg, 1)


def test_the_dry_run_says_float8_and_refuses_it_for_an_a100():
    from train.estimate.dry_run import check
    from train.estimate.gpus import gpu_named

    cfg = parse_args(["--ds_config", "ds_configs/vit_b_8xh100_bf16_zero1.json", "--data.source", "synthetic",
                      "--run.float8", "true"])
    h100 = check(cfg, 8, gpu_named("h100"))
    assert h100.ok and any(line.startswith("float8: the transformer blocks' linear layers") for line in h100.lines)
    a100 = check(cfg, 8, gpu_named("a100"))
    assert any("run.float8 needs float8 tensor cores" in p and "8.0" in p for p in a100.problems)
    # a configuration refused before start has no memory to estimate; the H100 one has
    assert a100.memory is None and h100.memory is not None
