"""Run on every rank by tests/distributed/test_engines.py (not collected by pytest).

    engine_check.py OUT_DIR CASE[,CASE ...] [--steps N]

CASE `equality-<objective>-<precision>`: for each ZeRO stage 0-3 and accumulation 1 and 3, the
objective (mae or finetune, on the debug ViT) trains STEPS optimizer steps on a fixed sequence of
global batches of GLOBAL images (with MAE's masking noise and the labels drawn from the step
number, so the data do not depend on the world size: each rank takes its rows of each
micro-batch). Rank 0 writes {"<stage>_<accum>": [the global batch's mean loss per step], "grad_norm":
{"<stage>_<accum>": [the engine's gradient norm per step]}}.
CASE `objective-<name>`: energy or mlomae at 2 ranks, stages 0-3, accumulation 1, with their
own random draws (seeded alike for every stage): the same per-step mean losses.
CASE `sweep`: every registered objective's debug preset, train/configs/<name>/debug.json (and
SWEEP_SPECIAL: AdPE, MAE+ with the RPE-coordinate adversary; fine-tuning and the linear probe, with
no preset of their own, on MAE's; the linear probe on ZeRO-0 only, LARS needing whole tensors)
through the real loop and data source, 2 optimizer steps on every stage: rank 0 writes
{"<objective> <stage>": [losses], ...}.
CASE `float8-mae`: every stage with run.float8, and stage 0 without, on the same batches: rank 0
writes {"<stage>": [losses], "0 plain": [losses]}.
CASE `compile-mae`: every stage, accumulation 1, the blocks compiled (run.compile) and eager, on
the same batches: rank 0 writes {"<stage> <compiled|eager>": [losses], "<stage> graphs": [graphs
dynamo compiled after the first step, after the last]}.
CASE `poison`: every stage; rank 1's loss is NaN in step 2: every rank skips it, the weights and
the optimizer's moments are unchanged, and the skip is counted.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rank_end import end_rank

from model.objectives import list_objectives
from train.config.ds_config import resolve
from train.config.parsing import parse_args
from train.engine import distributed
from train.run.build import build_engine

REPO = Path(__file__).resolve().parents[2]
STAGES = (0, 1, 2, 3)
GLOBAL = 36  # divisible by micro x accumulation x ranks for ranks 1-4 and accumulation 1 and 3
ARGS = {
    "mae": ["--config", str(REPO / "train/configs/mae/debug.json")],
    "finetune": ["--config", str(REPO / "train/configs/mae/debug.json"), "--objective", "finetune",
                 "--finetune.num_classes", "10", "--finetune.mixup", "0", "--finetune.cutmix", "0"],
    "energy": ["--config", str(REPO / "train/configs/mae/debug.json"), "--objective", "energy",
               "--energy.corruption", "denoise"],
    "mlomae": ["--config", str(REPO / "train/configs/mae/debug.json"), "--objective", "mlomae",
               "--mlomae.num_classes", "10", "--mlomae.decoder_dim", "32", "--mlomae.decoder_depth", "1",
               "--mlomae.decoder_heads", "2", "--mlomae.mask_hidden", "16"],
}


def global_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {"image": torch.randn(GLOBAL, 1, 28, 28, generator=g), "mask_noise": torch.rand(GLOBAL, 49, generator=g),
            "label": torch.randint(0, 10, (GLOBAL,), generator=g),
            "val_image": torch.randn(GLOBAL, 1, 28, 28, generator=g),
            "val_label": torch.randint(0, 10, (GLOBAL,), generator=g)}


def engine_for(out: Path, objective: str, stage: int, accum: int, world: int, precision: str = "fp32",
               options: tuple[str, ...] = ()):
    ds_file = out / f"ds_{objective}_{stage}_{accum}_{precision}.json"
    ds = {"train_batch_size": GLOBAL, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}
    if dist.get_rank() == 0:
        ds_file.write_text(json.dumps(ds))
    dist.barrier()
    cfg = parse_args(["--ds_config", str(ds_file), *ARGS[objective], *options, "--output_dir", str(out / "run")])
    ds, plan = resolve(cfg, world)
    device = torch.device("cpu")
    engine, _, _ = build_engine(cfg, ds, device, peak_lr=2e-3, warmup_steps=1, total_steps=20)
    return engine, plan


def train(engine, plan, steps: int, rank: int, world: int, keys, poison_step: int = 0, first: int = 1,
          norms: list[float] | None = None) -> list[float]:
    """Per optimizer step (`first` .. `first + steps - 1`): each rank's rows of each micro-batch; the
    global mean loss (and the engine's gradient norm of the step, appended to `norms`)."""
    losses = []
    for step in range(first, first + steps):
        batch = global_batch(step)
        total = torch.zeros(())
        seen = []
        for m in range(plan.accum):
            rows = slice((m * world + rank) * plan.micro, (m * world + rank + 1) * plan.micro)
            micro = {k: batch[k][rows].to(engine.dtype) if k.endswith("image") else batch[k][rows] for k in keys}
            seen.append(micro)
            loss = engine(micro)["loss"]
            total += loss.detach().float() / plan.accum
            if step == poison_step and rank == 1:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
        engine.after_optimizer_step(engine.get_lr(), seen)
        if norms is not None:
            norms.append(engine.grad_norm.item())
        dist.all_reduce(total)
        losses.append((total / world).item())
    return losses


def equality(out: Path, objective: str, precision: str, steps: int) -> dict:
    rank, world, _ = distributed.init()
    keys = ("image", "mask_noise") if objective == "mae" else ("image", "label")
    result = {}
    for stage in (0, 1, 2, 3):
        for accum in (1, 3):
            torch.manual_seed(0)
            engine, plan = engine_for(out, objective, stage, accum, world, precision)
            norms = result.setdefault("grad_norm", {}).setdefault(f"{stage}_{accum}", [])
            result[f"{stage}_{accum}"] = train(engine, plan, steps, rank, world, keys, norms=norms)
    return result


def compiled_and_eager(out: Path, steps: int) -> dict:
    from train.run.compile_watch import compiled_graphs

    rank, world, _ = distributed.init()
    result = {}
    for stage in STAGES:
        for mode in ("eager", "compiled"):
            torch.manual_seed(0)
            options = ("--run.compile", "true") if mode == "compiled" else ()
            engine, plan = engine_for(out, "mae", stage, 1, world, options=options)
            losses = train(engine, plan, 1, rank, world, ("image", "mask_noise"))
            after_first = compiled_graphs()
            losses += train(engine, plan, steps - 1, rank, world, ("image", "mask_noise"), first=2)
            result[f"{stage} {mode}"] = losses
            if mode == "compiled":
                result[f"{stage} graphs"] = [after_first, compiled_graphs()]
    return result


def float8_stages(out: Path, steps: int) -> dict:
    """MAE with run.float8 on every stage, and once without (stage 0): each rank casts its own
    half-batch with its own scales, so the stages agree with each other, not with one rank."""
    rank, world, _ = distributed.init()
    result = {}
    for stage, options in [*((s, ("--run.float8", "true")) for s in STAGES), ("0 plain", ())]:
        torch.manual_seed(0)
        engine, plan = engine_for(out, "mae", int(str(stage)[0]), 1, world, options=options)
        result[str(stage)] = train(engine, plan, steps, rank, world, ("image", "mask_noise"))
    return result


def objective_stages(out: Path, objective: str, steps: int) -> dict:
    rank, world, _ = distributed.init()
    keys = ("image", "label", "val_image", "val_label") if objective == "mlomae" else ("image",)
    result = {}
    for stage in STAGES:
        torch.manual_seed(100 + rank)  # the objective's own draws (corruptions, masks): alike for every stage
        engine, plan = engine_for(out, objective, stage, 1, world)
        torch.manual_seed(100 + rank)
        result[str(stage)] = train(engine, plan, steps, rank, world, keys)
    return result


PRESETS = REPO / "train" / "configs"
# the sweep's runs besides each registered objective's own debug preset (which suffices for a new method)
SWEEP_SPECIAL = {
    "adpe": ["--config", str(PRESETS / "maeplus/debug.json"), "--config", str(PRESETS / "maeplus/variants/rpe_coord.json")],
    "finetune": ["--config", str(PRESETS / "mae/debug.json"), "--objective", "finetune", "--finetune.num_classes", "10"],
    "linprobe": ["--config", str(PRESETS / "mae/debug.json"), "--objective", "linprobe", "--linprobe.num_classes", "10",
                 "--optim.name", "lars"],
}
SWEEP = {**{name: ["--config", str(PRESETS / name / "debug.json")] for name in list_objectives()
            if (PRESETS / name / "debug.json").is_file()}, **SWEEP_SPECIAL}


def sweep(out: Path) -> dict:
    from train.run.build import training_source
    from train.run.loop import LoopSettings, LoopState, run

    rank, world, device = distributed.init()
    result = {}
    for name, args in SWEEP.items():
        for stage in ((0,) if name == "linprobe" else (0, 1, 2, 3)):
            ds_file = out / f"ds_sweep_{name}_{stage}.json"
            if rank == 0:
                ds_file.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                               "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}}))
            dist.barrier()
            cfg = parse_args(["--ds_config", str(ds_file), *args, "--output_dir", str(out / "run")])
            ds, plan = resolve(cfg, world)
            engine, objective, _ = build_engine(cfg, ds, device, peak_lr=1e-3, warmup_steps=0, total_steps=10)
            data = training_source(cfg, objective.encoder.img_size, plan, rank, world, device)
            losses = []
            run(engine, data, LoopSettings(2, 1, 10**9, plan.global_batch), LoopState(), device, engine.dtype,
                lambda step, metrics: losses.append(metrics["loss"]), lambda step: None)
            result[f"{name} {stage}"] = losses
    return result


def poison(out: Path, steps: int) -> dict:
    rank, world, _ = distributed.init()
    result = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        engine, plan = engine_for(out, "mae", stage, 1, world)
        train(engine, plan, 1, rank, world, ("image", "mask_noise"))
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                   for k, v in engine.master_weights().items()}
        moments = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                   for k, v in engine.optimizer.state[next(iter(engine.master_weights().values()))].items()}
        losses = train(engine, plan, 1, rank, world, ("image", "mask_noise"), poison_step=1)
        after = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in engine.master_weights().items()}
        after_moments = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                         for k, v in engine.optimizer.state[next(iter(engine.master_weights().values()))].items()}
        state = {k: v.item() for k, v in engine.device_state().items()}
        result[str(stage)] = {"weights_unchanged": all(torch.equal(after[k], weights[k]) for k in weights),
                              "moments_unchanged": all(torch.equal(after_moments[k], moments[k]) for k in moments),
                              "skipped": state["skipped_steps"], "finite_loss": losses[0] == losses[0]}
        next_losses = train(engine, plan, 1, rank, world, ("image", "mask_noise"))
        after_next = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in engine.master_weights().items()}
        result[str(stage)]["next_step_applied"] = not all(torch.equal(after_next[k], weights[k]) for k in weights)
        result[str(stage)]["next_loss"] = next_losses[0]
    return result


def main(out: Path, cases: list[str], steps: int) -> None:
    torch.set_num_threads(1)
    for case in cases:
        kind, _, rest = case.partition("-")
        if kind == "equality":
            objective, precision = rest.split("-")
            result = equality(out, objective, precision, steps)
        elif kind == "objective":
            result = objective_stages(out, rest, steps)
        elif kind == "sweep":
            result = sweep(out)
        elif kind == "compile":
            result = compiled_and_eager(out, steps)
        elif kind == "float8":
            result = float8_stages(out, steps)
        else:
            result = poison(out, steps)
        if dist.get_rank() == 0:
            (out / f"{case}_{dist.get_world_size()}.json").write_text(json.dumps(result))
    end_rank()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 3
    main(Path(args[0]), args[1].split(","), steps)
