"""Kernel launches, collectives and host-device syncs per training step and phase, through the real
engine and loop, beside the plain-PyTorch MAE loop (tools/mae_baseline.py) at the same shapes;
optionally the host time per step of both (train/estimate/counting.py says what is counted and how).

    python -m tools.census --ds_config FILE [--config PRESET] [--key value ...] [census options]

Census options (the rest are train/pretrain.py options; data.source defaults to synthetic here):
    --steps N (4)             optimizer steps run: the first warms up, the last logs, those between are reported
    --width W (0)             encoder (and decoder, where the objective has one) width W at the model's depth
                              and heads: the same tensors and ops at negligible compute (0 = the model's own)
    --micro M (0)             the ds_config's micro-batch set to M, its global batch to M x ranks (0 = as given)
    --zero_stage S            the ds_config's ZeRO stage set to S (0-3; default as given)
    --baseline KIND (fused)   the baseline's AdamW: fused | foreach (torch's CUDA default) | none
    --deepspeed               also DeepSpeed's own engine training our objective with the same ds_config
                              (tools/deepspeed_step.py: the step before train/engine/)
    --host_time R (0)         then R rounds of 10 steps of ours and 10 of the baseline, alternating, nothing
                              counted: the median milliseconds per step of each (on CPU with one thread)
    --json FILE               where the record goes (default runs/census/census_<objective>_<model>_<time>.json)
    --record                  write it into benchmarks/results/ instead (the committed records; or --json there)

With `--run.compile true` every ViT block compiles in the warm-up step and a launch is a kernel
inductor generated or an aten op outside those kernels (the record's `launches` says which count
it holds; train/estimate/counting.py).

The record holds device, versions, commit, the final ds_config, shapes, and per phase of a
reported step: launches, comm, syncs (the worst reported step), the ops behind the launches,
and every sync with the line that made it; on several ranks (under `deepspeed`), rank 0 writes
it with every rank's counts (`per_rank`: a rank whose shard holds fewer parameter groups runs
fewer optimizer kernels).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import dataclasses
import json
import statistics
import sys
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path

import torch

from data.folders import unwritable_file
from train.config.errors import ConfigError
from train.config.flags import pop_flags
from train.config.options import PretrainConfig, encoder_img_size, section
from train.config.parsing import help_text, parse_args
from train.estimate.counting import PHASES, Tally, counting, kernels_profiled
from train.run.cli import cli

CENSUS_FLAGS = {"--steps": int, "--width": int, "--micro": int, "--zero_stage": int, "--baseline": str, "--deepspeed": None,
                "--host_time": int, "--json": str, "--record": None}
HOST_TIME_STEPS = 10
# what a record's launches are (train/estimate/counting.py); with run.compile every ViT block runs as a compiled graph
LAUNCHES_EAGER = "aten ops that run a kernel"
LAUNCHES_COMPILED = "inductor kernels + extern aten ops"


def split_argv(argv: list[str]) -> tuple[dict, list[str]]:
    """(census options, run options with data.source synthetic unless given)."""
    opts = {"steps": 4, "width": 0, "micro": 0, "zero_stage": -1, "baseline": "fused", "deepspeed": False,
            "host_time": 0, "json": "", "record": False}
    found, rest = pop_flags(argv, CENSUS_FLAGS)
    opts.update(found)
    if opts["json"] and (problem := unwritable_file(Path(opts["json"]))):
        raise ConfigError(f"--json {opts['json']} {problem}")
    if opts["steps"] < 3:
        raise ConfigError("--steps must be >= 3: a warm-up step, a reported step and a logging step")
    if opts["baseline"] not in ("fused", "foreach", "none"):
        raise ConfigError(f"--baseline takes fused, foreach or none, got {opts['baseline']!r}")
    if not any(a.startswith("--data.source") for a in rest):
        rest = ["--data.source", "synthetic", *rest]
    if opts["zero_stage"] not in (-1, 0, 1, 2, 3):
        raise ConfigError(f"--zero_stage takes 0, 1, 2 or 3, got {opts['zero_stage']}")
    if opts["micro"] or opts["zero_stage"] >= 0:
        rest = with_micro(rest, opts["micro"], opts["zero_stage"])
    return opts, rest


def with_micro(argv: list[str], micro: int, stage: int = -1) -> list[str]:
    """argv with --ds_config pointing at a copy of the file, in a temporary folder, whose micro-batch
    is `micro` and global batch micro x ranks (no accumulation; `micro` 0: as given) and whose ZeRO
    stage is `stage` (-1: as given)."""
    import os
    import tempfile

    from train.engine.distributed import world_size_from_env

    i = argv.index("--ds_config") + 1
    ds = json.loads(Path(argv[i]).read_text())
    if micro:
        ds = {k: v for k, v in ds.items() if k != "gradient_accumulation_steps"}
        ds.update(train_micro_batch_size_per_gpu=micro, train_batch_size=micro * world_size_from_env())
    if stage >= 0:
        ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": stage}
    folder = Path(tempfile.mkdtemp(prefix="census_"))
    path = folder / f"{Path(argv[i]).stem}_micro{micro}_stage{stage}_rank{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps(ds))
    return [*argv[:i], str(path), *argv[i + 1:]]


def narrowed(argv: list[str], width: int) -> tuple[PretrainConfig, dict]:
    """(the config of `argv`, with the objective's decoder at `width` where it has one; encoder
    overrides with embed_dim `width`); `width` 0 changes nothing."""
    from train.bench import NOT_READ

    cfg = parse_args(argv, NOT_READ)
    if not width:
        return cfg, {}
    if any(f.name == "decoder_dim" for f in dataclasses.fields(section(cfg))):
        cfg = parse_args([*argv, f"--{cfg.objective}.decoder_dim", str(width)], NOT_READ)
    return cfg, {"embed_dim": width}


@dataclasses.dataclass
class Subject:
    """One training loop to count: `run(phase, n)` runs n optimizer steps with the phase marker."""
    name: str
    run: object
    accum: int


def our_subject(cfg: PretrainConfig, arch: dict) -> tuple[Subject, dict]:
    """The real engine and loop (train/run/build.py, train/run/loop.py), one optimizer step per call; and
    what the record says of the run (ds_config, batch, dtype, device)."""
    from train.config.ds_config import resolve
    from train.config.plan import peak_lr, schedule_steps
    from train.engine import distributed
    from train.run.build import build_engine, training_source
    from train.run.loop import LoopSettings, LoopState, run

    cuda = torch.cuda.is_available()
    # on CPU the census counts a GPU's configuration as if the machine had one (fp16 included)
    ds_config, plan = resolve(cfg, distributed.world_size_from_env(), cuda=True if not cuda else None,
                              bf16_ok=True if not cuda else None)
    rank, world, device = distributed.init()
    _, total, warmup = schedule_steps(cfg, plan)
    engine, objective, _ = build_engine(cfg, ds_config, device, peak_lr(cfg, plan), warmup, total, arch)
    dtype = engine.dtype
    data = training_source(cfg, objective.encoder.img_size, plan, rank, world, device)
    state = LoopState()

    def steps(phase, n: int) -> None:  # one log window: the loop logs (reads its window) at the n-th step only
        settings = LoopSettings(state.step + n, 10**12, 10**12, plan.global_batch)
        run(engine, data, settings, state, device, dtype, lambda s, m: None, lambda s: None, phase=phase)

    run_info = {"ds_config": ds_config, "batch": dataclasses.asdict(plan) | {"global": plan.global_batch},
                "peak_lr": peak_lr(cfg, plan),
                "dtype": str(dtype).removeprefix("torch."), "device": str(device), "world_size": world,
                "zero_stage": engine.stage, "tensors": sum(1 for p in objective.parameters() if p.requires_grad),
                "optimizer_groups": len(engine.optimizer.param_groups)}
    return Subject("ours", steps, plan.accum), run_info


def baseline_model(cfg: PretrainConfig, arch: dict, micro: int, device: torch.device):
    """tools/mae_baseline.py's MAE with our model's shapes (`arch`: model_arch overrides; a narrowed
    width narrows its decoder too) and MAE settings, and synthetic data at `micro` per step."""
    from data.synthetic import SyntheticImages
    from model.registry import model_arch
    from tools.mae_baseline import BaselineMAE

    a = model_arch(cfg.model.name, **arch)
    img = encoder_img_size(cfg)
    mae = cfg.mae
    torch.manual_seed(0)
    model = BaselineMAE(img, a["patch_size"], cfg.model.in_chans, a["embed_dim"], a["depth"], a["num_heads"],
                        arch.get("embed_dim") or mae.decoder_dim, mae.decoder_depth, mae.decoder_heads,
                        mae.mask_ratio, mae.norm_pix_loss).to(device)
    return model, SyntheticImages(micro, img, cfg.model.in_chans, 10, cfg.seed, 0, device)


def baseline_subject(cfg: PretrainConfig, arch: dict, micro: int, dtype: torch.dtype, device: torch.device,
                     fused: bool) -> Subject:
    """tools/mae_baseline.py's step on baseline_model."""
    from tools.mae_baseline import BaselineStep

    model, data = baseline_model(cfg, arch, micro, device)
    base = BaselineStep(model, data, dtype, device, fused=fused or None)

    def steps(phase, n: int) -> None:
        for _ in range(n):
            base(phase)

    return Subject(f"baseline ({'fused' if fused else 'foreach'} AdamW)", steps, 1)


