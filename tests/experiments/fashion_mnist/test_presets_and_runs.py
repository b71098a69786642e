"""The demo and the study find methods, presets and how to evaluate a run without naming a method:
registry + train/configs/<method>/{demo.json, variants/*.json} + the run's own files."""
import json

import pytest

from experiments.fashion_mnist import demo
from experiments.fashion_mnist.common import (
    CONFIGS,
    demo_methods,
    encoder_has_rpe,
    feature_pool,
    has_classifier,
    presets,
    variants,
)
from experiments.fashion_mnist.entries import STUDY
from model.objectives import list_objectives
from train.config.parsing import parse_args, to_dict


def test_demo_methods_are_the_registered_objectives_with_a_demo_preset():
    with_demo = {p.parent.name for p in CONFIGS.glob("*/demo.json")}
    assert demo_methods() == sorted(set(list_objectives()) & with_demo)
    assert {"energy", "mae", "maeplus", "mixedae", "mlomae"} <= set(demo_methods())  # the shipped methods
    assert {"finetune", "linprobe"} <= set(list_objectives()) - set(demo_methods())  # they start from an encoder
    folders = sorted(d.name for d in CONFIGS.iterdir() if d.is_dir())
    assert set(folders) <= set(list_objectives()), "a preset folder must be named after a registered objective"


def test_presets_by_path_convention_and_errors_that_name_the_choices():
    assert presets("mae") == [CONFIGS / "mae" / "demo.json"]
    assert presets("maeplus", "rpe_coord") == [CONFIGS / "maeplus" / "demo.json",
                                               CONFIGS / "maeplus" / "variants" / "rpe_coord.json"]
    assert all(p.is_file() for p in presets("mixedae", "naive_mixing"))
    assert "fgsm" in variants("maeplus") and variants("mae") == []
    with pytest.raises(ValueError, match="mae has none"):
        presets("mae", "naive_mixing")
    with pytest.raises(ValueError, match="naive_mixing"):
        presets("mixedae", "no_such_variant")
    with pytest.raises(ValueError, match="no demo preset for 'finetune'"):
        presets("finetune")
    for entry in STUDY.values():  # every study entry resolves to preset files
        if entry.method:
            assert all(p.is_file() for p in presets(entry.method, entry.variant))


def test_only_an_objective_with_its_own_classifier_gets_the_test_split():
    assert [m for m in demo_methods() if has_classifier(m)] == ["mlomae"]


@pytest.mark.parametrize("method, pool", [("energy", "avg"), ("mae", "cls"), ("mlomae", "cls")])
def test_evaluation_features_come_from_the_runs_config(tmp_path, method, pool):
    argv = ["--ds_config", "ds_configs/cpu_demo.json", "--data.train_index", "train.json",
            *[a for p in presets(method) for a in ("--config", str(p))]]
    (tmp_path / "config.json").write_text(json.dumps(to_dict(parse_args(argv))))  # as pretraining writes it
    assert feature_pool(tmp_path) == pool


def test_rpe_comes_from_the_exported_encoder(tmp_path):
    (tmp_path / "encoder.json").write_text(json.dumps({"timm_kwargs": {"img_size": 16, "rpe": True}}))
    assert encoder_has_rpe(tmp_path)
    (tmp_path / "encoder.json").write_text(json.dumps({"timm_kwargs": {"img_size": 32}}))
    assert not encoder_has_rpe(tmp_path)


def test_demo_help_lists_the_methods_and_refuses_an_unknown_variant_before_training(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert f"{{{','.join(demo_methods())}}}" in out and "mixedae: homocon_only," in out and "rpe_coord" in out
    with pytest.raises(SystemExit) as e:
        demo.main(["--method", "energy", "--variant", "no_such"])
    assert e.value.code == 2
    assert "convnext_atto" in capsys.readouterr().err


class _Launched(Exception):
    """Raised in place of launching: the test reads the command the study would run."""


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_pretraining_and_fine_tuning_both_checkpoint_often_enough_to_resume(tmp_path, monkeypatch, stage):
    # a study run may be killed at any time (the machine is needed, or replaced): a fine-tune that
    # checkpoints only at its end would lose everything it did
    from experiments.fashion_mnist import study
    from train.finetune import RECIPE

    def launched(run, cmd):
        raise _Launched(cmd)

    monkeypatch.setattr(study, "_timed", launched)
    with pytest.raises(_Launched) as seen:
        if stage == "pretrain":
            study.pretrain(STUDY["mae"], tmp_path, 3, 1.0, tmp_path / "train.json", tmp_path / "test.json", 600, False)
        else:
            study.finetune(tmp_path, 3, 1.0, 600, tmp_path / "train.json", tmp_path / "test.json", None, False)
    cmd = seen.value.args[0]
    assert cmd[:2] == ["-m", f"train.{stage}"]
    cfg = parse_args((RECIPE if stage == "finetune" else []) + cmd[2:])  # the options the run will get
    assert (cfg.resume, cfg.seed, cfg.output_dir) == ("auto", 3, str(tmp_path))
    assert cfg.run.ckpt_every == study.CKPT_EVERY
