"""Communication per optimizer step on paper, for any ds_config, model and world sizes: the bytes
each rank sends by collective, the communication time, the part hidden behind compute and the
exposed part, for the flat-buffer engine (`before`) and PyTorch's FSDP2 / DDP (`after`), with the
assumptions printed (the model: train/estimate/comm_model.py; the configuration's units and batch:
train/estimate/scaling.py).

    python -m tools.scaling --ds_config FILE [FILE ...] [--world_size 8 32 128]
        [--gpus_per_node 8] [--intra_gbytes_s 360] [--inter_gbits_s 800] [--intra_latency_us 10]
        [--inter_latency_us 30] [--mfu 0.4] [--gpu h100] [--markdown] [pretraining options ...]

The model is --model.name when given, else the one a shipped file names (vit_b_... ->
vit_base_patch16), else the pretraining default; the GPU (its dense peak) is --gpu, else the one
the file names, else h100. --markdown prints one table row per file and world size (the table of
docs/PERFORMANCE.md, "Scaling"), then the assumptions. A file with train_batch_size keeps that
global batch at every world size (the micro-batch shrinks when it must); without it, the
micro-batch and accumulation stay and the global batch grows with the ranks.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import sys
from pathlib import Path

from train.config.ds_config import load
from train.config.parsing import parse_args
from train.estimate.comm_model import DDP_BUCKET_BYTES, Compute, Network
from train.estimate.gpus import gpu_in_filename, gpu_named
from train.estimate.scaling import Scaling, scaling

MODELS_IN_FILENAME = {"vit_b_": "vit_base_patch16", "vit_l_": "vit_large_patch16", "vit_h_": "vit_huge_patch14"}
SHORT_MODEL = {"vit_base_patch16": "ViT-B/16", "vit_large_patch16": "ViT-L/16", "vit_huge_patch14": "ViT-H/14"}


def model_in_filename(path: str) -> str | None:
    name = Path(path).name
    return next((model for prefix, model in MODELS_IN_FILENAME.items() if name.startswith(prefix)), None)


def assumptions(network: Network, mfu: float, peaks: dict[str, float]) -> list[str]:
    inter = network.inter_gbits_s / 8
    gpus = ", ".join(f"{name} {peak:g}" for name, peak in peaks.items())
    return [
        f"{network.gpus_per_node} GPUs per node; within a node NCCL bus bandwidth {network.intra_gbytes_s:g} GB/s "
        f"(NVLink); across nodes {network.inter_gbits_s:g} Gb/s of InfiniBand per node ({inter:g} GB/s) shared by "
        f"its GPUs, which bounds a ring spanning nodes: bus bandwidth min({network.intra_gbytes_s:g}, {inter:g}) GB/s",
        "ring collectives: an all-reduce of S bytes sends 2 (W-1)/W S from each rank, a reduce-scatter or "
        f"all-gather (W-1)/W S; each takes latency ({network.intra_latency_us:g} us within a node, "
        f"{network.inter_latency_us:g} us across) + sent / bus bandwidth; one collective at a time on the links",
        f"compute: training FLOPs (3 x forward matmuls of each micro-batch) at {mfu:.0%} MFU of the GPU's "
        f"dense peak (TFLOP/s: {gpus}); forward 1/3 of it (1/4 with activation "
        "checkpointing); the optimizer step not counted",
        "before: the flat-buffer engine, every collective after the backward, blocking (ZeRO-0 fp32 all-reduce; "
        "ZeRO-1 fp32 reduce-scatter; ZeRO-2 compute-dtype reduce-scatter every micro-batch; ZeRO-1-2 weights "
        "all-gathered after the step; ZeRO-3 FSDP2 with fp32 gradient reduction)",
        f"after: DDP (ZeRO-0: bucketed all-reduce inside the backward, reduce_bucket_size or "
        f"{DDP_BUCKET_BYTES / 2**20:g} MiB buckets) and FSDP2 per transformer block + root (ZeRO-1: gather once and "
        "reduce once per step; ZeRO-2: reduce every micro-batch; ZeRO-3: gather in every forward and backward), "
        "gradients in the reduce dtype; collectives inside the backward hide behind the units still to run, "
        "forward all-gathers prefetched one unit ahead; the first all-gather and the last reduction cannot hide",
        "a file's train_batch_size is kept at every world size: where the file's micro-batch times the ranks "
        "exceeds it the micro-batch shrinks (the compute per step falls, the bytes do not); without one the "
        "global batch grows with the ranks",
    ]


def gigabytes(x: float) -> str:
    return f"{x / 1e9:.3f}"


def size(x: float) -> str:
    """Bytes in the unit that reads best (decimal: 1 GB = 1e9 B, as bandwidths are given)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def count(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,.0f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def describe(s: Scaling) -> list[str]:
    """The text report of one world size."""
    world, nodes = s.plan.world, s.estimates["after"].nodes
    lines = [f"{world} GPU{'s' if world > 1 else ''} ({nodes} node{'s' if nodes > 1 else ''}): micro-batch "
             f"{s.plan.micro} x accumulation {s.plan.accum}; compute {ms(s.estimates['after'].compute_s)} per step"
             + (f" ({s.note})" if s.note else "")]
    for engine, est in s.estimates.items():
        parts = ", ".join(f"{label} {size(b)} in {est.calls[label]}" for label, b in est.sent.items())
        lines.append(f"  {engine + ':':7} {size(est.sent_bytes)} sent per rank per step ({parts or 'none'}); "
                     f"communication {ms(est.comm_s)}: {ms(est.overlapped_s)} overlapped, {ms(est.exposed_s)} "
                     f"exposed; efficiency {est.efficiency:.1%}")
    return lines


def header(s: Scaling, cfg, path: str, gpu_name: str) -> list[str]:
    model, step = s.model, s.step
    largest = max(u.params for u in model.units)
    return [f"{cfg.objective} on {cfg.model.name} with {path} on {gpu_name}: ZeRO {step.stage}, {step.precision}, "
            f"gradients reduced in {step.reduce_dtype} after (before: fp32, in the compute dtype for ZeRO-2)",
            f"  {count(model.params)} trained parameters in {len(model.units)} FSDP units ({len(model.blocks)} "
            f"blocks + root; the largest {count(largest)}); {s.flops_per_micro / s.plan.micro / 1e9:.3g} "
            f"training GFLOPs per sample"]


TABLE_HEAD = ("| model | ZeRO | GPUs (nodes) | micro x accum | compute per step (ms) | sent per rank per step (GB), "
              "before / after | exposed communication (ms), before / after | efficiency, before / after |\n"
              "|---|---|---|---|---|---|---|---|")


def row(s: Scaling, model_name: str) -> str:
    b, a = s.estimates["before"], s.estimates["after"]
    return (f"| {SHORT_MODEL.get(model_name, model_name)} | {s.step.stage} | {s.plan.world} ({a.nodes}) | "
            f"{s.plan.micro} x {s.plan.accum} | {a.compute_s * 1e3:.1f} | {gigabytes(b.sent_bytes)} / "
            f"{gigabytes(a.sent_bytes)} | {b.exposed_s * 1e3:.2f} / {a.exposed_s * 1e3:.2f} | "
            f"{b.efficiency:.1%} / {a.efficiency:.1%} |")


def main(argv: list[str] | None = None) -> int:
    from data.cli import Parser

    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds_config", action="extend", nargs="+", required=True, help="one or several DeepSpeed JSONs")
    p.add_argument("--world_size", type=int, nargs="+", default=[8, 32, 128],
                   help="ranks to estimate (default %(default)s)")
    p.add_argument("--gpus_per_node", type=int, default=Network.gpus_per_node,
                   help="GPUs sharing a node's links (default %(default)s)")
    p.add_argument("--intra_gbytes_s", type=float, default=Network.intra_gbytes_s,
                   help="NCCL bus bandwidth within a node, GB/s (default %(default)s: H100 NVLink)")
    p.add_argument("--inter_gbits_s", type=float, default=Network.inter_gbits_s,
                   help="inter-node bandwidth per node, Gb/s, shared by its GPUs (default %(default)s: 4 x 200 Gb/s "
                        "InfiniBand)")
    p.add_argument("--intra_latency_us", type=float, default=Network.intra_latency_us,
                   help="latency of a collective within a node (default %(default)s)")
    p.add_argument("--inter_latency_us", type=float, default=Network.inter_latency_us,
                   help="latency of a collective across nodes (default %(default)s)")
    p.add_argument("--mfu", type=float, default=Compute.mfu,
                   help="model FLOPs utilization of the compute (default %(default)s)")
    p.add_argument("--gpu", default=None, help="whose dense peak (train/estimate/gpus.py; default: the file's, else h100)")
    p.add_argument("--markdown", action="store_true", help="one table row per file and world size")
    a, rest = p.parse_known_args(argv)
    if min(a.world_size) < 1 or a.gpus_per_node < 1 or not 0 < a.mfu <= 1:
        p.error("--world_size and --gpus_per_node must be >= 1, --mfu in (0, 1]")
    if a.intra_gbytes_s <= 0 or a.inter_gbits_s <= 0 or a.intra_latency_us < 0 or a.inter_latency_us < 0:
        p.error("--intra_gbytes_s and --inter_gbits_s must be > 0, the latencies >= 0")
    if a.gpu:
        try:
            gpu_named(a.gpu)
        except ValueError as e:  # an unknown --gpu: the known ones named
            p.error(str(e))
    network = Network(a.gpus_per_node, a.intra_gbytes_s, a.inter_gbits_s, a.intra_latency_us, a.inter_latency_us)
    rows, text, peaks = [], [], {}
    for path in a.ds_config:
        gpu = gpu_named(a.gpu or gpu_in_filename(Path(path).name) or "h100")
        compute = Compute(gpu.peak_tflops, a.mfu)
        peaks[gpu.name] = gpu.peak_tflops
        named = model_in_filename(path)
        options = ["--data.source", "synthetic"]  # no data is read; the options given come after and win
        if "--model.name" not in rest and named:
            options += ["--model.name", named]
        cfg = parse_args(["--ds_config", path, *options, *rest])
        ds = load(path)
        scalings = [scaling(cfg, ds, world, network, compute, gpu.sm80) for world in a.world_size]
        text += header(scalings[0], cfg, path, gpu.name)
        for s in scalings:
            rows.append(row(s, cfg.model.name))
            text += [f"  {line}" for line in describe(s)]
    notes = assumptions(network, a.mfu, peaks)
    if a.markdown:
        print(TABLE_HEAD)
        print("\n".join(rows))
        print()
        print("Assumptions: " + "; ".join(notes) + ".")
    else:
        print("\n".join(text))
        print("assumptions:")
        print("\n".join(f"  - {n}" for n in notes))
    return 0

if __name__ == "__main__":
    from train.run.cli import cli

    cli(lambda: sys.exit(main()))
