"""train/export.py --format transformers: a checkpoint -> a folder transformers' from_pretrained
loads with nothing missing or unexpected, computing what our checkpoint computes."""
import json
import sys

import numpy as np
import pytest
import torch
from conftest import run_pretrain
from PIL import Image
from safetensors.torch import load_file

from model import create_model
from model.objectives import build_objective
from model.objectives.mae import MAEConfig
from train.engine.checkpoint import read_meta
from train.engine.state_files import read_tensors
from train.export import main as export_main
from train.run.folder import read_metrics
from train.weights.export import export_transformers, pretrained_state
from train.weights.transformers import build_config, choose_architecture

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mae_run(tmp_path_factory):
    """The MAE debug preset (vit_debug_patch4: 28 px, 1 channel; decoder 32 wide, 1 block, 2 heads), 2 steps."""
    out = tmp_path_factory.mktemp("mae")
    run_pretrain(out, "--run.max_steps", "2")
    return out


def _tag(run_dir):
    return run_dir / "checkpoints" / "step00000002"


def _our_mae(tag_dir):
    module = read_tensors(tag_dir)
    mae = build_objective("mae", create_model("vit_debug_patch4", in_chans=1),
                          MAEConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2))
    mae.load_state_dict({k: v.float() for k, v in module.items() if k.startswith(("encoder.", "decoder."))})
    return mae.eval()


def _loading_info_is_clean(info: dict) -> bool:
    return not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])


def test_mae_run_exports_vit_mae_for_pretraining_with_the_same_loss_and_features(mae_run, tmp_path, capsys):
    out = export_main(["--checkpoint", str(mae_run), "--format", "transformers", "--out", str(tmp_path / "hf")])
    assert out == tmp_path / "hf" and "from transformers import ViTMAEForPreTraining" in capsys.readouterr().out
    theirs, info = transformers.ViTMAEForPreTraining.from_pretrained(out, output_loading_info=True)
    assert _loading_info_is_clean(info)
    theirs.eval()
    config = json.loads((out / "config.json").read_text())
    assert config["layer_norm_eps"] == 1e-6 and config["norm_pix_loss"] is True and config["num_channels"] == 1
    ours = _our_mae(_tag(mae_run))
    torch.manual_seed(0)
    x, noise = torch.randn(4, 1, 28, 28), torch.rand(4, 49)
    with torch.no_grad():
        a, b = theirs(pixel_values=x, noise=noise), ours({"image": x, "mask_noise": noise})
        assert abs(a.loss.item() - b["loss"].item()) <= 1e-6 and (a.logits - b["pred"]).abs().max() <= 1e-6
        latent = ours.encode(x, ours.make_masking({"mask_noise": noise}, 4, x.device))  # (B, 1+L, D) kept tokens
        assert (theirs.vit(pixel_values=x, noise=noise).last_hidden_state - latent).abs().max() <= 1e-6
    assert not (out.parent / "hf.partial").exists()


def test_the_folder_carries_the_image_processor_and_a_model_card(mae_run, tmp_path):
    out, _ = export_transformers(_tag(mae_run), tmp_path / "hf")
    processor = transformers.AutoImageProcessor.from_pretrained(out)
    pixels = np.random.default_rng(0).integers(0, 256, (28, 28, 1), dtype=np.uint8)
    got = processor(images=pixels, return_tensors="pt")["pixel_values"][0]
    # the run's normalisation of 1-channel (synthetic) input: (x / 255 - 0.5) / 0.25, at the run's 28 px
    want = (torch.from_numpy(pixels).permute(2, 0, 1).float() / 255 - 0.5) / 0.25
    assert got.shape == (1, 28, 28) and torch.allclose(got, want, atol=1e-6)
    # images of other sizes are resized as our transforms resize them: bicubic (PIL's code, as transformers records it)
    assert json.loads((out / "preprocessor_config.json").read_text())["resample"] == Image.Resampling.BICUBIC
    card = (out / "README.md").read_text()
    last = read_metrics(mae_run)[-1]
    assert "`mae`: mask_ratio 0.75, norm_pix_loss true, decoder_dim 32" in card
    assert "synthetic images (data.source synthetic)" in card and "global batch 8, blr 0.0015" in card
    assert f"step 2, loss {round(last['loss'], 6)}" in card
    assert all(oct(p.stat().st_mode)[-3:] != "600" for p in out.iterdir())  # readable beyond the owner
    # transformers' pipeline would read 1-channel images as RGB and run mask_ratio 0.75: no pipeline is named
    assert "pipeline_tag" not in card