def deepspeed_subject(cfg: PretrainConfig, arch: dict, run_info: dict, device: torch.device) -> Subject:
    """DeepSpeed's engine on our objective (tools/deepspeed_step.py), the same ds_config and data."""
    from tools.deepspeed_step import DeepSpeedStep
    from train.config.ds_config import BatchPlan
    from train.run.build import training_source

    plan = BatchPlan(**{k: run_info["batch"][k] for k in ("micro", "accum", "world")})
    rank = torch.distributed.get_rank()
    data = training_source(cfg, encoder_img_size(cfg), plan, rank, plan.world, device)
    step = DeepSpeedStep(cfg, run_info["ds_config"], data, device, run_info["peak_lr"], arch)

    def steps(phase, n: int) -> None:
        for _ in range(n):
            step(phase)

    return Subject("DeepSpeed's engine", steps, step.accum)


def count(subject: Subject, steps: int, compiled: bool = False) -> dict:
    """Run `steps` optimizer steps, the first (warm-up: with `compiled`, the graphs compile in it)
    uncounted and the rest counting everything: the worst of the steps between the first and the
    last (the loop's log step), the log step's extra, the ops and the syncs."""
    tally = Tally()
    tally.accum = subject.accum
    with kernels_profiled() if compiled else nullcontext():
        subject.run(tally, 1)
        with counting(tally, compiled) as syncs:
            subject.run(tally, steps - 1)
    reported = range(2, steps)
    per_step = {s: tally.per_step(s) for s in reported}
    worst = max(reported, key=lambda s: (per_step[s]["total"]["launches"], per_step[s]["total"]["syncs"]))
    return {"per_phase": per_step[worst], "step": worst, "overlap": overlap(tally, worst),
            "steps": {s: per_step[s]["total"] for s in reported},
            "top_ops": {p: tally.top_ops(worst, p) for p in PHASES},
            "syncs": [dataclasses.asdict(r) for r in syncs.records if r.step in reported],
            "log_step_syncs": [dataclasses.asdict(r) for r in syncs.records if r.step == steps]}


