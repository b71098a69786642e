"""Throughput benchmark of any method / model / ds_config, through the real engine and loop.

    python -m train.bench --ds_config FILE [--config PRESET] [--key value ...] [bench options]
    deepspeed --module train.bench ...                        # several GPUs: images/s of the whole job

Bench options (the rest are train/pretrain.py options; data.source synthetic or shards):
    --steps N (20)            optimizer steps timed, after
    --warmup N (5)            untimed steps (allocator, cuDNN / compile warm-up)
    --activation_checkpointing on|off   override the ds_config's section
    --loader_only             time the data source alone (shards: decode + crop in the workers)
    --gpu NAME                the GPU whose dense peak MFU is taken against (default: detected)
    --out_dir DIR (runs/bench)  where the record goes (runs/ is git-ignored)
    --record                  write the record into benchmarks/results/ instead (the committed records)
    --allow_cpu               run on a CPU a benchmark estimated to take longer than 5 minutes there
                              (without it, such a run is refused with the estimate; a shorter one says it first)
(`--run.compile true` compiles the blocks; `--data.decode cpu_draft|nvjpeg` picks the decoder.)

Reports images/s, step time, training TFLOP/s per GPU from the FLOPs of the objective's actual
token counts (train/estimate/step_flops.py `training_flops`: 3 x the forward matmul FLOPs of what
trains x accumulation, train/estimate/costs.py; for energy and MLO-MAE, whose steps compute more than
their modules' forwards show, counted by running the optimizer step on the meta device), MFU against the GPU's dense peak (train/estimate/gpus.py), peak memory (CUDA: max
allocated; CPU: the process's peak RSS), and with --loader_only images/s of the loader and per
worker process (each runs one thread). JSON with device, versions, commit, the final ds_config
and every option goes to --out_dir (benchmarks/results/ with --record). Timings come from the
loop's own log step (one host sync per window), so they include data loading and every objective
hook. On a CPU the run first says how long it takes at least (train/estimate/cpu_time.py).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import json
import os
import platform
import resource
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from data.folders import unwritable
from data.progress import Progress
from data.source import DECODED_CHANNELS, check_source
from train.config.ds_config import resolve, zero_stage
from train.config.errors import ConfigError
from train.config.flags import pop_flags
from train.config.objective_fits import check_objective_fits
from train.config.options import encoder_img_size
from train.config.parsing import help_text, parse_args, to_dict
from train.config.plan import peak_lr, schedule_steps
from train.engine import distributed
from train.estimate.costs import profile_config
from train.estimate.step_flops import training_flops
from train.estimate.cpu_time import check_cpu_time
from train.estimate.gpus import current_gpu, gpu_named
from train.estimate.memory import check_floor
from train.run.build import build_engine, training_source
from train.run.cli import cli
from train.run.folder import REPO, git_commit
from train.run.loop import LoopSettings, LoopState, run

# Run options a benchmark does not read (it times one window of --steps after --warmup, writes its
# record to --out_dir and nothing else): refused when set (train/config/options.py check_read)
NOT_READ = {
    **{k: "a benchmark writes no run folder, only its record (--out_dir)" for k in (
        "output_dir", "resume", "run.overwrite", "run.export", "run.tensorboard", "run.progress", "run.ckpt_every",
        "run.keep_checkpoints", "run.keep_every_epochs", "run.vis_every")},
    "run.max_steps": "it runs --warmup then --steps steps", "run.log_every": "it times one window of --steps",
    "run.eval_every": "it evaluates nothing", "run.max_nonfinite_steps": "it does not stop on skipped steps",
}
BENCH_FLAGS = {"--steps": int, "--warmup": int, "--activation_checkpointing": str, "--gpu": str, "--out_dir": str,
               "--loader_only": None, "--record": None, "--allow_cpu": None}
RECORDS = REPO / "benchmarks" / "results"  # committed: written only with --record
SCRATCH = REPO / "runs" / "bench"  # git-ignored: the default


def split_argv(argv: list[str]) -> tuple[dict, list[str]]:
    """(bench options, pretrain options)."""
    opts = {"steps": 20, "warmup": 5, "activation_checkpointing": None, "gpu": None, "loader_only": False,
            "out_dir": "", "record": False, "allow_cpu": False}
    try:
        found, rest = pop_flags(argv, BENCH_FLAGS)
    except ValueError as e:  # --steps abc
        raise ConfigError(f"a bench option's value is not a number ({e})") from None
    opts.update(found)
    if opts["activation_checkpointing"] not in (None, "on", "off"):
        raise ConfigError("--activation_checkpointing takes on or off")
    if opts["steps"] < 1 or opts["warmup"] < 0:
        raise ConfigError("--steps must be >= 1 and --warmup >= 0")
    if opts["out_dir"] and opts["record"]:
        raise ConfigError("give --out_dir or --record, not both")
    opts["out_dir"] = opts["out_dir"] or str(RECORDS if opts["record"] else SCRATCH)
    if problem := unwritable(Path(opts["out_dir"])):
        raise ConfigError(f"--out_dir {opts['out_dir']} {problem}")
    return opts, rest


def _relative(path: str) -> str:
    """`path` relative to the repository when it is inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else path


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "timm", "triton", "torchvision", "PIL"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def cpu_name() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.machine()
    return f"{model} ({os.cpu_count()} cores)"


