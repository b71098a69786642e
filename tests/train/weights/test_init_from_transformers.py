"""--model.init_from <transformers folder>: continued MAE pretraining (encoder and decoder), an
encoder from ViTModel, fine-tuning that continues a ViTForImageClassification's classifier; a folder
that does not fit is refused before start, naming both sizes."""
import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET, run_pretrain_calls
from hf_folders import vit_folder, vit_mae_folder

from train.engine.state_files import read_tensors

transformers = pytest.importorskip("transformers")


def _module(run_dir) -> dict[str, torch.Tensor]:
    return read_tensors(run_dir / "checkpoints" / "step00000001")


def _same(ours: dict[str, torch.Tensor], prefix: str, expected: dict[str, torch.Tensor]) -> None:
    assert expected and all(torch.equal(ours[prefix + k], v) for k, v in expected.items()), prefix


def test_three_transformers_architectures_start_runs(tmp_path):
    """The first step has lr 0 (warmup from 0), so the step-1 weights are exactly the imported ones."""
    mae_dir, mae = vit_mae_folder(tmp_path / "vit-mae")
    vit_dir, vit = vit_folder(tmp_path / "vit", "ViTModel")
    cls_dir, cls = vit_folder(tmp_path / "vit-cls", "ViTForImageClassification", num_labels=10)
    common = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--run.progress", "false",
              "--run.max_steps", "1"]
    finetune = ["--objective", "finetune", "--finetune.num_classes", "10", "--model.global_pool", "token"]
    proc = run_pretrain_calls([
        [*common, "--output_dir", str(tmp_path / "run-mae"), "--model.init_from", str(mae_dir)],
        [*common, "--output_dir", str(tmp_path / "run-vit"), "--model.init_from", str(vit_dir)],
        [*common, *finetune, "--output_dir", str(tmp_path / "run-ft"), "--model.init_from", str(cls_dir)],
    ])
    log = proc.stdout + proc.stderr
    assert (f"initialised encoder + decoder from {mae_dir} (ViTMAEForPreTraining; config.json norm_pix_loss False, "
            f"this run mae.norm_pix_loss True)") in log  # transformers' default is not the run's
    assert f"from {vit_dir} (ViTModel; ViTModel's pooler (dense + tanh) dropped" in log
    assert f"initialised encoder + classifier from {cls_dir} (ViTForImageClassification)" in log
    _same(_module(tmp_path / "run-mae"), "encoder.", mae.encoder)
    _same(_module(tmp_path / "run-mae"), "decoder.", mae.decoder)  # continued pretraining resumes the decoder
    _same(_module(tmp_path / "run-vit"), "encoder.", vit.encoder)
    _same(_module(tmp_path / "run-ft"), "encoder.", {**cls.encoder, **cls.head})


def test_a_folder_of_other_sizes_is_refused_before_start_naming_both(tmp_path):
    from train.config.errors import ConfigError
    from train.config.parsing import parse_args
    from train.run.prestart import check_before_start

    folder, _ = vit_mae_folder(tmp_path / "vit-mae")
    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(tmp_path / "run"),
                      "--model.init_from", str(folder), "--model.name", "vit_mini_patch4"])
    with pytest.raises(ConfigError) as refused:
        check_before_start(cfg)
    assert str(refused.value).startswith(
        f"model.init_from: {folder} (ViTMAEForPreTraining) does not fit the configured encoder: config.json "
        f"hidden_size 32 vs vit_mini_patch4's embed_dim 128; ")
    assert str(refused.value).endswith("give --model.name vit_debug_patch4 (or another folder)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("edit, says", [
    ({"hidden_size": "32"}, r"config.json gives hidden_size \"32\" \(a positive integer\)"),
    ({"image_size": None}, r"config.json gives image_size null \(a positive integer or \[h, w\]\)"),
    ({"num_channels": 3}, r"config.json num_channels 3 vs vit_debug_patch4's in_chans 1; give --model.in_chans 3"),
    ("index without weight_map", r"model.safetensors.index.json has no weight_map of tensor name -> shard file"),
    ("index a list", r"model.safetensors.index.json is not a JSON object of transformers' shard index"),
])
def test_a_malformed_transformers_folder_is_refused_in_one_line_naming_the_key(tmp_path, edit, says):
    """A string where transformers writes an integer, a null image size or a shard index without
    its weight_map ended in TypeError / KeyError / AttributeError tracebacks; a folder of other
    input channels was told to give the model name it already had."""
    import json

    from train.config.errors import ConfigError
    from train.config.parsing import parse_args
    from train.run.prestart import check_before_start

    folder, _ = vit_mae_folder(tmp_path / "vit-mae")
    config = json.loads((folder / "config.json").read_text())
    if isinstance(edit, dict):
        (folder / "config.json").write_text(json.dumps({**config, **edit}))
    else:  # the weights as a one-shard set with a damaged index
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        index = {"metadata": {}} if edit == "index without weight_map" else []
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=says):
        check_before_start(parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir",
                                       str(tmp_path / "run"), "--model.init_from", str(folder)]))
    assert not (tmp_path / "run").exists()
