"""Every objective resumed onto an accelerator: the `meta` device stands in for CUDA (and CUDA
itself runs where there is one: marker gpu).

A resume builds the objective on CPU, lets the engine move it to the GPU and loads the checkpoint
into it (DeepSpeed's order; the other order is covered too); state the engine does not own
(MLO-MAE's masking network and head with their AdamW moments, AdPE's adversaries) must end up
on the GPU before the first step uses it. Parameter objects are kept across `.to()` as CUDA does
(`swap_module_params_on_conversion`; plain meta conversion replaces them). The objectives come
from the registry, so a new objective is covered without editing this file; one with extra
optimisable state gets a parametrisation here if its debug preset leaves that state off."""
import io
import warnings
from collections import deque

import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET, REPO
from torch import nn

from data.source import build_source
from model.objectives import OBJECTIVES, build_objective
from train.config.ds_config import resolve
from train.config.options import encoder_img_size
from train.config.parsing import parse_args
from train.config.plan import build_encoder, labeled_split

CONFIGS = REPO / "train" / "configs"
# (objective, extra arguments): every registered objective with its debug preset, plus the
# variants whose extra state the presets leave off
CASES = [(name, []) for name in sorted(OBJECTIVES)] + [
    ("maeplus", ["--config", str(CONFIGS / "maeplus" / "variants" / "ape_embed.json")]),  # AdPE: adversarial position embedding
    ("maeplus", ["--config", str(CONFIGS / "maeplus" / "variants" / "rpe_coord.json")]),  # AdPE: adversarial relative coordinates
    ("mlomae", ["--mlomae.variant", "blo"]),
]


def tiny_config(name: str, extra: list[str]):
    preset = CONFIGS / name / "debug.json"
    presets = ["--config", str(preset)] if preset.is_file() else []
    return parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--objective", name, *presets,
                       *extra])


def build(cfg, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build_objective(cfg.objective, build_encoder(cfg), getattr(cfg, cfg.objective))


def batches(cfg, device: torch.device):
    """The training stream of the config (synthetic; MLO-MAE's carry D_val batches), on `device`."""
    split, section = labeled_split(cfg), getattr(cfg, cfg.objective)
    micro = resolve(cfg, 1)[1].micro
    source = build_source(cfg.data, encoder_img_size(cfg), cfg.model.in_chans, micro, cfg.seed, 0, 1,
                          torch.device("cpu"), split, section.val_every(1) if split is not None else 1)
    while True:
        yield {k: v.to(device) for k, v in next(source).items()}


def train_step(objective: nn.Module, batch: dict, lr: float = 1e-2) -> None:
    """What the loop does per optimizer step: forward, backward, the optimizer, the objective's hook."""
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    objective(batch)["loss"].backward()
    opt.step()
    objective.after_optimizer_step(lr, [batch])


def checkpointed(objective: nn.Module) -> dict:
    """The module state as a checkpoint holds it (extra state included), read back with only
    tensors and plain containers (what train/engine/checkpoint.py admits)."""
    buffer = io.BytesIO()
    torch.save(objective.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def held_state(objective: nn.Module):
    """(optimizers, tensors) the objective holds outside its parameters and buffers: attributes of
    its modules, followed through plain objects and containers (AdPE's adversaries, MLO-MAE's
    networks, optimizers and cached batches)."""
    optimizers, tensors, seen = [], [], set()

    def visit(x):
        if id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(x))
        if isinstance(x, torch.optim.Optimizer):
            optimizers.append(x)
        elif isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, nn.Module):
            tensors.extend([*x.parameters(recurse=False), *x.buffers(recurse=False)])
            for k, v in vars(x).items():
                if k not in ("_parameters", "_buffers"):
                    visit(v)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple, deque, set)):
            for v in x:
                visit(v)
        elif type(x).__module__.split(".")[0] in ("model", "train") and hasattr(x, "__dict__"):
            visit(vars(x))  # the project's own plain objects (not torch's internals)

    visit(objective)
    return optimizers, tensors


def assert_all_on(objective: nn.Module, device: torch.device) -> None:
    optimizers, tensors = held_state(objective)
    stray = [tuple(t.shape) for t in tensors if t.device.type != device.type]
    assert not stray, f"tensors of shapes {stray} stayed off {device}"
    for opt in optimizers:
        for group in opt.param_groups:
            assert all(p.device.type == device.type for p in group["params"]), "an optimizer holds parameters off it"
        for p, state in opt.state.items():
            for key, value in state.items():
                if torch.is_tensor(value) and not (key == "step" and value.dim() == 0):  # step: a CPU scalar by design
                    assert value.device == p.device and p.device.type == device.type, \
                        f"optimizer state {key} on {value.device}, its parameter on {p.device}"


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("order", ["move_then_load", "load_then_move"])
@pytest.mark.parametrize("name,extra", CASES, ids=[" ".join([n, *e[1:]]).replace(f"{CONFIGS}/", "") for n, e in CASES])
def test_resume_on_an_accelerator_keeps_every_state_beside_its_parameters(name, extra, order, device):
    device = torch.device(device)
    cfg = tiny_config(name, extra)
    trained = build(cfg, seed=0)
    stream = batches(cfg, torch.device("cpu"))
    train_step(trained, next(stream))
    train_step(trained, next(stream))  # the optimizers outside the engine now hold moments
    state = checkpointed(trained)

    resumed = build(cfg, seed=1)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    if device.type == "meta":
        torch.__future__.set_swap_module_params_on_conversion(True)  # keep the Parameter objects, as CUDA's .to() does
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # loading into meta parameters is a no-op, and torch says so
            if order == "move_then_load":  # DeepSpeed: the engine moves the module, then load_checkpoint
                resumed.to(device)
                resumed.load_state_dict(state)
            else:
                resumed.load_state_dict(state)
                resumed.to(device)
            train_step(resumed, next(batches(cfg, device)))  # raised "Tensor on device meta is not on ... cpu"
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert_all_on(resumed, device)
