"""Several --config presets give the same run in any order, or are refused (train/config/presets.py
`compose`): two presets that set one option to different values are refused naming both files,
the option and both values; the command line wins over every preset; a preset's "defaults" yield
to any other preset's own options; "if_objective" options apply to their objective only."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from conftest import CPU_DS, DEBUG_PRESET, REPO

from experiments.fashion_mnist.common import demo_methods, presets, variants
from train.config.errors import ConfigError
from train.config.options import PretrainConfig
from train.config.parsing import parse_args, to_dict
from train.finetune import RECIPE as FINETUNE
from train.linprobe import RECIPE as LINPROBE

CONFIGS = REPO / "train" / "configs"
METHODS = sorted(p.name for p in CONFIGS.iterdir() if p.is_dir())


def run_of(*argv: str) -> dict | str:
    """The run's options as a dict, or the refusal's message."""
    try:
        return to_dict(parse_args(["--ds_config", str(CPU_DS), *argv]))
    except ConfigError as e:
        return str(e)


def preset(folder: Path, name: str, options: dict) -> str:
    (folder / name).write_text(json.dumps(options))
    return str(folder / name)


def pairs() -> list[tuple[str, str, str]]:
    return [(method, str(a), str(b)) for method in METHODS
            for a, b in itertools.combinations(sorted((CONFIGS / method).rglob("*.json")), 2)]


@pytest.mark.parametrize("method, a, b", pairs(), ids=lambda x: str(x).split("configs/")[-1])
def test_every_pair_of_a_methods_presets_composes_in_either_order_or_is_refused_both_ways(tmp_path, method, a, b):
    # the method and a shard index, so that no preset lacks what a run needs
    context = preset(tmp_path, "context.json", {"objective": method, "data": {"train_index": "shards/train.json"}})
    forward, backward = run_of("--config", context, "--config", a, "--config", b), \
        run_of("--config", context, "--config", b, "--config", a)
    assert type(forward) is type(backward), (forward, backward)
    if isinstance(forward, dict):
        assert forward == backward
    else:
        assert forward.startswith("the presets ") and backward.startswith("the presets "), (forward, backward)


def test_the_documented_pairs_compose():
    """docs/methods: the ImageNet recipe with an AdPE variant; the demo and the study: each
    method's demo preset with each of its variants (experiments/fashion_mnist)."""
    adpe = run_of("--config", str(CONFIGS / "maeplus/vit_b.json"), "--config",
                  str(CONFIGS / "maeplus/variants/rpe_coord.json"), "--data.train_index", "shards/train.json")
    assert isinstance(adpe, dict), adpe
    assert (adpe["maeplus"]["adversary"], adpe["maeplus"]["rpe"], adpe["model"]["img_size"]) == ("rpe_coord", True, 112)
    for method in demo_methods():
        for variant in ["", *variants(method)]:
            given = [a for p in presets(method, variant) for a in ("--config", str(p))]
            run = run_of(*given, "--data.train_index", "shards/train.json")
            assert isinstance(run, dict), (method, variant, run)
    convnext = run_of(*[a for p in presets("energy", "convnext_atto") for a in ("--config", str(p))],
                      "--data.train_index", "shards/train.json")
    assert (convnext["model"]["name"], convnext["energy"]["grid_cell"]) == ("timm/convnext_atto", 8)  # over the demo


def test_a_disagreement_names_both_presets_the_option_and_both_values(tmp_path):
    first = preset(tmp_path, "first.json", {"optim": {"weight_decay": 0.05}})
    second = preset(tmp_path, "second.json", {"optim": {"weight_decay": 0.1}})
    for a, b, va, vb in ((first, second, "0.05", "0.1"), (second, first, "0.1", "0.05")):
        message = run_of("--config", str(DEBUG_PRESET), "--config", a, "--config", b)
        assert message == (f"the presets {a} and {b} set optim.weight_decay to {va} and {vb}: keep one of them, or "
                           f"give --optim.weight_decay on the command line, which wins over every preset")
    # the same value twice (written differently) is no disagreement; the command line settles one
    same = preset(tmp_path, "same.json", {"optim": {"weight_decay": 1e-1, "betas": [0.9, 0.95]}})
    other = preset(tmp_path, "other.json", {"optim": {"betas": [0.9, 0.999]}})
    assert run_of("--config", str(DEBUG_PRESET), "--config", second, "--config", same)["optim"]["weight_decay"] == 0.1
    settled = run_of("--config", str(DEBUG_PRESET), "--config", same, "--config", other, "--optim.betas", "0.5,0.6")
    assert settled["optim"]["betas"] == (0.5, 0.6) and settled["optim"]["weight_decay"] == 0.1


