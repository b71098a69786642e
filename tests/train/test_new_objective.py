"""A new method touches its own files only: an objective defined and registered in this file
appears in --help and in the config (in this process), and trains, checkpoints and resumes exactly
through train/pretrain.py (in a child process that registers it from this file)."""
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model.objectives import OBJECTIVES, Objective, ObjectiveConfig, register_objective
from train.engine.state_files import read_tensors
from train.run.folder import read_metrics

REPO = Path(__file__).resolve().parents[2]
NAME = "pixelmean"
STEPS = 4


@dataclass
class PixelMeanConfig(ObjectiveConfig):
    target_scale: float = 1.0  # the regression target is this times each patch's mean pixel

    def validate(self) -> None:
        if self.target_scale <= 0:
            raise ValueError(f"{NAME}.target_scale must be > 0, got {self.target_scale}")


class PixelMeanObjective(Objective):
    """Predict each patch's mean pixel from the encoder's patch token (linear head, MSE)."""

    def __init__(self, encoder: nn.Module, cfg: PixelMeanConfig):
        cfg.validate()
        super().__init__(encoder, cfg)
        self.head = nn.Linear(encoder.embed_dim, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        images = batch["image"]  # (B, C, H, W)
        tokens = self.encoder.forward_features(images)[:, 1:]  # (B, N, D), row-major patches
        target = F.avg_pool2d(images.float(), self.encoder.patch_embed.patch_size).mean(1).flatten(1)  # (B, N)
        pred = self.head(tokens).squeeze(-1).float()  # (B, N)
        return {"loss": F.mse_loss(pred, self.cfg.target_scale * target), "pred_mean": pred.mean().detach()}


def register() -> None:
    register_objective(NAME, PixelMeanConfig)(PixelMeanObjective)


@pytest.fixture(scope="module", autouse=True)
def registered():
    """Register the objective for this module's tests; afterwards leave the session as it was
    (the registry, the stop-signal handlers main() installs)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    register()
    yield
    OBJECTIVES.pop(NAME)
    for s, h in handlers.items():
        signal.signal(s, h)


# A fresh process loads this file, registers the objective from it and runs train/pretrain.py's
# main for each argv in turn: the engine gets a process of its own (DeepSpeed caches the process
# groups of the first engine a process builds, which other in-process tests tear down).
CHILD = """import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("new_objective_case", sys.argv[1])
case = importlib.util.module_from_spec(spec)
spec.loader.exec_module(case)
case.register()
from train.pretrain import main
for argv in json.loads(sys.argv[2]):
    main(argv)
from train.run.cli import end_process_group, leave_before_teardown  # as tests/conftest.py CHILD_EXIT says why
end_process_group()
leave_before_teardown(0)
"""


def pretrain_runs(*runs: tuple[Path, list[str]]) -> None:
    """Each (output folder, extra options) run of the new objective on the debug ViT, in order, in one child."""
    calls = [["--ds_config", str(REPO / "ds_configs" / "cpu_debug.json"),
              "--config", str(REPO / "train" / "configs" / "mae" / "debug.json"),  # the debug ViT, synthetic data
              "--objective", NAME, "--output_dir", str(out), "--run.progress", "false",
              "--run.tensorboard", "false", "--run.export", "false", *args] for out, args in runs]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, __file__, json.dumps(calls)], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_help_lists_the_new_section(capsys):
    from train.pretrain import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if f"--{NAME}.target_scale" in line)
    # its type, default and the comment on its field's line above
    assert line.split()[:4] == [f"--{NAME}.target_scale", "float", "default", "1.0"]
    assert line.endswith("the regression target is this times each patch's mean pixel")


def test_unknown_option_of_the_new_section_is_refused_with_a_hint():
    from train.config.errors import ConfigError
    from train.config.parsing import parse_args

    with pytest.raises(ConfigError, match=f"did you mean '{NAME}.target_scale'"):
        parse_args(["--ds_config", "x.json", "--data.source", "synthetic", f"--{NAME}.target_scal", "2"])
    cfg = parse_args(["--ds_config", "x.json", "--data.source", "synthetic", "--objective", NAME,
                      f"--{NAME}.target_scale", "2"])
    assert cfg.pixelmean.target_scale == 2.0


def test_trains_checkpoints_and_resumes_exactly(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    pretrain_runs((straight, ["--run.max_steps", str(STEPS), "--run.ckpt_every", "2"]),
                  (stopped, ["--run.max_steps", "2", "--run.ckpt_every", "2"]))
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(r["loss"])) and "pred_mean" in r for r in rows)
    config = json.loads((straight / "config.json").read_text())
    assert config["objective"] == NAME and config[NAME] == {"target_scale": 1.0}
    tag = straight / "checkpoints" / f"step{STEPS:08d}"
    client = torch.load(tag / "state.pt", weights_only=True)
    assert client["client"]["step"] == STEPS and "head.weight" in read_tensors(tag)

    assert (stopped / "checkpoints" / "latest").read_text() == "step00000002"
    pretrain_runs((stopped, ["--run.max_steps", str(STEPS), "--run.ckpt_every", "2", "--resume", "auto"]))
    resumed = read_metrics(stopped)
    # steps 1-2 from the first run, 3-4 from the resumed one: it went on from the checkpoint's step
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in rows]
