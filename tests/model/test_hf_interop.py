"""transformers ViT / ViT-MAE <-> ours: the same numbers after import, bit-exact round trips, each
difference of transformers' ViT from ours, and the refusals. transformers' models are built from
config objects with random weights: nothing is downloaded."""
import json
import re

import pytest
import torch
from hf_folders import DEBUG, perturbed
from safetensors.torch import save_file

from model import create_model
from model.hf_interop import (
    DEFAULTS,
    check_folder_fits,
    config_notes,
    decoder_arch,
    encoder_arch,
    encoder_from_transformers,
    from_transformers,
    is_transformers_folder,
    load_transformers_folder,
    mae_from_transformers,
    read_config,
    to_transformers,
    transformers_config,
)
from model.objectives import build_objective
from model.objectives.mae import MAEConfig, MAEObjective
from model.pos_embed import sincos_2d
from model.vit import VisionTransformer

transformers = pytest.importorskip("transformers")

SMALL = DEBUG  # vit_debug_patch4's sizes, 1e-6 layer-norm eps as ours
SMALL_DECODER = dict(decoder_hidden_size=16, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
                     decoder_intermediate_size=64)


def small_mae(**config) -> "transformers.ViTMAEForPreTraining":
    torch.manual_seed(0)
    cfg = transformers.ViTMAEConfig(**{**SMALL, **SMALL_DECODER, **config})
    return perturbed(transformers.ViTMAEForPreTraining(cfg))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("norm_pix_loss, attention", [(True, "sdpa"), (False, "sdpa"), (True, "eager")])
def test_vit_mae_for_pretraining_same_loss_and_predictions_after_import(tmp_path, norm_pix_loss, attention):
    """A folder save_pretrained wrote (transformers' file layout) -> our MAE: same loss, predictions
    and mask from the same images and masking noise (its `noise` is our batch's `mask_noise`), with
    transformers' default attention (SDPA) and its matmul-softmax one."""
    theirs = small_mae(norm_pix_loss=norm_pix_loss, attn_implementation=attention)
    assert theirs.config._attn_implementation == attention
    theirs.save_pretrained(tmp_path)
    ours = mae_from_transformers(tmp_path).eval()
    assert ours.cfg.norm_pix_loss is norm_pix_loss and ours.cfg.mask_ratio == theirs.config.mask_ratio
    torch.manual_seed(2)
    x, noise = torch.randn(3, 1, 28, 28), torch.rand(3, 49)
    with torch.no_grad():
        a, b = theirs(pixel_values=x, noise=noise), ours({"image": x, "mask_noise": noise})
    assert torch.equal(a.mask, b["mask"])  # the smallest noise is kept by both
    assert max_diff(a.logits, b["pred"]) <= 1e-6 and abs(a.loss.item() - b["loss"].item()) <= 1e-6


def test_vit_mae_for_pretraining_parity_at_vit_b16():
    """ViT-B/16 with the MAE decoder (512 wide, 8 blocks): transformers' in-memory names (5.x
    modules) -> ours. Both are built on the meta device and given the same random tensors."""
    config = transformers.ViTMAEConfig(layer_norm_eps=1e-6, norm_pix_loss=True)
    with torch.device("meta"):
        theirs = transformers.ViTMAEForPreTraining(config)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.empty(v.shape).uniform_(-0.05, 0.05, generator=gen) for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(state, assign=True)
    theirs.eval()
    full = {**DEFAULTS, **config.to_dict()}
    with torch.device("meta"):
        ours = MAEObjective(VisionTransformer(**encoder_arch(full)), MAEConfig(**decoder_arch(full)))
    split = from_transformers(state)
    ours.encoder.load_state_dict(split.encoder, assign=True)
    ours.decoder.load_state_dict(split.decoder, assign=True)
    ours.eval()
    x, noise = torch.randn(1, 3, 224, 224, generator=gen), torch.rand(1, 196, generator=gen)
    with torch.no_grad():
        a, b = theirs(pixel_values=x, noise=noise), ours({"image": x, "mask_noise": noise})
    assert torch.equal(a.mask, b["mask"])
    assert max_diff(a.logits, b["pred"]) <= 1e-6 and abs(a.loss.item() - b["loss"].item()) <= 1e-6


