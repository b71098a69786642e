import json
import typing

import pytest

from train.config.errors import ConfigError
from train.config.options import PretrainConfig
from train.config.parsing import parse_args

DS = ["--ds_config", "ds_configs/cpu_debug.json", "--data.source", "synthetic"]


def test_defaults_are_the_mae_recipe():
    c = PretrainConfig()
    assert (c.optim.blr, c.optim.weight_decay, c.optim.betas) == (1.5e-4, 0.05, (0.9, 0.95))
    assert (c.optim.warmup_epochs, c.mae.mask_ratio, c.mae.norm_pix_loss) == (40, 0.75, True)
    assert (c.mae.decoder_dim, c.mae.decoder_depth, c.mae.decoder_heads) == (512, 8, 16)


def test_typed_overrides_both_syntaxes():
    c = parse_args([*DS, "--optim.blr", "1e-3", "--run.max_steps=1e3", "--optim.betas", "0.9,0.99",
                    "--run.tensorboard", "false", "--local_rank=3"])
    assert c.optim.blr == 1e-3 and c.run.max_steps == 1000 and c.optim.betas == (0.9, 0.99)
    assert c.run.tensorboard is False


@pytest.mark.parametrize("args,message", [
    (["--optim.bl", "1"], "did you mean 'optim.blr'"),
    (["--mae.mask_rato", "0.5"], "did you mean 'mae.mask_ratio'"),
    (["--run.max_steps", "1.5"], "run.max_steps"),
    (["--run.tensorboard", "maybe"], "true or false"),
    (["--mae.mask_ratio", "1.0"], "mask_ratio"),
    (["--model.name", "vit_bse_patch16"], "did you mean 'vit_base_patch16'"),
    (["--model.attn_backend", "fast"], "unknown attention backend"),
    (["--optim.betas", "0.9"], "2 comma-separated"),
    (["--optim.epochs", "10", "--optim.warmup_epochs", "20"], "warmup_epochs"),
    (["--optim.blr"], "needs a value"),
    (["--objective", "mixedea"], r"^objective 'mixedea' is unknown; choose one of \[.*\]; did you mean 'mixedae'\?$"),
    (["--objective", "xyz"], r"^objective 'xyz' is unknown; choose one of \[.*'mae'.*\]$"),  # nothing close: no guess
])
def test_bad_options_are_named(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*DS, *args])


def test_ds_config_required():
    with pytest.raises(ConfigError, match="--ds_config is required"):
        parse_args([])


def test_preset_then_cli_override(tmp_path):
    preset = tmp_path / "p.json"
    preset.write_text(json.dumps({"optim": {"blr": 0.5, "epochs": 3, "warmup_epochs": 1}, "run": {"log_every": 7}}))
    c = parse_args([*DS, "--config", str(preset), "--optim.blr", "0.25"])
    assert (c.optim.blr, c.optim.epochs, c.run.log_every) == (0.25, 3, 7)
    preset.write_text(json.dumps({"optim": {"blrr": 0.5}}))
    with pytest.raises(ConfigError, match="optim.blr"):
        parse_args([*DS, "--config", str(preset)])


def test_mlomae_refuses_its_training_index_as_the_reported_split():
    base = ["--ds_config", "ds_configs/cpu_debug.json", "--objective", "mlomae", "--data.train_index", "a/train.json"]
    with pytest.raises(ConfigError, match="every MLO-MAE level reads"):
        parse_args([*base, "--data.eval_index", "a/../a/train.json"])
    assert parse_args([*base, "--data.eval_index", "a/test.json"]).data.eval_index == "a/test.json"
    with pytest.raises(ConfigError, match="has none"):  # MAE has no classifier to score
        parse_args([*DS, "--data.eval_index", "a/test.json"])


def test_every_number_declares_its_range_and_its_default_lies_in_it():
    """A new numeric option without `field(..., metadata={"range": ...})` fails here: its values
    would only be checked to be finite."""
    from train.config.options import options

    for key, option in options().items():
        kinds = typing.get_args(option.type) if typing.get_origin(option.type) is tuple else (option.type,)
        if kinds[0] not in (int, float):
            continue
        assert option.range is not None, f"--{key} declares no range"
        option.check(option.default)


def test_a_value_outside_its_range_is_refused_wherever_it_was_set():
    """validate() checks every section's ranges: a config built in code too, another objective's
    section included."""
    cfg = PretrainConfig(ds_config="ds_configs/cpu_debug.json")
    cfg.data.source = "synthetic"
    cfg.validate()
    cfg.mixedae.temperature = -0.1
    with pytest.raises(ConfigError, match=r"option mixedae.temperature must be > 0, got -0\.1 \(HomoCon tau"):
        cfg.validate()
    cfg.mixedae.temperature = 0.1
    cfg.run.max_steps = True  # a bool is not a number
    with pytest.raises(ConfigError, match="option run.max_steps must be an integer, got true"):
        cfg.validate()


