"""Phase `tests`: the engine on the GPU (fp16 with dynamic loss scaling, bf16 ZeRO-1/2), resume
equality, then `pytest -m gpu` with its junit summary."""
from __future__ import annotations

import math
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tools.gpu_check import Check, free_memory
from tools.phases.common import CPU_DEBUG_DS, DEBUG_PRESET, ds_config


def run(check: Check, a) -> None:
    summary = check.record["summary"]
    if check.cuda:
        model = ["--model.name", "vit_base_patch16"]
        micro, steps, resume_steps = 64, 50, 20
    else:
        model = ["--config", str(DEBUG_PRESET)]
        micro, steps, resume_steps = 8, 6, 4

    def pretrain(name: str, ds: Path, n_steps: int, extra: list[str] = ()) -> list[dict]:
        from train.run.folder import read_metrics
        from train.run.command import main as pretrain_main

        run = check.work / name
        argv = ["--ds_config", str(ds), *model, "--data.source", "synthetic", "--data.epoch_size",
                str(n_steps * micro), "--optim.epochs", "1", "--optim.warmup_epochs", "0.2", "--run.log_every", "1",
                "--run.tensorboard", "false", "--run.progress", "false", "--run.export", "false",
                "--output_dir", str(run), *extra]
        try:
            pretrain_main(argv)
        finally:
            free_memory()
        return [r for r in read_metrics(run) if "loss" in r]

    def engine(name: str, precision: str, stage: int) -> dict:
        ds = ds_config(check, name, micro, precision, stage) if check.cuda else CPU_DEBUG_DS
        rows = pretrain(name, ds, steps)
        losses = [math.nan if r["loss"] is None else r["loss"] for r in rows]  # null: a window with no finite loss
        k = max(1, len(losses) // 5)
        first, last = statistics.fmean(losses[:k]), statistics.fmean(losses[-k:])
        out = {"precision": precision, "zero_stage": stage, "steps": len(losses), "loss_first": losses[0],
               "loss_last": losses[-1], "finite": all(math.isfinite(x) for x in losses),
               "decreasing": last < first, "mean_first_fifth": first, "mean_last_fifth": last,
               "skipped_steps": rows[-1].get("skipped_steps"), "loss_scale": rows[-1].get("loss_scale")}
        out["ok"] = out["finite"] and out["decreasing"] and out["steps"] == steps
        return out

    engines = [("fp16_zero2", "fp16", 2), ("bf16_zero1", "bf16", 1), ("bf16_zero2", "bf16", 2)]
    for name, precision, stage in engines:
        if check.cuda:
            check.item(f"engine_{name}", 60, lambda n=name, p=precision, s=stage: engine(n, p, s))
        else:
            check.skip(f"engine_{name}", "fp16/bf16 engines need CUDA (CPU smoke)")
    if not check.cuda:  # the same measurement in fp32 on CPU, so the smoke test sees the plumbing work
        check.item("engine_fp32_cpu", 0, lambda: engine("fp32_cpu", "fp32", 2))

    def resume() -> dict:
        """bf16 ZeRO-1 (CPU: fp32): resume_steps straight vs half, checkpoint, resume for the other half."""
        ds = ds_config(check, "resume", micro, "bf16", 1) if check.cuda else CPU_DEBUG_DS
        half = resume_steps // 2
        straight = pretrain("straight", ds, resume_steps, ["--run.ckpt_every", str(10**6)])
        pretrain("resumed", ds, resume_steps, ["--run.ckpt_every", str(half), "--run.max_steps", str(half)])
        resumed = pretrain("resumed", ds, resume_steps, ["--run.ckpt_every", str(10**6), "--resume", "auto"])
        a, b = ({r["step"]: math.nan if r["loss"] is None else r["loss"] for r in rows} for rows in (straight, resumed))
        after = [s for s in sorted(a) if s > half and s in b]
        diff = max((abs(a[s] - b[s]) / max(abs(a[s]), 1e-12) for s in after), default=float("nan"))
        return {"steps": resume_steps, "checkpoint_at": half, "compared_steps": len(after),
                "max_rel_loss_diff": diff, "bitwise_equal": all(a[s] == b[s] for s in after) and bool(after),
                "ok": bool(after) and len(after) == resume_steps - half and diff < 1e-2}

    check.item("resume_equality", 90, resume)

    def pytest_gpu() -> dict:
        junit = check.work / "junit.xml"
        paths = ["tests"] if check.cuda else ["tests/kernels/test_restricted_triton_gpu.py"]
        timeout = max(30.0, check.remaining() - 10)
        proc = check.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-ra",
                          f"--junitxml={junit}", *paths], timeout, {"PYTHONWARNINGS": "ignore"})
        return {"returncode": proc.returncode, **junit_summary(junit)}

    check.item("pytest_gpu", 240, pytest_gpu)
    fields = ("ok", "loss_first", "loss_last", "loss_scale", "skipped_steps", "max_rel_loss_diff", "bitwise_equal",
              "passed", "failed", "errors", "skipped", "error")
    summary.update({k: {f: v[f] for f in fields if f in v} for k, v in check.record["items"].items()})

def junit_summary(path: Path) -> dict:
    if not path.is_file():
        return {"error": "pytest wrote no junit report (see the log)"}
    root = ET.parse(path).getroot()
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skip_reasons": {}}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            node = case.find("failure") if case.find("failure") is not None else case.find("error")
            out["failed" if node.tag == "failure" else "errors"] += 1
            out["failures"].append({"test": name, "message": (node.get("message") or "")[:300]})
        elif case.find("skipped") is not None:
            out["skipped"] += 1
            reason = (case.find("skipped").get("message") or "")[:160]
            out["skip_reasons"][reason] = out["skip_reasons"].get(reason, 0) + 1
        else:
            out["passed"] += 1
    return out
