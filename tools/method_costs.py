"""Each method's arithmetic per image and optimizer step, by phase, against its baseline's: the
floor its step time can reach, beside which a measured step ratio says how much is overhead.

    python -m tools.method_costs [--micro 8] [--markdown]

Counted by train/estimate/step_flops.py on the meta device (every matmul, convolution and
attention of the forward, the backward and the objective's after-step hook) for the shipped ViT-B/16
presets at 224: MAE, MixedAE, MAE+ (RPE), AdPE (RPE-coord), MLO-MAE, energy. The baseline of
AdPE is MAE+, of every other method MAE. The model is in bf16 as the engine casts it.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import math
import sys
from pathlib import Path

from data.cli import Parser, refuse
from train.config.options import PretrainConfig, section
from train.config.parsing import parse_args
from train.estimate.step_flops import PHASES, step_flops

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train" / "configs"
DS = REPO / "ds_configs" / "vit_b_8xh100_bf16_zero1.json"  # bf16, one node of H100s; the counts do not depend on it
METHODS = {
    "mae": ["--model.name", "vit_base_patch16"],
    "mixedae": ["--config", str(CONFIGS / "mixedae/vit_b.json")],
    "maeplus": ["--config", str(CONFIGS / "maeplus/vit_b.json"), "--config", str(CONFIGS / "maeplus/variants/maeplus_rpe.json")],
    "adpe": ["--config", str(CONFIGS / "maeplus/vit_b.json"), "--config", str(CONFIGS / "maeplus/variants/rpe_coord.json")],
    "mlomae": ["--config", str(CONFIGS / "mlomae/vit_b.json")],
    "energy": ["--config", str(CONFIGS / "energy/vit_b.json")],
}
# each method's debug preset on top of MAE's (the debug model and data), as the tests use them: what a CPU runs
DEBUG_METHODS = {method: [x for preset in presets for x in ("--config", str(CONFIGS / preset))] for method, presets in {
    "mae": ["mae/debug.json"], "mixedae": ["mae/debug.json", "mixedae/debug.json"],
    "maeplus": ["mae/debug.json", "maeplus/debug.json", "maeplus/variants/maeplus_rpe.json"],
    "adpe": ["mae/debug.json", "maeplus/debug.json", "maeplus/variants/rpe_coord.json"],
    "mlomae": ["mae/debug.json", "mlomae/debug.json"], "energy": ["mae/debug.json", "energy/debug.json"],
}.items()}
BASELINE = {"adpe": "maeplus"}  # the rest: mae


def method_configs() -> dict[str, PretrainConfig]:
    """{method: its preset's config}, parsed only: no model is built."""
    return {method: parse_args(["--ds_config", str(DS), "--data.source", "synthetic", *argv])
            for method, argv in METHODS.items()}


def micro_batch_problem(micro: int, configs: dict[str, PretrainConfig]) -> str | None:
    """Why `micro` images cannot make one micro-batch of every method (None when they can): an
    objective that mixes groups of images (MixedAE: g = 1/mix_ratio) needs a multiple of its group."""
    groups = {method: section(cfg).group_size for method, cfg in configs.items()
              if hasattr(section(cfg), "group_size")}
    multiple = math.lcm(*groups.values()) if groups else 1
    if micro % multiple == 0:
        return None
    named = ", ".join(f"{method}'s groups of g = 1/{method}.mix_ratio = {g} images" for method, g in groups.items())
    return (f"--micro {micro} does not split into {named}: give a multiple of {multiple} "
            f"(e.g. --micro {math.ceil(micro / multiple) * multiple})")


def costs(micro: int, configs: dict[str, PretrainConfig] | None = None) -> dict[str, dict[str, float]]:
    """{method: {phase: GFLOP per image, "total": ..., "over_baseline": ...}}, for `configs`
    (default: method_configs())."""
    out = {}
    for method, cfg in (configs or method_configs()).items():
        flops = step_flops(cfg, micro)
        out[method] = {phase: flops[phase] / 1e9 for phase in PHASES}
        out[method]["total"] = sum(out[method][p] for p in PHASES)
    for method, row in out.items():
        row["over_baseline"] = row["total"] / out[BASELINE.get(method, "mae")]["total"]
    return out


def markdown(rows: dict[str, dict[str, float]]) -> str:
    lines = ["| method | forward | backward | after-step hook | total GFLOP per image | over its baseline |",
             "|---|---|---|---|---|---|"]
    for method, r in rows.items():
        lines.append(f"| {method} | {r['forward']:.1f} | {r['backward']:.1f} | {r['after_step']:.1f} | "
                     f"{r['total']:.1f} | {r['over_baseline']:.3f}x {BASELINE.get(method, 'mae')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro", type=int, default=8,
                   help="images per micro-batch counted, a multiple of MixedAE's group of 1/mix_ratio images; "
                        "per-image counts barely move (default: %(default)s)")
    p.add_argument("--markdown", action="store_true", help="a markdown table instead of lines")
    a = p.parse_args(argv)
    if a.micro < 1:
        refuse(f"--micro must be >= 1, got {a.micro}")
    configs = method_configs()
    problem = micro_batch_problem(a.micro, configs)
    if problem:
        refuse(problem)
    rows = costs(a.micro, configs)
    if a.markdown:
        print(markdown(rows))
    else:
        for method, r in rows.items():
            print(f"{method:8s} " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