def test_booleans_on_the_command_line_are_true_or_false_in_any_case():
    assert parse_args([*DS, "--run.export", "False", "--run.compile", "TRUE"]).run.compile is True
    for word in ("yes", "no", "on", "1", "0", ""):
        with pytest.raises(ConfigError, match=f'option run.export must be true or false, got "{word}"'):
            parse_args([*DS, "--run.export", word])


def test_help_shows_each_numbers_range():
    from train.config.parsing import help_text

    text = help_text()
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  --") and "default" in line}
    assert lines["--optim.blr"].split()[2:6] == ["default", "0.00015", ">", "0"]
    assert "in [0, 1)" in lines["--optim.betas"] and "in (0, 1)" in lines["--mae.mask_ratio"]
    assert ">= -1" in lines["--data.num_workers"] and "in [0, 2147483647]" in lines["--seed"]
    assert "presets that set one option to different values are refused" in text


@pytest.mark.parametrize("objective", ["mae", "mixedae", "maeplus", "mlomae", "finetune", "linprobe"])
def test_a_timm_backbone_is_refused_for_every_objective_but_energy(objective):
    """A ConvNeXt has no patch tokens to mask or mix and no ViT head: MAE and MixedAE ended in a
    ZeroDivisionError, fine-tuning and the probe in AttributeErrors (the probe after writing its folder)."""
    with pytest.raises(ConfigError, match=rf"model.name timm/convnext_atto is a timm backbone, which only --objective "
                                          rf"energy trains; {objective} needs a ViT of this codebase"):
        parse_args([*DS, "--objective", objective, "--model.name", "timm/convnext_atto"])
    assert parse_args([*DS, "--objective", "energy", "--model.name", "timm/convnext_atto"]).model.name


def test_an_augmentation_policy_timm_cannot_build_is_refused_before_start():
    """A typo in data.randaug failed inside timm after the run folder was written (AssertionError)."""
    randaug = ["--ds_config", "ds_configs/cpu_debug.json", "--data.source", "shards", "--data.train_index", "x.json",
               "--objective", "finetune", "--data.train_transform", "randaug"]
    with pytest.raises(ConfigError, match=r"data.randaug 'rand_m9' is no timm augmentation policy .* give one such as "
                                          r"rand-m9-mstd0.5-inc1"):
        parse_args([*randaug, "--data.randaug", "rand_m9"])
    for policy in ("rand-m7-mstd0.5", "augmix-m5", "original", ""):  # '' is none
        assert parse_args([*randaug, "--data.randaug", policy]).data.randaug == policy


@pytest.mark.parametrize("micro, accum, world", [(8, 1, 1), (4, 2, 1), (2, 2, 2)])
def test_peak_lr_and_schedule_steps_follow_the_global_batch_not_the_micro_batch(micro, accum, world):
    """The same global batch of 8, however it is split into micro-batches, accumulation and ranks:
    the same peak lr (blr x 8 / 256) and the same optimizer-step counts (epoch_size // 8 an epoch)."""
    from train.config.ds_config import BatchPlan
    from train.config.plan import peak_lr, schedule_steps

    cfg = parse_args(["--ds_config", "ds_configs/cpu_debug.json", "--config", "train/configs/mae/debug.json"])
    plan = BatchPlan(micro, accum, world)
    assert plan.global_batch == 8
    assert peak_lr(cfg, plan) == pytest.approx(cfg.optim.blr * 8 / 256)
    per_epoch = cfg.data.epoch_size // 8
    assert per_epoch > 1  # the preset's epoch tells a global batch from a micro-batch
    assert schedule_steps(cfg, plan) == (per_epoch, per_epoch * cfg.optim.epochs, per_epoch * cfg.optim.warmup_epochs)


def test_an_epoch_smaller_than_the_global_batch_is_refused_with_the_largest_micro_batch_that_fits():
    """100 samples, micro 16 x accumulation 4 x 2 ranks = 128: the micro-batch to suggest is the largest
    whose global batch (micro x 4 x 2) still fits in 100, with the accumulation and ranks as they are."""
    from train.config.ds_config import BatchPlan
    from train.config.plan import schedule_steps

    cfg = parse_args(["--ds_config", "ds_configs/cpu_debug.json", "--config", "train/configs/mae/debug.json",
                      "--data.epoch_size", "100"])
    micro, accum, world, samples = 16, 4, 2, 100
    most = max(m for m in range(1, micro) if m * accum * world <= samples)
    with pytest.raises(ConfigError, match=rf"train_micro_batch_size_per_gpu of at most {most} \(it sets {micro}\)"):
        schedule_steps(cfg, BatchPlan(micro, accum, world))


