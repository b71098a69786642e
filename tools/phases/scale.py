"""Phase `scale`: MAE ViT-B/16 images/s per GPU on 1, 2, 4 and 8 GPUs of one node (as many as are
present) for ZeRO stages 0-3, through train/bench.py under torchrun (tools/phases/scale_ranks.py:
one launch per GPU count, every stage in it); the efficiency against 1 GPU of the same stage; and
beside it what the communication model (train/estimate/comm_model.py) predicts for this configuration on
one node and on 4 nodes, with the compute time measured on 1 GPU.

Every GPU runs the per-GPU batch of the shipped `vit_b_8xh100_bf16_zero1.json` on 8 GPUs (micro-batch
256, accumulation 2, bf16) whatever the GPU count: the global batch grows with the GPUs, so
images/s per GPU stays comparable (weak scaling). With one GPU the phase measures that and says
multi-GPU is absent. --smoke: 2 gloo ranks on the CPU, the debug model, fp32, a step.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tools.gpu_check import REPO, Check, drop_process_group_env
from tools.phases.common import CPU_DEBUG_DS, DEBUG_PRESET

STAGES = (0, 1, 2, 3)
GPU_COUNTS = (1, 2, 4, 8)
TARGETS = {"efficiency_8_gpus_of_a_node": ">= 0.95 (images/s per GPU against 1 GPU)",
           "efficiency_4_nodes_by_the_model": ">= 0.90 (train/estimate/comm_model.py, the engine after)"}
SHIPPED = REPO / "ds_configs" / "vit_b_8xh100_bf16_zero1.json"


def stage_config(folder: Path, stage: int, micro: int, accum: int, base: Path) -> Path:
    """`base`'s settings at ZeRO `stage`, with micro-batch and accumulation and no global batch (it
    follows the ranks)."""
    ds = {k: v for k, v in json.loads(base.read_text()).items() if k != "train_batch_size"}
    ds.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum)
    ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": stage}
    path = folder / f"zero{stage}.json"
    path.write_text(json.dumps(ds, indent=1))
    return path


def gpu_counts(present: int) -> list[int]:
    """The GPU counts measured on a node with `present` GPUs."""
    return [k for k in GPU_COUNTS if k <= present]


def run_ranks(check: Check, cmd: list[str], timeout: float) -> int | str:
    """The launcher in a process group of its own, output to the call's log: past `timeout` the
    whole group (the launcher and its ranks) is stopped, so no rank outlives the item. Returns
    the exit status, or "timeout"."""
    drop_process_group_env()
    with open(check.log, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
                os.killpg(proc.pid, sig)
                try:
                    proc.wait(grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return "timeout"


def launch(check: Check, gpus: int, configs: list[Path], bench_args: list[str], timeout: float) -> dict:
    """train/bench.py for every config on `gpus` ranks; each stage's numbers from its record."""
    out = check.work / f"gpus{gpus}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus), "-m",
           "tools.phases.scale_ranks", str(out), *map(str, configs), "--", *bench_args]
    result: dict = {"gpus": gpus, "returncode": run_ranks(check, cmd, timeout),
                    "launcher": f"torchrun --standalone --nproc_per_node {gpus} -m tools.phases.scale_ranks"}
    for path in configs:
        records = sorted((out / path.stem).glob("bench_*.json"))
        if not records:
            result[path.stem] = {"error": "no record written (the call's log has the output)"}
            continue
        r = json.loads(records[-1].read_text())
        res = r["results"]
        result[path.stem] = {"images_per_s": res["images_per_s"], "images_per_s_per_gpu": res["images_per_s_per_gpu"],
                             "step_time_s": res["step_time_s"], "mfu": res["mfu"], "world_size": r["world_size"],
                             "batch": r["batch"], "dtype": r["dtype"], "loss": res["loss"],
                             "peak_gib": res.get("peak_allocated_gib", res.get("peak_rss_gib"))}
    return result


