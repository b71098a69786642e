"""The objective contract (model/objectives/base.py), swept over every registered objective on the
debug ViT: forward, backward, the step hook, extra state through a checkpoint; every preset parses;
the registry refuses what breaks the contract."""
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from model.objectives import (
    OBJECTIVES,
    Objective,
    ObjectiveConfig,
    build_objective,
    list_objectives,
    register_objective,
)
from model.registry import create_model
from train.config.options import section
from train.config.parsing import parse_args

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "train" / "configs"
CPU_DS = ["--ds_config", str(REPO / "ds_configs" / "cpu_debug.json"), "--data.source", "synthetic"]
BATCH = 4  # even: fine-tuning's mixup pairs samples


def debug_config(name: str):
    """The debug model (mae/debug.json) with the objective's own debug preset over it, if it has one."""
    presets = [CONFIGS / "mae" / "debug.json", CONFIGS / name / "debug.json"]
    argv = [arg for p in presets if p.is_file() for arg in ("--config", str(p))]
    return parse_args([*CPU_DS, *argv, "--objective", name])


def build(name: str, seed: int = 0) -> tuple[Objective, dict[str, torch.Tensor]]:
    """The objective on the debug ViT and one micro-batch it trains on (labels, and a validation
    batch for objectives that train on a split of the labeled data)."""
    cfg = debug_config(name)
    checks = section(cfg)
    overrides = {"in_chans": cfg.model.in_chans, **({"img_size": cfg.model.img_size} if cfg.model.img_size else {}),
                 **checks.encoder_overrides()}
    torch.manual_seed(seed)
    objective = build_objective(name, create_model(cfg.model.name, **overrides), checks)
    size = objective.encoder.img_size
    g = torch.Generator().manual_seed(1)

    def images():
        return torch.randn(BATCH, cfg.model.in_chans, size, size, generator=g)

    batch = {"image": images(), "label": torch.randint(0, 10, (BATCH,), generator=g)}
    if checks.data_split() is not None:
        batch |= {"val_image": images(), "val_label": torch.randint(0, 10, (BATCH,), generator=g)}
    return objective, batch


def same(a, b) -> bool:
    """Equal nested state: tensors by value, containers item by item."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_every_shipped_objective_is_registered():
    assert {"mae", "mixedae", "maeplus", "mlomae", "energy", "linprobe", "finetune"} <= set(list_objectives())
    for name, (config_cls, objective_cls) in OBJECTIVES.items():
        assert issubclass(config_cls, ObjectiveConfig) and issubclass(objective_cls, Objective)
        assert objective_cls.name == name


@pytest.mark.parametrize("name", list_objectives())
def test_objective_contract(name):
    objective, batch = build(name)
    objective.train()
    out = objective(batch)
    loss = out["loss"]
    assert loss.ndim == 0 and torch.isfinite(loss), name
    # FSDP2 warns at every forward of a root returning a view that requires grad (an in-place op
    # on it would skip the pre-backward all-gather): outputs beyond the loss and its parts carry none
    views = [k for k, v in out.items() if isinstance(v, torch.Tensor) and v.requires_grad and v._base is not None]
    assert not views, f"{name} returns views that require grad: {views}"
    loss.backward()

    trainable = {n: p for n, p in objective.named_parameters() if p.requires_grad}
    assert trainable, f"{name} has nothing to train"
    # (a parameter may be unused by design, e.g. MAE+'s decoder has no mask tokens of its own)
    for n, p in trainable.items():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"{name}: {n} has a non-finite gradient"
    reached = [n for n, p in trainable.items() if p.grad is not None and p.grad.abs().sum() > 0]
    own = [n for n in trainable if not n.startswith("encoder.")]
    encoder = [n for n in trainable if n.startswith("encoder.")]
    assert not own or any(not n.startswith("encoder.") for n in reached), f"{name}: its own parameters get zero gradients"
    # every weight of the patch embedding and the blocks (the final norm's bias may be constant to a loss: energy)
    backbone = [n for n in encoder if n.startswith(("encoder.patch_embed.", "encoder.blocks."))]
    assert not set(backbone) - set(reached), f"{name}: no gradient reaches {sorted(set(backbone) - set(reached))}"

    stats = objective.after_optimizer_step(1e-3, [batch])
    assert isinstance(stats, dict)
    for key, value in stats.items():
        assert isinstance(value, torch.Tensor) and value.ndim == 0 and torch.isfinite(value), f"{name}: {key}"

    objective.eval()
    images = batch["image"]
    if type(objective).has_classifier():
        assert objective.predict(images).shape[0] == BATCH
    noise = torch.rand(BATCH, objective.encoder.num_patches, generator=torch.Generator().manual_seed(2))
    for figure, rows in objective.visualizations(images, noise).items():
        assert rows and all(r.ndim == 4 and r.shape[0] == BATCH and torch.isfinite(r).all() for r in rows), figure

    # extra state (and every tensor) through a checkpoint into a fresh instance built differently
    fresh, _ = build(name, seed=1)
    state = objective.state_dict()
    fresh.load_state_dict(state)
    assert same(state, fresh.state_dict()), name
    if type(objective).get_extra_state is not nn.Module.get_extra_state:
        assert same(objective.get_extra_state(), fresh.get_extra_state()), name


def modules_outside(obj, seen=None) -> list[nn.Module]:
    """Modules an objective holds in plain attributes (at any depth of plain objects, lists and
    dicts), not as submodules: what the engine neither casts, shards nor optimises."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, type)):
        return []
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        children = [v for k, v in vars(obj).items() if k not in ("_modules", "_parameters", "_buffers")]
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set)) or type(obj).__name__ == "deque":
        children = list(obj)
    else:
        children = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    found = []
    for child in children:
        if isinstance(child, nn.Module):
            found.append(child)
        found += modules_outside(child, seen)
    return found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list_objectives())