def test_parsing_a_configuration_loads_neither_timm_nor_torchvision():
    """The options, their checks and every method's objective class import without timm (which
    loads all its models) or torchvision (which loads torch._dynamo): seconds of start-up that a
    command's --help or a bad value would otherwise pay; the data transforms load them where a run
    builds its data."""
    import subprocess
    import sys

    from conftest import REPO

    code = ("import sys; from train.config.parsing import parse_args; from model.objectives import list_objectives; "
            "parse_args(['--ds_config', 'ds_configs/cpu_debug.json', '--config', 'train/configs/mae/debug.json']); "
            "print(sorted(m for m in ('timm', 'torchvision', 'torch._dynamo') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_the_encoder_built_from_a_config_has_its_drop_path_rate_and_in_chans():
    """--model.drop_path_rate and --model.in_chans reach the encoder: stochastic depth rising
    linearly from 0 to the rate over the blocks (MAE fine-tuning's 0.1 ... 0.3), the patch
    projection reading that many channels."""
    from model.registry import create_model
    from train.config.plan import build_encoder

    cfg = parse_args(["--ds_config", "ds_configs/cpu_debug.json", "--config", "train/configs/mae/debug.json",
                      "--model.drop_path_rate", "0.3", "--model.in_chans", "2"])
    encoder = build_encoder(cfg)
    depth = len(encoder.blocks)
    assert depth > 1
    want = [0.3 * i / (depth - 1) for i in range(depth)]
    got = [float(getattr(b.drop_path, "drop_prob", 0.0)) for b in encoder.blocks]
    assert got == pytest.approx(want) and got[-1] == pytest.approx(0.3)
    reference = create_model(cfg.model.name, drop_path_rate=0.3, in_chans=2)
    assert got == [float(getattr(b.drop_path, "drop_prob", 0.0)) for b in reference.blocks]
    assert encoder.patch_embed.proj.weight.shape == reference.patch_embed.proj.weight.shape
    assert encoder.patch_embed.proj.weight.shape[1] == 2  # neither the preset's 1 nor the registry's 3


@pytest.mark.parametrize("args, message", [
    (["--run.overwrite", "--output_dir", "runs/t1"],
     r"^--run.overwrite needs a value: true or false \(e.g. --run.overwrite true\)$"),
    (["--run.tensorboard", "--optim.blr", "1"],
     r"^--run.tensorboard needs a value: .*\(e.g. --run.tensorboard false\)$"),
    (["--optim.blr", "--run.max_steps", "2"], r"^--optim.blr needs a value: float > 0 \(e.g. --optim.blr 0.00015\)$"),
    (["--optim.betas", "--seed=3"],
     r"^--optim.betas needs a value: float,float in \[0, 1\) \(e.g. --optim.betas 0.9,0.95\)$"),
    (["--model.global_pool", "--seed", "3"],
     r"^--model.global_pool needs a value: token \(cls\) \| avg .* \(e.g. --model.global_pool token\)$"),
    (["--resume", "--seed", "3"], r"^--resume needs a value: '' \| 'auto' .*path to a checkpoint$"),  # no example: ''
    (["--config", "--seed", "3"], r"^--config needs a value: a JSON preset \(e.g. --config train/configs/"),
    (["--run.max_steps"], r"^--run.max_steps needs a value: int >= 0 \(e.g. --run.max_steps 0\)$"),  # the last word
    (["--dry_run", "--seed", "3"], r"^unknown option 'dry_run'"),  # not an option: named as such, not as valueless
    (["--optim.bl", "--seed", "3"], r"^unknown option 'optim.bl'; did you mean 'optim.blr'\?$"),
])
def test_an_option_whose_next_word_is_an_option_needs_a_value(args, message):
    """`--key --other ...`: the next word (`--` then a letter) is never taken as --key's value."""
    with pytest.raises(ConfigError, match=message):
        parse_args([*DS, *args])


def test_a_negative_number_is_a_value_not_an_option():
    cfg = parse_args(["--ds_config", "ds_configs/cpu_debug.json", "--data.source", "shards", "--data.train_index",
                      "a/train.json", "--data.num_workers", "-1", "--optim.blr", "1e-3"])
    assert cfg.data.num_workers == -1 and cfg.optim.blr == 1e-3