def predicted(argv: list[str], configs: list[Path], measured: dict, peak: float | None) -> dict:
    """The communication model's efficiency of each stage's configuration on one node and on 4, the
    compute at the MFU measured on 1 GPU of that stage (40% where none was measured)."""
    from train.config.ds_config import load
    from train.config.parsing import parse_args
    from train.estimate.comm_model import Compute, Network
    from train.estimate.scaling import scaling

    network = Network()
    out = {}
    for path in configs:
        cfg = parse_args(["--ds_config", str(path), *argv])
        mfu = (measured.get(path.stem) or {}).get("mfu") or Compute.mfu
        compute = Compute(peak or Compute.peak_tflops, mfu)
        rows = {}
        for world in (network.gpus_per_node, 4 * network.gpus_per_node):
            s = scaling(cfg, load(str(path)), world, network, compute)
            rows[str(world)] = {e: {"efficiency": est.efficiency, "exposed_ms": est.exposed_s * 1e3,
                                    "sent_gb_per_rank": est.sent_bytes / 1e9} for e, est in s.estimates.items()}
        out[path.stem] = {"mfu": mfu, "peak_tflops": compute.peak_tflops, "by_world_size": rows}
    return out


def run(check: Check, a) -> None:
    from train.config.options import encoder_img_size
    from train.config.parsing import parse_args
    from train.estimate.gpus import current_gpu

    summary = check.record["summary"]
    summary["targets"] = TARGETS
    if check.cuda:
        present = torch.cuda.device_count()
        model = ["--model.name", "vit_base_patch16", "--data.source", "synthetic"]
        micro, accum, base, steps, est = 256, 2, SHIPPED, ["--steps", "10", "--warmup", "3"], 90
    else:
        present = 2  # gloo ranks on the CPU
        model = ["--config", str(DEBUG_PRESET), "--data.source", "synthetic"]
        micro, accum, base, steps, est = 8, 2, CPU_DEBUG_DS, ["--steps", "1", "--warmup", "1"], 0
    configs = [stage_config(check.work, s, micro, accum, base) for s in STAGES]
    cfg = parse_args(["--ds_config", str(configs[0]), *model])
    img = encoder_img_size(cfg)
    summary["config"] = {"model": cfg.model.name, "objective": cfg.objective, "micro_batch": micro, "accumulation": accum,
                         "dtype": "bf16" if check.cuda else "fp32", "image_shape": [micro, cfg.model.in_chans, img, img],
                         **({"gpus_present": present} if check.cuda else {"gloo_ranks": present})}
    counts = gpu_counts(present)
    for k in GPU_COUNTS:
        if k in counts:
            check.item(f"gpus{k}", est, lambda k=k: launch(check, k, configs, [*model, *steps],
                                                          max(60.0, check.remaining() - 10)))
        else:
            check.skip(f"gpus{k}", f"{present} GPU{'s' if present > 1 else ''} present: multi-GPU scaling to {k} "
                                   f"not measured")
    summary["multi_gpu"] = "measured" if len(counts) > 1 else "absent: 1 GPU present, multi-GPU scaling not measured"
    items = check.record["items"]
    one = items.get("gpus1", {})
    for path in configs:
        per_gpu = {str(k): items[f"gpus{k}"][path.stem]["images_per_s_per_gpu"] for k in counts
                   if "images_per_s_per_gpu" in items.get(f"gpus{k}", {}).get(path.stem, {})}
        row: dict = {"images_per_s_per_gpu": per_gpu}
        if "1" in per_gpu:
            row["efficiency"] = {k: v / per_gpu["1"] for k, v in per_gpu.items() if k != "1"}
        summary[path.stem] = row
    check.save()
    gpu = current_gpu() if check.cuda else None

    def model_prediction() -> dict:
        return predicted(model, configs, one, gpu.peak_tflops if gpu else None)

    prediction = check.item("model", 30, model_prediction)
    for stage, row in (prediction or {}).items():
        if stage in summary and "by_world_size" in row:
            summary[stage]["model_efficiency_after"] = {w: v["after"]["efficiency"]
                                                        for w, v in row["by_world_size"].items()}
    check.save()