def test_the_cards_feature_lines_give_the_encoders_features_of_the_whole_image(mae_run, tmp_path):
    """The lines under "## Features", run as written: every patch, in image order, as our encoder
    computes them (the saved mask_ratio 0.75 would give a random quarter of the patches)."""
    out, _ = export_transformers(_tag(mae_run), tmp_path / "hf")
    card = (out / "README.md").read_text()
    # a mask ratio of 0.75 keeps a quarter of the patches for the encoder
    assert "so the encoder as saved sees a random 0.25 of the patches" in card
    code = card.split("## Features")[1].split("```python")[1].split("```")[0].replace("<this folder>", str(out))
    pixel_values = torch.randn(3, 1, 28, 28)
    scope = {"pixel_values": pixel_values}
    with torch.no_grad():
        exec(code, scope)
        ours = _our_mae(_tag(mae_run)).encoder.forward_features(pixel_values)
    assert scope["features"].shape == (3, 50, 32) and (scope["features"] - ours).abs().max() <= 1e-6


def _other_run_meta(tag_dir, **changes) -> dict:
    meta = read_meta(tag_dir)
    meta["encoder_timm_kwargs"] = {**meta["encoder_timm_kwargs"], **changes.pop("kwargs", {})}
    return {**meta, **changes}


def test_other_objectives_export_the_encoder_as_vit_model(mae_run, tmp_path):
    from train.weights.export import _encoder_of, _module_state
    from train.weights.transformers import write_folder

    tag = _tag(mae_run)
    encoder = _encoder_of(_module_state(tag), tag)
    out, name = write_folder(encoder, {}, _other_run_meta(tag, objective="mixedae"), tag, tmp_path / "hf")
    assert name == "ViTModel"
    theirs, info = transformers.ViTModel.from_pretrained(out, add_pooling_layer=False, output_loading_info=True)
    assert _loading_info_is_clean(info)
    # the card's load lines, run as written, build the encoder without the pooler it does not have
    card = (out / "README.md").read_text()
    code = card.split("## Load")[1].split("```python")[1].split("```")[0]
    scope: dict = {}
    exec(code.replace("'<this folder or its Hub repository>'", repr(str(out))), scope)
    assert isinstance(scope["model"], transformers.ViTModel) and scope["model"].pooler is None
    _, info = transformers.ViTModel.from_pretrained(out, output_loading_info=True)
    # why the card says add_pooling_layer=False: by default transformers adds a pooler the encoder lacks
    assert sorted(info["missing_keys"]) == ["pooler.dense.bias", "pooler.dense.weight"]
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        ours = _our_mae(tag).encoder.forward_features(x)
        assert (theirs.eval()(pixel_values=x).last_hidden_state - ours).abs().max() <= 1e-6


def test_only_an_mae_run_exports_its_decoder_as_vit_mae(mae_run):
    """ViTMAEForPreTraining is MAE's decoder and loss; MAE+ (without iRPE) also trains a decoder.*,
    but one fed every token by the encoder (no mask tokens of its own): its encoder is exported alone."""
    from train.weights.export import _module_state

    tag = _tag(mae_run)
    decoder = {k: v for k, v in _module_state(tag).items() if k.startswith("decoder.")}
    assert decoder
    assert choose_architecture(_other_run_meta(tag), {}, decoder) == "ViTMAEForPreTraining"
    assert choose_architecture(_other_run_meta(tag, objective="maeplus"), {}, decoder) == "ViTModel"


def test_a_classifier_exports_with_the_labels_of_its_shards(mae_run, tmp_path):
    from train.weights.export import _encoder_of, _module_state
    from train.weights.transformers import write_folder

    tag = _tag(mae_run)
    index = tmp_path / "train.json"
    index.write_text(json.dumps({"shards": [], "classes": ["cat", "dog", "emu"]}))
    meta = _other_run_meta(tag, objective="finetune", kwargs={"num_classes": 3})
    meta["config"] = {**meta["config"], "data": {**meta["config"]["data"], "train_index": str(index)}}
    torch.manual_seed(0)
    encoder = {**_encoder_of(_module_state(tag), tag), "head.weight": torch.randn(3, 32), "head.bias": torch.randn(3)}
    out, name = write_folder(encoder, {}, meta, tag, tmp_path / "hf")
    assert name == "ViTForImageClassification"
    theirs, info = transformers.ViTForImageClassification.from_pretrained(out, output_loading_info=True)
    assert _loading_info_is_clean(info)
    assert theirs.config.id2label == {0: "cat", 1: "dog", 2: "emu"} and theirs.config.label2id["emu"] == 2
    ours = create_model("vit_debug_patch4", in_chans=1, num_classes=3)
    ours.load_state_dict(encoder)
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert (theirs.eval()(pixel_values=x).logits - ours.eval()(x)).abs().max() <= 1e-6
    assert json.loads((out / "config.json").read_text())["architectures"] == ["ViTForImageClassification"]


