"""train/run/capture_readiness.py: every objective's training step, run on the meta device, has no
host read, no value-dependent shape and no CPU tensor entering a device op after its warm-up step
(what a CUDA-graph capture of the step needs), MLO-MAE's levels II and III included (their fused
AdamW keeps its step count on the device); and the check finds each kind of hazard when an
objective has one."""
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

from model.objectives import OBJECTIVES, Objective, ObjectiveConfig, list_objectives, register_objective
from train.config.ds_config import resolve
from train.config.parsing import parse_args
from train.run.capture_readiness import check_step

DEBUG = ["--config", "train/configs/mae/debug.json"]
SHIPPED = {"mae", "mixedae", "maeplus", "mlomae", "energy", "finetune", "linprobe"}
# objectives checked otherwise than by their own debug preset alone
SPECIAL = {
    "maeplus": ["--config", "train/configs/maeplus/debug.json", "--maeplus.rpe", "true", "--maeplus.adversary",
                "rpe_coord", "--maeplus.adv_eps", "20.0"],  # AdPE: the adversary's ascent in the after-step hook
    "finetune": [*DEBUG, "--objective", "finetune", "--finetune.num_classes", "10"],  # no preset of its own:
    "linprobe": [*DEBUG, "--objective", "linprobe", "--linprobe.num_classes", "10"],  # it starts from an encoder
}
RUNS = {**{name: ["--config", f"train/configs/{name}/debug.json"] for name in list_objectives()
           if (REPO / "train" / "configs" / name / "debug.json").is_file()}, **SPECIAL}


def findings(argv: list[str], monkeypatch) -> list[str]:
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = parse_args(["--ds_config", "ds_configs/cpu_debug.json", *argv])
    ds, plan = resolve(cfg, 1)
    return check_step(cfg, ds, plan.micro)


def test_every_registered_objective_is_checked():
    """A registered objective is checked when it has train/configs/<name>/debug.json (or a row in SPECIAL)."""
    unchecked = set(list_objectives()) - set(RUNS)
    assert not unchecked, f"{sorted(unchecked)}: no train/configs/<name>/debug.json to check the step of"
    assert set(RUNS) == set(list_objectives()) and SHIPPED <= set(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_step_of_every_objective_could_be_captured(name, monkeypatch):
    monkeypatch.chdir(REPO)
    found = findings(RUNS[name], monkeypatch)
    assert found == []


@dataclass
class HazardConfig(ObjectiveConfig):
    hazard: str = "item"  # item | nonzero | cpu | cpu_scalar | cpu_in_list


class Hazard(Objective):
    """MSE of a linear map of the cls feature, with one capture hazard in its forward."""

    def __init__(self, encoder, cfg: HazardConfig):
        super().__init__(encoder, cfg)
        self.out = torch.nn.Linear(encoder.embed_dim, 1)
        self.calls = torch.zeros(())  # not a buffer: stays on the CPU when the model moves

    def forward(self, batch):
        pred = self.out(self.encoder(batch["image"]))  # (B, 1)
        if self.cfg.hazard == "item":
            pred = pred * pred.abs().max().item()  # a host read
        elif self.cfg.hazard == "nonzero":
            pred = pred[pred > 0]  # a value-dependent shape
        elif self.cfg.hazard == "cpu_in_list":
            torch._foreach_add_([self.calls], 1)  # a CPU tensor inside a list argument (a foreach op's)
        elif self.cfg.hazard == "cpu":
            pred = pred + torch.ones(1)  # a CPU tensor
        else:
            pred = pred + torch.tensor(0.5)  # a CPU scalar: broadcast into a device op, frozen by a capture
        return {"loss": F.mse_loss(pred, torch.zeros_like(pred))}


@pytest.mark.parametrize("hazard, said", [
    ("item", r"RuntimeError: .* at tests/train/run/test_capture_readiness.py:\d+"),
    ("nonzero", r"(RuntimeError|NotImplementedError): .* at tests/train/run/test_capture_readiness.py:\d+"),
    ("cpu", r"RuntimeError: Tensor on device cpu is not on the expected device meta! at "
            r"tests/train/run/test_capture_readiness.py:\d+"),
    ("cpu_scalar", r"aten::add.Tensor at tests/train/run/test_capture_readiness.py:\d+"),
    ("cpu_in_list", r"aten::_foreach_add_.Scalar at tests/train/run/test_capture_readiness.py:\d+"),
])
def test_each_kind_of_hazard_is_found_where_it_is(hazard, said, monkeypatch):
    monkeypatch.chdir(REPO)
    register_objective("capturehazard", HazardConfig)(Hazard)
    try:
        found = findings([*DEBUG, "--objective", "capturehazard", "--capturehazard.hazard", hazard], monkeypatch)
    finally:
        OBJECTIVES.pop("capturehazard")
    assert found and re.fullmatch(said, found[0]), found