def test_vit_mae_model_features_over_the_kept_tokens_are_ours(tmp_path):
    """ViTMAEModel masks inside its forward: with the same noise it keeps the same patches, and its
    features over them are our encoder's."""
    from model.objectives.masking import gather_tokens, masking_from_noise, num_kept

    theirs = perturbed(transformers.ViTMAEModel(transformers.ViTMAEConfig(**SMALL)))
    theirs.save_pretrained(tmp_path)
    ours = encoder_from_transformers(tmp_path).eval()
    x, noise = torch.randn(2, 1, 28, 28), torch.rand(2, 49)
    masking = masking_from_noise(noise, num_kept(49, 0.75))
    with torch.no_grad():
        out = theirs(pixel_values=x, noise=noise)
        latent = ours.forward_tokens(ours.add_cls_token(gather_tokens(ours.embed_patches(x), masking.ids_keep)))
    assert torch.equal(out.mask, masking.mask) and torch.equal(out.ids_restore, masking.ids_restore)
    assert max_diff(out.last_hidden_state, latent) <= 1e-6
    mae = build_objective("mae", create_model("vit_debug_patch4", in_chans=1),
                          MAEConfig(decoder_dim=16, decoder_depth=1, decoder_heads=2))
    assert load_transformers_folder(mae, tmp_path) == f"initialised encoder from {tmp_path} (ViTMAEModel)"


def _vit_config(**extra) -> "transformers.ViTConfig":
    return transformers.ViTConfig(**{**SMALL, **extra})


def test_vit_model_features_are_our_encoders_and_its_pooler_is_dropped(tmp_path):
    torch.manual_seed(0)
    theirs = perturbed(transformers.ViTModel(_vit_config()))
    theirs.save_pretrained(tmp_path)
    split = from_transformers(theirs.state_dict())
    assert split.dropped == ["pooler.dense.weight", "pooler.dense.bias"]  # dense + tanh: no counterpart here
    ours = encoder_from_transformers(tmp_path).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        out = theirs(pixel_values=x)
        assert max_diff(out.last_hidden_state, ours.forward_features(x)) <= 1e-6
        # our pooled feature is the cls token after the final norm, not transformers' pooler_output
        assert torch.equal(ours(x), ours.forward_features(x)[:, 0])
        assert not torch.allclose(ours(x), out.pooler_output, atol=1e-3)


def test_vit_for_image_classification_logits_are_ours(tmp_path):
    torch.manual_seed(0)
    theirs = perturbed(transformers.ViTForImageClassification(_vit_config(num_labels=5)))
    theirs.save_pretrained(tmp_path)
    ours = encoder_from_transformers(tmp_path).eval()
    assert ours.global_pool == "token" and ours.head.out_features == 5  # the cls token after the final norm
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert max_diff(theirs(pixel_values=x).logits, ours(x)) <= 1e-6


def _our_mae() -> MAEObjective:
    torch.manual_seed(0)
    enc = create_model("vit_debug_patch4", in_chans=1)
    return perturbed(build_objective("mae", enc, MAEConfig(decoder_dim=16, decoder_depth=1, decoder_heads=2)))