def overlap(tally: Tally, step: int) -> dict:
    """Where a step's collectives were issued: the gradient reductions (all-reduce, reduce-scatter in
    the backward and the optimizer step) inside autograd's backward or after it returned, and how many
    elements those after it reduce; every collective of the step, in order."""
    mine = [c for c in tally.collectives if c.step == step]
    reductions = [c for c in mine if c.reduces and c.phase in ("backward", "step")]
    after = [c for c in reductions if not c.in_backward]
    return {"reductions_in_backward": sum(c.in_backward for c in reductions), "reductions_after_backward": len(after),
            "elements_reduced_after_backward": sum(c.elements for c in after),
            "collectives": [dataclasses.asdict(c) for c in mine]}


def host_time(subjects: list[Subject], rounds: int) -> dict[str, float]:
    """Median ms per step of each subject over `rounds` alternating rounds of HOST_TIME_STEPS steps."""
    from train.run.loop import no_phases

    times: dict[str, list[float]] = {s.name: [] for s in subjects}
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # narrow widths: a second thread only contends
    try:
        for _ in range(rounds):
            for s in subjects:
                start = time.perf_counter()
                s.run(no_phases, HOST_TIME_STEPS)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times[s.name].append((time.perf_counter() - start) / HOST_TIME_STEPS * 1e3)
    finally:
        torch.set_num_threads(threads)
    return {name: statistics.median(t) for name, t in times.items()} | {"rounds": rounds}


