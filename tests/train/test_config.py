import json

import pytest

from train.config import ConfigError, PretrainConfig, parse_args

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