def peak_memory_gib(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # Linux: KiB


def loader_throughput(cfg, opts: dict, img_size: int, rank: int, world: int) -> dict:
    """Batches of the training data source alone (in this process: no engine, no model)."""
    from data.source import build_source

    micro = resolve(cfg, world)[1].micro
    data = build_source(cfg.data, img_size, cfg.model.in_chans, micro, cfg.seed, rank, world, torch.device("cpu"))
    with Progress("warm-up", opts["warmup"], "batches") as progress:
        for _ in range(opts["warmup"]):
            next(data)
            progress.update()
    with Progress("timed batches", opts["steps"], "batches") as progress:
        start = time.perf_counter()
        for _ in range(opts["steps"]):
            next(data)
            progress.update()
        elapsed = time.perf_counter() - start
    images = opts["steps"] * micro
    workers = getattr(data, "num_workers", 0)  # resolved (data.num_workers -1 = auto); 0 for synthetic
    return {"images_per_s": images / elapsed, "images_per_s_per_worker": images / elapsed / max(1, workers),
            "batches": opts["steps"], "micro_batch": micro, "num_workers": workers,
            "decode": cfg.data.decode, "cpu_count": os.cpu_count()}


def checked_source(cfg, world: int, in_chans: int) -> None:
    """The shards against the readers (ranks x workers) and the model's channels, as at a run's start."""
    try:
        check_source(cfg.data, world, in_chans)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    asked, _ = pop_flags(argv, {"--help": None, "-h": None})
    if asked:  # the bench options above, then every run option
        print(__doc__ + "\n" + help_text())
        raise SystemExit(0)
    opts, rest = split_argv(argv)
    cfg = parse_args(rest, NOT_READ)
    img_size = encoder_img_size(cfg)
    # paths as the command gave them (records are committed: no machine's absolute paths in them)
    shown = {**opts, "out_dir": _relative(opts["out_dir"])}
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_commit(),
              "versions": versions(), "argv": rest, "bench": shown, "config": to_dict(cfg)}
    if opts["loader_only"]:
        checked_source(cfg, world=1, in_chans=DECODED_CHANNELS)  # the reader alone: whatever the model takes
        record["device"] = cpu_name()
        record["loader"] = loader_throughput(cfg, opts, img_size, 0, 1)
        print(f"loader: {record['loader']['images_per_s']:.0f} images/s, "
              f"{record['loader']['images_per_s_per_worker']:.0f} per worker ({record['loader']['num_workers']} workers, "
              f"decode {cfg.data.decode})")
        return write(record, opts, f"loader_{cfg.data.train_transform}_{img_size}px_{cfg.data.decode}")

    ds_config, plan = resolve(cfg, distributed.world_size_from_env())
    # what the training commands refuse before start, refused here too (not a traceback, or a record of
    # a step that cannot train: a mask ratio that keeps no patch)
    check_floor(cfg, ds_config, plan)
    check_objective_fits(cfg, plan.micro, plan.accum, zero_stage(ds_config))
    checked_source(cfg, plan.world, cfg.model.in_chans)
    if opts["activation_checkpointing"] == "on":
        ds_config["activation_checkpointing"] = {}
    elif opts["activation_checkpointing"] == "off":
        ds_config.pop("activation_checkpointing", None)
    try:
        gpu = gpu_named(opts["gpu"]) if opts["gpu"] else current_gpu()
    except ValueError as e:  # an unknown --gpu: the known ones named
        raise ConfigError(f"--gpu: {e}") from None
    _, prof = profile_config(cfg, ds_config, plan.micro, fused_kernels=bool(gpu and gpu.sm80))  # tokens of a micro-batch
    flops_per_gpu_step = training_flops(cfg, prof, plan.micro, plan.accum)
    if not torch.cuda.is_available():  # before anything is built: how long, or refused when sized for a GPU
        check_cpu_time(flops_per_gpu_step * (opts["warmup"] + opts["steps"]),
                       f"{cfg.objective} {cfg.model.name}, {opts['warmup']} warm-up + {opts['steps']} timed steps of "
                       f"{plan.micro} x {plan.accum} images", opts["allow_cpu"],
                       "give a smaller model, micro-batch or --steps (e.g. ds_configs/cpu_debug.json)")
    rank, world, device = distributed.init()
    per_epoch, total, warmup_steps = schedule_steps(cfg, plan)
    engine, objective, _ = build_engine(cfg, ds_config, device, peak_lr(cfg, plan), warmup_steps, total)
    dtype = engine.dtype
    data = training_source(cfg, img_size, plan, rank, world, device)
    windows: list[dict] = []
    noop = lambda step: None  # noqa: E731

    def timed(first: int, steps: int, what: str) -> None:
        with Progress(what, steps, "steps") as progress:
            def counted(step: int) -> bool:  # called after every step but the last: no device read
                progress.update()
                return False

            # one window over all `steps` (logged at the stop step only: a multiple of a smaller cadence
            # inside them would leave the record a shorter window, and a host sync among the timed steps)
            run(engine, data, LoopSettings(first + steps, 10**12, 10**12, plan.global_batch), LoopState(first), device,
                dtype, lambda step, metrics: windows.append(metrics), noop, should_stop=counted)
            progress.update()  # the last step

    if opts["warmup"]:
        timed(0, opts["warmup"], "warm-up")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed(opts["warmup"], opts["steps"], "timed steps")
    measured = windows[-1]

    tflops = flops_per_gpu_step / measured["step_time"] / 1e12
    result = {
        "images_per_s": measured["images_per_s"], "images_per_s_per_gpu": measured["images_per_s"] / world,
        "step_time_s": measured["step_time"], "train_flops_per_image": flops_per_gpu_step / (plan.micro * plan.accum),
        "block_tokens_per_image": prof.tokens() / plan.micro, "tflops_per_gpu": tflops,
        "mfu": tflops / gpu.peak_tflops if gpu else None, "peak_tflops": gpu.peak_tflops if gpu else None,
        "loss": measured["loss"], **peak_memory_gib(device),
    }
    record.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(), world_size=world,
                  dtype=str(dtype).removeprefix("torch."),
                  batch=asdict(plan) | {"global": plan.global_batch}, ds_config=ds_config, results=result,
                  gpu=asdict(gpu) if gpu else None)
    path = None
    if rank == 0:
        mfu = f", MFU {result['mfu']:.1%} of {gpu.name}" if gpu else ""
        print(f"{cfg.objective} {cfg.model.name}: {result['images_per_s']:.1f} images/s ({world} x {record['device']}, "
              f"{record['dtype']}), step {result['step_time_s'] * 1e3:.1f} ms, {tflops:.3g} TFLOP/s per GPU{mfu}")
        path = write(record, opts, f"{cfg.objective}_{cfg.model.name}")
    distributed.barrier()
    return path


def write(record: dict, opts: dict, label: str) -> Path:
    out = Path(opts["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    path = out / f"bench_{label}_{kind}_{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    cli(main)
