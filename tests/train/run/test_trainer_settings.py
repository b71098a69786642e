"""What the Trainer (train/run/trainer.py) and its builders (train/run/build.py) make of the
options: the loop's stop step, the lr schedule's floor, MLO-MAE's validation interleave and the
seeds of the global RNGs, each against the rule written out here."""
import math
import random

import numpy as np
import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET, REPO

from train.config.ds_config import BatchPlan
from train.config.parsing import parse_args
from train.run.prestart import check_before_start

MLOMAE_PRESET = REPO / "train" / "configs" / "mlomae" / "debug.json"


def debug_cfg(tmp_path, *extra: str):
    return parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir",
                       str(tmp_path / "run"), *extra])


def test_run_max_steps_shortens_the_schedule_but_never_extends_it(tmp_path, monkeypatch):
    from train.run.trainer import loop_settings

    monkeypatch.setenv("WORLD_SIZE", "1")
    for max_steps, expected in (("100", None), ("5", 5), ("0", None)):  # None: the whole schedule
        cfg = debug_cfg(tmp_path, "--run.max_steps", max_steps)
        checked = check_before_start(cfg)
        schedule = cfg.optim.epochs * (cfg.data.epoch_size // 8)  # 8: cpu_debug's global batch on one rank
        assert checked.total_steps == schedule
        assert loop_settings(cfg, checked).stop_step == (expected or schedule)


def test_the_lr_schedule_warms_up_then_follows_the_cosine_down_to_optim_min_lr(tmp_path, monkeypatch):
    from train.config.plan import peak_lr
    from train.run.build import build_engine

    monkeypatch.setenv("WORLD_SIZE", "1")
    min_lr = 1e-5
    cfg = debug_cfg(tmp_path, "--optim.min_lr", str(min_lr))
    checked = check_before_start(cfg)
    engine, _, _ = build_engine(cfg, checked.ds_config, torch.device("cpu"), peak_lr(cfg, checked.plan),
                                checked.warmup_steps, checked.total_steps)
    per_epoch = cfg.data.epoch_size // 8
    peak, warmup, total = cfg.optim.blr * 8 / 256, cfg.optim.warmup_epochs * per_epoch, cfg.optim.epochs * per_epoch

    def plain(step: int) -> float:  # MAE's schedule: linear warmup from 0, then half-cycle cosine to min_lr
        if step < warmup:
            return peak * step / warmup
        return min_lr + (peak - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    groups = engine.optimizer.param_groups
    for step in range(1, total + 1):
        engine.schedule.step()
        if step in (warmup // 2, warmup, (warmup + total) // 2, total):
            assert [g["lr"] for g in groups] == pytest.approx([plain(step) * g.get("lr_scale", 1.0) for g in groups],
                                                              rel=1e-9), step
    assert [g["lr"] for g in groups] == pytest.approx([min_lr * g.get("lr_scale", 1.0) for g in groups], rel=1e-9)


def test_mlomae_interleaves_a_validation_batch_on_the_last_micro_batch_of_every_mask_cycle():
    """A mask cycle is level1_steps optimizer steps of `accum` micro-batches each, and the masking
    network steps every mask_every-th cycle: 2 x 2 x 3 = 12 micro-batches between D_val batches."""
    from train.run.build import training_source

    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--config", str(MLOMAE_PRESET),
                      "--mlomae.level1_steps", "2", "--mlomae.mask_every", "3"])
    source = training_source(cfg, 32, BatchPlan(micro=4, accum=2, world=1), 0, 1, torch.device("cpu"))
    every = 2 * 2 * 3  # level1_steps x accum x mask_every
    assert source.val_every == every
    with_val = [i for i in range(1, 2 * every + 1) if "val_image" in next(source)]
    assert with_val == [every, 2 * every]


def test_each_rank_seeds_the_global_rngs_with_the_run_seed_plus_its_rank(tmp_path, monkeypatch):
    """Masks, drop path (torch) and mixup (numpy) draw from the global RNGs: with one seed for all,
    every rank would mask its batch the same way. The Trainer is built as rank 0 and as rank 1 of 2
    and stopped right after it seeded them; what they draw then is a plain manual_seed(seed + rank)'s."""
    import train.run.trainer as trainer
    from train.engine import distributed

    class Seeded(Exception):
        pass

    def draws() -> tuple[list, list, list]:
        return torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)]

    def seed_then_stop(seed: int):
        real_seed(seed)
        raise Seeded(draws())

    real_seed, real_init = trainer.seed_global_rngs, distributed.init
    monkeypatch.setattr(trainer, "seed_global_rngs", seed_then_stop)
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = debug_cfg(tmp_path, "--seed", "7")
    checked = check_before_start(cfg)
    drawn = {}
    for rank in (0, 1):
        monkeypatch.setattr(distributed, "init", lambda rank=rank: (rank, 2, real_init()[2]))
        with pytest.raises(Seeded) as caught:
            trainer.Trainer(cfg, checked)
        drawn[rank] = caught.value.args[0]
    for rank in (0, 1):
        torch.manual_seed(7 + rank)
        np.random.seed(7 + rank)
        random.seed(7 + rank)
        assert drawn[rank] == draws(), rank
    assert all(a != b for a, b in zip(drawn[0], drawn[1]))  # torch, numpy and random each differ across ranks