def census(argv: list[str]) -> dict:
    """The record of one census (see the module docstring)."""
    from model.layer_norm import norms_as_on_cuda

    with norms_as_on_cuda():  # on the CPU too: the kernels of CUDA's path are counted
        return _census(argv)


def _census(argv: list[str]) -> dict:
    from train.bench import cpu_name, versions
    from train.run.folder import git_commit

    opts, rest = split_argv(argv)
    cfg, arch = narrowed(rest, opts["width"])
    ours, run_info = our_subject(cfg, arch)
    device = torch.device(run_info["device"])
    subjects = [ours]
    if opts["baseline"] != "none":
        dtype = getattr(torch, run_info["dtype"])
        subjects.append(baseline_subject(cfg, arch, run_info["batch"]["micro"], dtype, device,
                                         opts["baseline"] == "fused"))
    if opts["deepspeed"]:
        subjects.append(deepspeed_subject(cfg, arch, run_info, device))
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_commit(),
              "versions": versions(), "machine": torch.cuda.get_device_name() if device.type == "cuda" else cpu_name(),
              "threads": torch.get_num_threads(), "command": " ".join(["python -m tools.census", *argv]),
              "census": opts, "objective": cfg.objective,
              "model": cfg.model.name, "img_size": encoder_img_size(cfg), "arch_overrides": arch, **run_info,
              "launches": LAUNCHES_COMPILED if cfg.run.compile else LAUNCHES_EAGER,
              "counts": {s.name: count(s, opts["steps"], cfg.run.compile) for s in subjects}}
    if opts["host_time"]:
        record["host_time_ms"] = host_time(subjects, opts["host_time"])
    return record


def table(record: dict) -> str:
    """The per-phase counts of every subject, one row per phase."""
    names = list(record["counts"])
    head = "phase".ljust(10) + "".join(f"{n[:34]:>36}" for n in names)
    lines = [f"{record['objective']} {record['model']} {record['img_size']} px, micro-batch "
             f"{record['batch']['micro']} x {record['batch']['accum']}, {record['dtype']}, ZeRO "
             f"{record['zero_stage']}, {record['world_size']} rank(s), {record['tensors']} trained tensors",
             f"launches ({record['launches']}) / comm / syncs per optimizer step", head]
    for phase in (*PHASES, "total"):
        row = phase.ljust(10)
        for n in names:
            c = record["counts"][n]["per_phase"][phase]
            row += f"{c['launches']:>24} / {c['comm']:>3} / {c['syncs']:>3}"
        lines.append(row)
    for n in names:
        o = record["counts"][n].get("overlap", {})
        if o.get("reductions_in_backward") or o.get("reductions_after_backward"):
            lines.append(f"{n}: gradient reductions {o['reductions_in_backward']} inside the backward, "
                         f"{o['reductions_after_backward']} after it ({o['elements_reduced_after_backward']:,} elements)")
    if "host_time_ms" in record:
        lines.append("host time per step (median ms): " + ", ".join(
            f"{n}: {v:.1f}" for n, v in record["host_time_ms"].items() if n != "rounds"))
    return "\n".join(lines)


def record_path(opts: dict, objective: str, model: str) -> Path:
    """--json, else a new file in runs/census/ (git-ignored), or in benchmarks/results/ (the
    committed records) with --record."""
    if opts["json"]:
        return Path(opts["json"])
    from train.run.folder import REPO

    folder = REPO / ("benchmarks/results" if opts["record"] else "runs/census")
    return folder / f"census_{objective}_{model}_{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}.json"


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    asked, _ = pop_flags(argv, {"--help": None, "-h": None})
    if asked:
        print(__doc__ + "\n" + help_text())
        raise SystemExit(0)
    record = census(argv)
    if record["world_size"] > 1:  # every rank's counts in rank 0's record (their shards may differ)
        ranks = [None] * record["world_size"]
        torch.distributed.all_gather_object(ranks, {n: c["per_phase"] for n, c in record["counts"].items()})
        record["per_rank"] = ranks
        if torch.distributed.get_rank() != 0:
            return Path(record["census"]["json"] or ".")
    print(table(record))
    out = record_path(record["census"], record["objective"], record["model"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    cli(main)
