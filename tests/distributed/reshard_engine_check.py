"""Run under the deepspeed launcher by test_world_size_change.py (not collected by pytest).

    reshard_engine_check.py OUT_DIR train|resume NAME=STAGE...

A debug MAE trains on a fixed sequence of global batches (16 images + masking noise per step,
generated from the step number, so the data do not depend on the world size). `train` (2 ranks,
micro 8 x accumulation 1) writes a checkpoint after step 3 and records the losses of steps 4-5;
`resume` (1 rank, micro 8 x accumulation 2, the same global batch, any ZeRO stage) loads that
checkpoint and trains steps 4-5 on the same batches. Equal losses mean weights, Adam moments,
step count and schedule all carried over. Each NAME=STAGE is one case, in OUT_DIR/NAME, all in
one process group: the launcher and the ranks start once for every case.
"""
import json
import sys
from pathlib import Path

import torch
from rank_end import end_rank

from train.config.ds_config import resolve
from train.config.parsing import parse_args
from train.engine import checkpoint, distributed
from train.run.build import build_engine

REPO = Path(__file__).resolve().parents[2]
GLOBAL, MICRO, STEPS, SAVE_AT = 16, 8, 5, 3


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL, 1, 28, 28, generator=g), torch.rand(GLOBAL, 49, generator=g)


def main(out: Path, phase: str, stage: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ds_file = out / f"ds_{stage}.json"
    ds_file.write_text(json.dumps({"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": MICRO,
                                   "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}))
    cfg = parse_args(["--ds_config", str(ds_file), "--config", str(REPO / "train/configs/mae/debug.json"),
                      "--output_dir", str(out / "run")])
    ds, plan = resolve(cfg, distributed.world_size_from_env())
    tag = out / "run" / "checkpoints" / checkpoint.tag_for(SAVE_AT)
    rank, world, device = distributed.init()
    engine, objective, _ = build_engine(cfg, ds, device, peak_lr=2e-3, warmup_steps=2, total_steps=20)
    first = 1
    if phase == "resume":
        client = checkpoint.load(engine, tag, rank, world, cfg.seed)
        first = client["step"] + 1
    losses = {}
    for step in range(first, STEPS + 1):
        images, noise = global_batch(step)
        total = torch.zeros(())
        for m in range(plan.accum):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            loss = engine({"image": images[rows], "mask_noise": noise[rows]})["loss"]
            engine.backward(loss)
            engine.step()
            total += loss.detach() / plan.accum
        if world > 1:
            torch.distributed.all_reduce(total)
            total /= world
        losses[step] = total.item()
        if phase == "train" and step == SAVE_AT:
            meta = {"zero_stage": engine.stage, "objective": "mae", "config": {},
                    "global_batch": plan.global_batch}
            checkpoint.save(engine, tag.parent, step, {"step": step, "data": [{}] * world}, rank, world, meta)
    if rank == 0:
        (out / f"losses_{phase}.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    for case in args[2:]:
        name, stage = case.split("=")
        main(Path(args[0]) / name, args[1], int(stage))
    end_rank()
