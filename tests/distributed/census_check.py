"""Run on every rank by tests/distributed/test_overlap.py (not collected by pytest).

    census_check.py OUT_DIR

The census (tools/census.py) of MAE at ViT-B depth and heads, width 48, micro-batch 2 per rank, on
each ZeRO stage 0-3 of the shipped A100 bf16 file, with the plain-PyTorch loop beside the first;
rank 0 writes {stage: {"ranks": [every rank's per-phase counts], "overlap": [every rank's], ...}}.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tools.census import census
from rank_end import end_rank

REPO = Path(__file__).resolve().parents[2]


def main(out: Path) -> None:
    torch.set_num_threads(1)
    base = json.loads((REPO / "ds_configs" / "vit_b_8xa100_bf16_zero1.json").read_text())
    result = {}
    for stage in (0, 1, 2, 3):
        ds = {**base, "zero_optimization": {"stage": stage}}
        path = out / f"ds_{stage}.json"
        if not dist.is_initialized() or dist.get_rank() == 0:
            path.write_text(json.dumps(ds))
        if dist.is_initialized():
            dist.barrier()
        record = census(["--ds_config", str(path), "--model.name", "vit_base_patch16", "--width", "48", "--micro", "2",
                         "--steps", "3", "--baseline", "fused" if stage == 0 else "none"])
        mine = {"counts": {n: c["per_phase"] for n, c in record["counts"].items()},
                "overlap": record["counts"]["ours"]["overlap"], "syncs": record["counts"]["ours"]["syncs"]}
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        result[stage] = {"ranks": ranks, "engine": record["zero_stage"], "world": record["world_size"]}
    if dist.get_rank() == 0:
        (out / "census.json").write_text(json.dumps(result, default=str))
    end_rank()


if __name__ == "__main__":
    main(Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))