def test_the_loss_is_fp32_when_the_model_is_cast_to_16_bits(name, dtype):
    """As a bf16 or fp16 ds_config casts it: the engine refuses a 16-bit loss (fp16's loss scale of
    2**16 is inf in fp16)."""
    objective, batch = build(name)
    objective.to(dtype)
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    assert objective(batch)["loss"].dtype == torch.float32


@pytest.mark.parametrize("name", list_objectives())
def test_what_an_objective_trains_outside_its_modules_is_declared(name):
    """The memory estimate counts Objective.outside_parameters: a module kept as a plain attribute
    and left out of it would be missing from every estimate."""
    objective, _ = build(name)
    held = {id(p) for m in modules_outside(objective) for p in m.parameters()}
    declared = {id(p) for p in objective.outside_parameters()}
    assert held == declared, name
    assert not declared & {id(p) for p in objective.parameters()}, f"{name}: a submodule's parameter is declared"
    assert (name == "mlomae") == bool(declared)  # C and T (model/objectives/mlomae.py Auxiliary)


def test_hooks_have_defaults_for_a_minimal_objective():
    @dataclass
    class Bare(ObjectiveConfig):
        pass

    class BareObjective(Objective):
        def forward(self, batch):
            return {"loss": self.encoder.forward_features(batch["image"]).mean()}

    obj = BareObjective(create_model("vit_debug_patch4", in_chans=1), Bare())
    assert obj.after_optimizer_step(1e-3, []) == {} and obj.no_weight_decay() == set()
    assert obj.outside_parameters() == []
    assert obj.visualizations(torch.zeros(1, 1, 28, 28), torch.rand(1, 49)) == {}
    assert not BareObjective.has_classifier() and not BareObjective.double_backward
    with pytest.raises(NotImplementedError):
        obj.predict(torch.zeros(1, 1, 28, 28))
    cfg = Bare()
    assert cfg.encoder_overrides() == {} and cfg.data_split() is None and cfg.val_every(4) == 1
    cfg.validate(), cfg.check_fits(28, 4, 2, 8), cfg.check_engine(3, 1), cfg.check_input(1), cfg.check_labels(10)


PRESETS = sorted(CONFIGS.rglob("*.json"))


def test_presets_exist():
    assert len(PRESETS) >= 10 and all((CONFIGS / name / "debug.json").is_file() for name in ("mae", "maeplus"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_preset_parses(preset):
    """A variant goes on top of its method's preset (alone, its section would be read by no objective)."""
    base = ["--config", str(preset.parent.parent / "debug.json")] if preset.parent.name == "variants" else []
    cfg = parse_args(["--ds_config", str(REPO / "ds_configs" / "cpu_debug.json"), *base, "--config", str(preset),
                      "--data.source", "synthetic"])
    assert cfg.objective in OBJECTIVES


@dataclass
class _Config(ObjectiveConfig):
    scale: float = 1.0


class _Objective(Objective):
    def forward(self, batch):
        return {"loss": batch["image"].mean() * self.cfg.scale}


def test_register_refuses_what_breaks_the_contract():
    with pytest.raises(TypeError, match="must derive from Objective"):
        register_objective("contract_plain_module", _Config)(nn.Module)
    with pytest.raises(TypeError, match="must define forward"):
        register_objective("contract_no_forward", _Config)(type("NoForward", (Objective,), {}))
    with pytest.raises(TypeError, match="must derive from ObjectiveConfig"):
        register_objective("contract_plain_config", dataclass(type("Plain", (), {"__annotations__": {}})))
    with pytest.raises(ValueError, match="already registered"):
        register_objective("mae", _Config)(_Objective)
    with pytest.raises(ValueError, match="identifier"):
        register_objective("not-a-name", _Config)
    assert "contract_plain_module" not in OBJECTIVES and OBJECTIVES["mae"][1].__name__ == "MAEObjective"