@pytest.mark.parametrize("names, labels", [
    (["cat", "dog", "emu"], ["cat", "dog", "emu"]),
    (["cat", "dog", "emu", "fox"], ["LABEL_0", "LABEL_1", "LABEL_2"]),  # an index of another head: not its labels
])
def test_class_names_are_used_only_when_the_index_names_every_class(tmp_path, names, labels):
    index = tmp_path / "train.json"
    index.write_text(json.dumps({"shards": [], "classes": names}))
    meta = {"objective": "finetune", "config": {"data": {"train_index": str(index)}}}
    arch = {"img_size": 28, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 2, "num_heads": 2,
            "mlp_ratio": 4.0}
    config = build_config(transformers, "ViTForImageClassification", meta, arch, 3)
    assert config.id2label == dict(enumerate(labels)) and config.label2id == {n: i for i, n in enumerate(labels)}


def test_continued_pretraining_starts_from_the_encoder_and_the_mae_decoder(mae_run):
    """--model.init_from <run>: the tag's fp32 encoder (timm names) and decoder (official MAE names)."""
    module = read_tensors(_tag(mae_run))
    state = pretrained_state(_tag(mae_run))
    want = {k.split(".", 1)[1]: v.float() for k, v in module.items() if k.startswith(("encoder.", "decoder."))}
    assert any(k.startswith("decoder.") for k in module) and "decoder_embed.weight" in state
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)


@pytest.mark.parametrize("kwargs, why", [
    ({"global_pool": "avg"}, "pools the patch tokens .model.global_pool avg"),
    ({"rpe": True}, "iRPE tables"),
    ({"timm_model": "convnext_atto"}, "timm backbone convnext_atto"),
])
def test_encoders_transformers_cannot_hold_are_refused(mae_run, kwargs, why):
    meta = _other_run_meta(_tag(mae_run), kwargs=kwargs)
    with pytest.raises(ValueError, match=why + ".*export it with --format timm"):
        choose_architecture(meta, {}, {})


def test_an_output_folder_with_other_files_loses_nothing(mae_run, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files than a transformers export's"):
        export_transformers(_tag(mae_run), tmp_path / "hf")
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["notes.txt"]
    out, _ = export_transformers(_tag(mae_run), tmp_path / "again")
    first = load_file(str(out / "model.safetensors"))
    out, _ = export_transformers(_tag(mae_run), out)  # an earlier export is replaced
    assert all(torch.equal(first[k], v) for k, v in load_file(str(out / "model.safetensors")).items())


def test_without_transformers_the_export_says_how_to_install_it(mae_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(ValueError, match=r"needs the transformers package, which is not installed: "
                                         r"pip install -e '\.\[hf\]'"):
        export_transformers(_tag(mae_run), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_tags_export_is_named_after_it_and_printed_without_torchaos_deprecation_lines(mae_run, tmp_path):
    """The command as typed, for a tag: the folder is <run>/transformers_<tag> (the run's own
    <run>/transformers is a run folder's export), and its output holds no line of the two
    pytree-constant deprecations torchao's import logs (KernelPreference, ScaleCalculationMode)."""
    import os
    import shutil
    import subprocess

    from conftest import REPO

    shutil.copytree(mae_run, tmp_path / "run")
    tag = _tag(tmp_path / "run")
    proc = subprocess.run([sys.executable, "train/export.py", "--checkpoint", str(tag), "--format", "transformers"],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "register_constant" not in proc.stderr and "Enum subclass" not in proc.stderr, proc.stderr
    out = tmp_path / "run" / "transformers_step00000002"
    assert proc.stdout.startswith(f"wrote {out} (ViTMAEForPreTraining) from {tag}\n")
    assert (out / "model.safetensors").is_file() and not (tmp_path / "run" / "transformers").exists()


def test_only_the_enum_constant_deprecation_is_silenced():
    """The filter on torch.utils._pytree's logger drops that deprecation's records alone."""
    import logging

    from train.export import _WithoutEnumConstantDeprecation

    def record(message, *args):
        return logging.LogRecord("torch.utils._pytree", logging.WARNING, __file__, 1, message, args, None)

    quiet = _WithoutEnumConstantDeprecation()
    assert not quiet.filter(record("%s is an Enum subclass and is now natively supported by torch.compile as an "
                                   "opaque value type. Calling register_constant() on Enum subclasses is deprecated "
                                   "and will be an error in a future release.", "<enum 'KernelPreference'>"))
    assert quiet.filter(record("%s cannot be registered as a pytree", "<class 'X'>"))