def test_the_command_line_settles_what_two_variants_disagree_on():
    official, coord = (str(CONFIGS / f"maeplus/variants/{n}.json") for n in ("official_code", "rpe_coord"))
    settle = ["--maeplus.adversary", "rpe_coord", "--maeplus.adv_norm", "l2", "--maeplus.adv_eps", "2"]
    runs = [run_of("--config", str(CONFIGS / "maeplus/debug.json"), "--config", x, "--config", y, *settle)
            for x, y in ((official, coord), (coord, official))]
    assert isinstance(runs[0], dict) and runs[0] == runs[1], runs
    m = runs[0]["maeplus"]
    assert (m["adversary"], m["adv_norm"], m["adv_eps"]) == ("rpe_coord", "l2", 2.0)  # the command line's
    assert m["rpe"] and m["coord_lookup"] == "official" and m["adv_update"] == "adam"  # each variant's own, agreed


def test_defaults_yield_to_any_other_presets_options_and_two_defaults_must_agree(tmp_path):
    # the fine-tuning and linear-probe recipes keep their values as defaults: a preset sets over them
    recipe = run_of(*FINETUNE, "--config", str(DEBUG_PRESET), "--finetune.num_classes", "10")
    assert (recipe["objective"], recipe["optim"]["blr"], recipe["optim"]["layer_decay"]) == ("finetune", 1.5e-3, 0.65)
    probe = run_of(*LINPROBE, "--config", str(CONFIGS / "linprobe/cpu_recipe.json"), "--data.train_index", "t.json")
    assert (probe["optim"]["name"], probe["optim"]["blr"], probe["data"]["crop_scale_min"]) == ("adamw", 3e-2, 1.0)
    a = preset(tmp_path, "a.json", {"defaults": {"run": {"log_every": 5}}})
    b = preset(tmp_path, "b.json", {"defaults": {"run": {"log_every": 7}}})
    c = preset(tmp_path, "c.json", {"run": {"log_every": 9}})
    for order in itertools.permutations((a, b, c)):  # c's own value settles a's and b's defaults
        given = [x for p in order for x in ("--config", p)]
        assert run_of(*given, "--data.source", "synthetic")["run"]["log_every"] == 9
    for order in ((a, b), (b, a)):
        assert "set run.log_every to " in run_of(*[x for p in order for x in ("--config", p)])
    settled = run_of("--config", a, "--config", b, "--run.log_every", "3", "--data.source", "synthetic")
    assert settled["run"]["log_every"] == 3
    # the recipe's objective is its own option, not a default: a preset of another objective is refused
    assert "set objective to " in run_of(*FINETUNE, "--config", str(CONFIGS / "mixedae/debug.json"))


def test_if_objective_options_apply_to_their_objective_and_compose_as_the_presets_own(tmp_path):
    mae = run_of("--config", str(DEBUG_PRESET))
    other = run_of("--config", str(DEBUG_PRESET), "--objective", "finetune", "--finetune.num_classes", "10")
    assert mae["mae"]["decoder_dim"] == 32 and other["mae"]["decoder_dim"] == 512
    wider = preset(tmp_path, "wider.json", {"mae": {"decoder_dim": 64}})
    for order in ((str(DEBUG_PRESET), wider), (wider, str(DEBUG_PRESET))):
        assert "set mae.decoder_dim to " in run_of(*[x for p in order for x in ("--config", p)])
    settled = run_of("--config", str(DEBUG_PRESET), "--config", wider, "--mae.decoder_dim", "128")
    assert settled["mae"]["decoder_dim"] == 128


def test_if_objective_options_apply_when_the_command_line_names_their_objective():
    """--objective mae given again on the command line picks the same if_objective section as the
    preset's default objective does."""
    decoder = json.loads(DEBUG_PRESET.read_text())["if_objective"]["mae"]
    assert decoder["decoder_dim"] != PretrainConfig().mae.decoder_dim  # the preset changes it
    run = run_of("--config", str(DEBUG_PRESET), "--objective", "mae")
    assert isinstance(run, dict), run
    assert {k: run["mae"][k] for k in decoder} == decoder


def test_a_runs_own_config_is_a_preset_that_gives_the_same_run(tmp_path):
    """experiments/fashion_mnist/run_checkpoints.py reads a finished run's config.json back as a preset."""
    run = run_of("--config", str(CONFIGS / "mixedae/debug.json"), "--config",
                 str(CONFIGS / "mixedae/variants/naive_mixing.json"))
    saved = preset(tmp_path, "config.json", run)
    assert run_of("--config", saved) == run
