"""The run folder: merged config, final ds_config, provenance, metrics.jsonl, TensorBoard events.

Only rank 0 writes. metrics.jsonl has one JSON object per logged step.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"commit": "unknown", "dirty": None}


def write_run_files(run_dir: Path, config: dict, ds_config: dict, extra: dict) -> None:
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
    meta = {"git": git_commit(), "argv": sys.argv, "torch": torch.__version__, **extra}
    (run_dir / "meta.json").write_text(json.dumps(meta, indent=2))


class Reporter:
    """Rank 0's outputs per logged step: metrics.jsonl, TensorBoard, progress bar (images/s, ETA).

    On resume from step `start_step`, lines and events logged after it by the interrupted run
    are dropped first, so every step appears once.
    """

    def __init__(self, run_dir: Path, start_step: int, stop_step: int, tensorboard: bool, progress: bool):
        path = run_dir / "metrics.jsonl"
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= start_step]
            path.write_text("".join(f"{line}\n" for line in kept))
        self.file = open(path, "a", buffering=1)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=stop_step, initial=start_step, unit="step", dynamic_ncols=True)

    def _write(self, step: int, metrics: dict[str, float], tb_section: str) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(f"{tb_section}/{k}", v, step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._write(step, metrics, "train")
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", img_s=f"{metrics['images_per_s']:.0f}")

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation result: its own line in metrics.jsonl, `eval/` in TensorBoard."""
        self._write(step, metrics, "eval")
        if self.bar is not None:
            self.bar.write(f"step {step}: " + ", ".join(f"{k} {v:.2f}" for k, v in metrics.items()))

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()


def read_metrics(run_dir: Path) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]
