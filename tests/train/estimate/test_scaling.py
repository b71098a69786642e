"""train/estimate/scaling.py: a configuration's FSDP units and FLOPs from the objective, its batch at another
world size, what it reads from the ds_config, and the dry run's line."""
import json

import pytest
import torch
from conftest import REPO

from model.objectives import build_objective
from model.objectives.mae import MAEConfig
from model.registry import create_model
from train.config.ds_config import BatchPlan
from train.config.errors import ConfigError
from train.config.parsing import parse_args
from train.estimate.comm_model import Compute, Network, estimate
from train.estimate.costs import profile
from train.estimate.scaling import batch_at, model_of, scaling, step_config

DS = REPO / "ds_configs"


def test_units_are_the_blocks_in_forward_order_and_the_root_holds_the_rest():
    with torch.device("meta"):
        objective = build_objective("mae", create_model("vit_debug_patch4", in_chans=1),
                                    MAEConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2))
        prof = profile(objective, {"image": torch.zeros(4, 1, 28, 28)})
    model = model_of(objective, prof)
    assert [u.name for u in model.blocks] == ["encoder.blocks.0", "encoder.blocks.1", "decoder.decoder_blocks.0"]
    encoder_block = sum(p.numel() for p in objective.encoder.blocks[0].parameters())
    assert model.blocks[0].params == encoder_block
    assert model.params == sum(p.numel() for p in objective.parameters() if p.requires_grad)
    assert model.root.params == model.params - sum(b.params for b in model.blocks) > 0
    assert sum(u.forward_flops for u in model.units) == prof.forward_flops
    assert model.root.forward_flops > 0 and not any(u.checkpointed for u in model.units)


def test_the_global_batch_is_kept_at_other_world_sizes():
    ds = json.loads((DS / "vit_b_8xh100_bf16_zero1.json").read_text())  # 4096 = 256 x accumulation x ranks
    assert batch_at(ds, 8) == (BatchPlan(256, 2, 8), "")
    plan, note = batch_at(ds, 32)
    assert plan == BatchPlan(128, 1, 32) and "4096" in note
    probe = json.loads((DS / "linprobe_8xa100_fp32_zero0.json").read_text())  # 16384 = 512 x 4 x 8
    plan, note = batch_at(probe, 16)
    assert plan == BatchPlan(512, 2, 16) and "accumulation 2" in note
    with pytest.raises(ConfigError):
        batch_at(ds, 24)  # 4096 is no multiple of 24 ranks


def test_the_step_reads_stage_precision_reduce_dtype_and_buckets():
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 0, "reduce_bucket_size": 1000}, "communication_data_type": "fp32"}
    step = step_config(ds, batch_at(ds, 2)[0])
    assert (step.stage, step.precision, step.reduce_dtype, step.accum) == (0, "bf16", "fp32", 3)
    assert step.bucket_bytes() == 4000
    assert step_config({**ds, "zero_optimization": {"stage": 1}}, BatchPlan(4, 3, 2)).bucket_bytes() == 25 * 2**20


def test_activation_checkpointing_marks_every_block():
    cfg = parse_args(["--ds_config", str(DS / "vit_h_8xh100_bf16_zero3_actckpt.json"), "--data.source", "synthetic",
                      "--model.name", "vit_huge_patch14"])
    s = scaling(cfg, json.loads((DS / "vit_h_8xh100_bf16_zero3_actckpt.json").read_text()), 8, Network(), Compute())
    assert all(b.checkpointed for b in s.model.blocks) and len(s.model.blocks) == 32 + 8
    assert s.flops_per_micro == pytest.approx(3 * sum(u.forward_flops for u in s.model.units))


def test_the_dry_run_prints_the_steps_communication_on_several_ranks(capsys):
    from train.estimate.gpus import gpu_named
    from train.pretrain import main

    path = DS / "vit_l_8xa100_bf16_zero2.json"
    args = ["--ds_config", str(path), "--model.name", "vit_large_patch16", "--data.source", "synthetic"]
    with pytest.raises(SystemExit) as code:
        main(["--dry-run", *args, "--world_size", "16"])
    out = capsys.readouterr().out
    assert code.value.code == 0, out
    line = next(line for line in out.splitlines() if "communication per step on paper" in line)
    gpu = gpu_named("a100")
    s = scaling(parse_args(args), json.loads(path.read_text()), 16, Network(), Compute(gpu.peak_tflops), gpu.sm80)
    after = estimate("after", s.model, s.step, 16, Network(), Compute(gpu.peak_tflops))
    assert f"{after.sent_bytes / 1e9:.3f} GB sent per rank" in line and "2 node(s)" in line
    assert f"efficiency {after.efficiency:.1%}" in line
    with pytest.raises(SystemExit):
        main(["--dry-run", *args, "--world_size", "1"])
    assert "communication per step" not in capsys.readouterr().out  # one rank sends nothing