def _parts(objective: torch.nn.Module) -> tuple[dict, dict]:
    state = objective.state_dict()
    return ({k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")},
            {k.removeprefix("decoder."): v for k, v in state.items() if k.startswith("decoder.")})


def test_round_trip_ours_transformers_ours_is_bit_exact(tmp_path):
    """Ours -> transformers' file layout -> transformers' model (from_pretrained) -> its state_dict
    (its own module names) -> ours: every tensor bit-identical, nothing missing or unexpected."""
    mae = _our_mae()
    encoder, decoder = _parts(mae)
    head = {"head.weight": torch.randn(7, 32), "head.bias": torch.randn(7)}
    save_file(to_transformers(encoder, decoder, vit_prefix=True), str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    transformers.ViTMAEConfig(**transformers_config(mae.encoder.arch, {"decoder_dim": 16, "decoder_depth": 1,
                                                                       "decoder_heads": 2})).save_pretrained(tmp_path)
    theirs, info = transformers.ViTMAEForPreTraining.from_pretrained(tmp_path, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    back = from_transformers(theirs.state_dict())
    assert back.encoder.keys() == encoder.keys() and back.decoder.keys() == decoder.keys()
    assert all(torch.equal(back.encoder[k], v) for k, v in encoder.items())
    assert all(torch.equal(back.decoder[k], v) for k, v in decoder.items())
    again = from_transformers(to_transformers(encoder, head=head))  # a classifier: classifier.* and back
    assert all(torch.equal(again.head[k], v) for k, v in head.items())


def test_fixed_sincos_tables_are_ours(tmp_path):
    """transformers' ViT-MAE sin-cos table is ours, channel layout included (column half first), so
    MAE folders carry ours exactly. A ViT-MAE made from a config holds zero tables instead (the
    decoder's in transformers 4.x, both in 5.x); imported, they become the fixed tables."""
    model = transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(**SMALL, **SMALL_DECODER))
    model.save_pretrained(tmp_path)  # as made from the config
    assert not model.decoder.decoder_pos_embed.any()
    model.decoder.initialize_weights(49)  # what it fills the decoder's table with
    assert torch.equal(model.decoder.decoder_pos_embed[0], sincos_2d(16, (7, 7), cls_token=True))
    ours = mae_from_transformers(tmp_path)
    assert torch.equal(ours.decoder.decoder_pos_embed[0], sincos_2d(16, (7, 7), cls_token=True))
    assert torch.equal(ours.encoder.pos_embed[0], sincos_2d(32, (7, 7), cls_token=True))
    mae = build_objective("mae", create_model("vit_debug_patch4", in_chans=1),
                          MAEConfig(decoder_dim=16, decoder_depth=1, decoder_heads=2))
    assert "decoder_pos_embed all zero in the folder" in load_transformers_folder(mae, tmp_path)


def test_layer_norm_eps_of_transformers_default_is_read_as_ours(tmp_path):
    """transformers' ViT defaults to layer_norm_eps 1e-12 (the google/vit-* and facebook/vit-mae-*
    configs keep it); ours is 1e-6. The import says so, and the features move by little."""
    torch.manual_seed(0)
    theirs = perturbed(transformers.ViTModel(_vit_config(layer_norm_eps=1e-12), add_pooling_layer=False))
    theirs.save_pretrained(tmp_path)
    assert "layer_norm_eps 1e-12 read as 1e-06 (this ViT's)" in config_notes(read_config(tmp_path))
    ours = encoder_from_transformers(tmp_path).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        diff = max_diff(theirs(pixel_values=x).last_hidden_state, ours.forward_features(x))
    assert 0 < diff <= 1e-3  # small activations (the debug size): eps weighs more than in a trained ViT-B


def test_config_defaults_are_transformers_own():
    """config.json files of transformers 4.x leave out values equal to the defaults; ours are its."""
    for config in (transformers.ViTMAEConfig(), transformers.ViTConfig()):
        values = config.to_dict()
        assert {k: values[k] for k in DEFAULTS if k in values} == {k: DEFAULTS[k] for k in DEFAULTS if k in values}
    assert "decoder_hidden_size" in transformers.ViTMAEConfig().to_dict()


def test_notes_name_what_the_run_sets_otherwise(tmp_path):
    """norm_pix_loss (transformers' default false, ours true), the mask ratio and dropout come from
    the run, not the folder; the log line says where they differ."""
    small_mae(norm_pix_loss=False, mask_ratio=0.5, hidden_dropout_prob=0.1).save_pretrained(tmp_path)
    notes = config_notes(read_config(tmp_path), MAEConfig())
    assert notes == ["hidden_dropout_prob 0.1 not applied (this ViT has no dropout)",
                     "config.json norm_pix_loss False, this run mae.norm_pix_loss True",
                     "config.json mask_ratio 0.5, this run mae.mask_ratio 0.75"]


def test_another_image_size_resizes_the_position_tables(tmp_path):
    """A 32 px ViT-MAE folder into a 28 px MAE: both sin-cos tables become the 7x7 grid's own; a
    ViTModel's learned table is interpolated bicubically, as the other imports do."""
    big = small_mae(image_size=32)
    with torch.no_grad():  # the 8x8 grid's fixed tables, as a published ViT-MAE folder holds them
        big.vit.embeddings.position_embeddings.copy_(sincos_2d(32, (8, 8), cls_token=True)[None])
        big.decoder.decoder_pos_embed.copy_(sincos_2d(16, (8, 8), cls_token=True)[None])
    big.save_pretrained(tmp_path / "mae")
    mae = build_objective("mae", create_model("vit_debug_patch4", in_chans=1),
                          MAEConfig(decoder_dim=16, decoder_depth=1, decoder_heads=2))
    line = load_transformers_folder(mae, tmp_path / "mae")
    assert line.startswith("initialised encoder + decoder from") and "(ViTMAEForPreTraining;" in line
    assert torch.allclose(mae.encoder.pos_embed[0], sincos_2d(32, (7, 7), cls_token=True))
    assert torch.allclose(mae.decoder.decoder_pos_embed[0], sincos_2d(16, (7, 7), cls_token=True))
    torch.manual_seed(0)
    vit = perturbed(transformers.ViTModel(_vit_config(image_size=32)))
    vit.save_pretrained(tmp_path / "vit")
    from model.interop import resize_pos_embed

    encoder = create_model("vit_debug_patch4", in_chans=1)
    line = load_transformers_folder(build_objective("mae", encoder, MAEConfig(decoder_dim=16, decoder_depth=1,
                                                                              decoder_heads=2)), tmp_path / "vit")
    assert "pooler (dense + tanh) dropped" in line and "+ decoder" not in line
    expected = resize_pos_embed(vit.embeddings.position_embeddings.detach(), (7, 7))
    assert torch.equal(encoder.pos_embed, expected)


def test_classifier_continues_only_with_the_same_classes_on_the_cls_token(tmp_path):
    torch.manual_seed(0)
    theirs = perturbed(transformers.ViTForImageClassification(_vit_config(num_labels=10)))
    theirs.save_pretrained(tmp_path)
    from model.objectives.finetune import FinetuneConfig

    def finetune(classes: int, pool: str):
        return build_objective("finetune", create_model("vit_debug_patch4", in_chans=1, global_pool=pool),
                               FinetuneConfig(num_classes=classes))

    same = finetune(10, "token")
    assert load_transformers_folder(same, tmp_path).startswith("initialised encoder + classifier from")
    assert torch.equal(same.encoder.head.weight, theirs.classifier.weight)
    other = finetune(5, "token")
    assert "classifier not loaded: 10 classes in the folder, 5 configured" in load_transformers_folder(other, tmp_path)
    avg = finetune(10, "avg")
    assert "model.global_pool is avg" in load_transformers_folder(avg, tmp_path)
    assert not torch.equal(avg.encoder.head.weight, theirs.classifier.weight)


# --- what is refused, with the problem and the fix named ----------------------------------------

def _folder(tmp_path, config: dict, weights: dict | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if weights is not None:
        save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path


def test_only_transformers_configs_make_a_transformers_folder(tmp_path):
    run = _folder(tmp_path / "run", {"objective": "mae", "model": {"name": "vit_base_patch16"}})
    hf = _folder(tmp_path / "hf", {"model_type": "vit", "architectures": ["ViTModel"]})
    assert not is_transformers_folder(run) and is_transformers_folder(hf)
    assert not is_transformers_folder(tmp_path / "missing")


def test_unknown_architecture_and_missing_weights_are_refused(tmp_path):
    arch = dict(embed_dim=32, depth=2, num_heads=2, mlp_ratio=4.0, patch_size=4, in_chans=1, img_size=28)
    swin = _folder(tmp_path / "swin", {"model_type": "swin", "architectures": ["SwinModel"]})
    with pytest.raises(ValueError, match=r"names architectures \['SwinModel'\]; a transformers folder is read as one "
                                         r"of ViTMAEForPreTraining, ViTMAEModel, ViTModel, ViTForImageClassification"):
        check_folder_fits(swin, "vit_debug_patch4", arch, {})
    empty = _folder(tmp_path / "empty", {"model_type": "vit", "architectures": ["ViTModel"], **SMALL})
    with pytest.raises(ValueError, match="no weights .model.safetensors or pytorch_model.bin.: fetch the weight file"):
        check_folder_fits(empty, "vit_debug_patch4", arch, {})


def test_sizes_are_checked_against_the_model_and_the_decoder(tmp_path):
    torch.manual_seed(0)
    small_mae().save_pretrained(tmp_path)
    from model.registry import model_arch

    debug = {**model_arch("vit_debug_patch4"), "in_chans": 1}
    check_folder_fits(tmp_path, "vit_debug_patch4", debug, {"mae.decoder_dim": 16, "mae.decoder_depth": 1,
                                                            "mae.decoder_heads": 2})
    with pytest.raises(ValueError, match=r"config.json hidden_size 32 vs vit_mini_patch4's embed_dim 128; .*"
                                         r"give --model.name vit_debug_patch4"):
        check_folder_fits(tmp_path, "vit_mini_patch4", {**model_arch("vit_mini_patch4"), "in_chans": 1}, {})
    with pytest.raises(ValueError, match=r"config.json num_channels 1 vs vit_debug_patch4's in_chans 3"):
        check_folder_fits(tmp_path, "vit_debug_patch4", model_arch("vit_debug_patch4"), {})
    with pytest.raises(ValueError, match=r"config.json decoder_num_attention_heads 2 vs --mae.decoder_heads 4; give "
                                         r"--mae.decoder_dim 16 --mae.decoder_depth 1 --mae.decoder_heads 2"):
        check_folder_fits(tmp_path, "vit_debug_patch4", debug, {"mae.decoder_dim": 16, "mae.decoder_depth": 1,
                                                                "mae.decoder_heads": 4})
    # a 2x decoder MLP: our decoder's is 4x, so its fc1/fc2 would not load (found before start, not at load)
    small_mae(decoder_intermediate_size=32).save_pretrained(tmp_path / "mlp2x")
    says = r"config.json decoder_intermediate_size 32 is not 4 x decoder_hidden_size 16; the MAE decoder here has a 4x MLP"
    with pytest.raises(ValueError, match=says):
        check_folder_fits(tmp_path / "mlp2x", "vit_debug_patch4", debug, {"mae.decoder_dim": 16,
                                                                           "mae.decoder_depth": 1, "mae.decoder_heads": 2})
    with pytest.raises(ValueError, match=says):
        mae_from_transformers(tmp_path / "mlp2x")


def test_other_activations_and_unknown_weights_are_refused():
    with pytest.raises(ValueError, match="hidden_act is 'gelu_new'; this ViT's MLP uses the exact GELU"):
        encoder_arch({**DEFAULTS, "hidden_act": "gelu_new"})
    with pytest.raises(ValueError, match="names a transformers ViT / ViT-MAE does not have: .'embeddings.mask_token'"):
        from_transformers({"embeddings.mask_token": torch.zeros(1, 1, 8)})
    with pytest.raises(ValueError, match="layer 0 of the encoder lacks some of its query/key/value weights"):
        from_transformers({"encoder.layer.0.attention.attention.query.weight": torch.zeros(8, 8)})


@pytest.mark.parametrize("key, value", [("image_size", [224, 160]), ("patch_size", (16, 8)), ("image_size", [224])])
def test_a_config_of_non_square_images_or_patches_is_refused(key, value):
    """transformers takes [height, width] pairs; this ViT's grid and patches are square."""
    with pytest.raises(ValueError, match=rf"config.json {key} {re.escape(str(value))} is not square; this ViT takes "
                                         rf"square images and patches"):
        encoder_arch({**DEFAULTS, key: value})
    square = encoder_arch({**DEFAULTS, key: [value[0], value[0]]})  # a square pair is read as its side
    assert square == encoder_arch({**DEFAULTS, key: value[0]})
    assert square["img_size" if key == "image_size" else "patch_size"] == value[0]
