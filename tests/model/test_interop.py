"""Official-MAE and timm checkpoints come in with identical features; unsafe pickles are refused."""
import pytest
import timm
import torch
from safetensors.torch import save_file

from model import create_model
from model.interop import encoder_from_state, mae_from_official
from model.weights_reader import safe_load
from model.objectives import build_objective
from model.objectives.mae import MAEConfig


def _official_format(objective) -> dict:
    """Our MAE objective's weights laid out as the official release: {"model": flat timm-style names}."""
    flat = {}
    for k, v in objective.state_dict().items():
        flat[k.removeprefix("encoder.").removeprefix("decoder.")] = v.clone()
    return {"model": flat}


@pytest.fixture
def mae():
    torch.manual_seed(0)
    enc = create_model("vit_small_patch16", img_size=32, depth=2)
    obj = build_objective("mae", enc, MAEConfig(decoder_dim=64, decoder_depth=2, decoder_heads=4))
    # perturb every weight so a wrong mapping cannot hide behind identical initialisations
    with torch.no_grad():
        for p in obj.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return obj.eval()


def test_official_mae_round_trip_same_loss(mae, tmp_path):
    path = tmp_path / "mae_pretrain.pth"
    torch.save(_official_format(mae), path)
    imported = mae_from_official(path, decoder_heads=4).eval()
    assert imported.cfg.decoder_dim == 64 and imported.cfg.decoder_depth == 2
    assert imported.encoder.arch == mae.encoder.arch
    batch = {"image": torch.randn(2, 3, 32, 32), "mask_noise": torch.rand(2, 4)}
    with torch.no_grad():
        assert torch.equal(imported(batch)["loss"], mae(batch)["loss"])


def test_encoder_only_and_finetuned_layouts(mae, tmp_path):
    x = torch.randn(2, 3, 32, 32)
    encoder_only = {k: v for k, v in _official_format(mae)["model"].items() if not k.startswith(("decoder", "mask_token"))}
    enc = encoder_from_state(encoder_only).eval()
    with torch.no_grad():
        assert torch.equal(enc.forward_features(x), mae.encoder.forward_features(x))
    with pytest.raises(ValueError, match="no decoder weights"):
        torch.save({"model": encoder_only}, tmp_path / "enc.pth")
        mae_from_official(tmp_path / "enc.pth")
    # a fine-tuned checkpoint: fc_norm + head, no final norm -> average-pooled encoder
    finetuned = {k: v for k, v in encoder_only.items() if not k.startswith("norm.")}
    finetuned |= {"fc_norm.weight": torch.rand(384), "fc_norm.bias": torch.rand(384),
                  "head.weight": torch.rand(10, 384), "head.bias": torch.rand(10)}
    ft = encoder_from_state(finetuned)
    assert ft.global_pool == "avg" and torch.equal(ft.fc_norm.weight, finetuned["fc_norm.weight"])


def test_timm_state_dict_loads_back_with_same_features(tmp_path):
    torch.manual_seed(0)
    theirs = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0, img_size=32, depth=2).eval()
    save_file(theirs.state_dict(), str(tmp_path / "timm.safetensors"))
    ours = encoder_from_state(safe_load(tmp_path / "timm.safetensors")).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(ours.forward_features(x), theirs.forward_features(x), atol=1e-5)


class NotATensor:
    pass


def test_unsafe_pickles_are_refused(tmp_path):
    torch.save({"model": {"w": torch.zeros(1)}, "args": NotATensor()}, tmp_path / "evil.pth")
    with pytest.raises(ValueError, match="not unpickled for safety"):
        safe_load(tmp_path / "evil.pth")


def test_heads_must_be_given_for_unknown_widths():
    enc = create_model("vit_debug_patch4")  # 32 wide: no standard head count
    with pytest.raises(ValueError, match="pass num_heads"):
        encoder_from_state(enc.state_dict())
    assert encoder_from_state(enc.state_dict(), num_heads=2).arch == enc.arch


@pytest.mark.parametrize("name", ["vit_tiny_patch16", "vit_small_patch16", "vit_base_patch16", "vit_large_patch16",
                                  "vit_huge_patch14"])
def test_the_head_count_inferred_for_each_standard_width_is_the_papers(name):
    """Weights do not hold the head count: an official ViT-B read with 16 heads computes other features."""
    from model.registry import model_arch

    patch = model_arch(name)["patch_size"]
    enc = create_model(name, img_size=2 * patch, depth=1)  # one block: the width is what sets the heads
    assert encoder_from_state(enc.state_dict()).arch["num_heads"] == model_arch(name)["num_heads"]


def test_official_mae_checkpoint_starts_mlo_mae(mae, tmp_path):
    """Continued pretraining (MLO-MAE section 3.6): encoder and decoder both come from the release."""
    from model.interop import load_into_objective
    from model.objectives.mlomae import MLOMAEConfig

    path = tmp_path / "mae_pretrain.pth"
    torch.save(_official_format(mae), path)
    torch.manual_seed(1)
    mlo = build_objective("mlomae", create_model("vit_small_patch16", img_size=32, depth=2),
                          MLOMAEConfig(decoder_dim=64, decoder_depth=2, decoder_heads=4, num_classes=10))
    assert load_into_objective(mlo, path).startswith("initialised encoder + decoder")
    ours = dict(mlo.named_parameters())
    for name, p in mae.named_parameters():
        assert torch.equal(ours[name], p), name


def _energy_on(name: str, seed: int):
    from model.objectives.energy import EnergyConfig, EnergyObjective

    torch.manual_seed(seed)
    backbone = create_model(f"timm/{name}", img_size=32, in_chans=3, **EnergyConfig().encoder_overrides())
    return EnergyObjective(backbone, EnergyConfig(grid_cell=8, sr_scale=4))


def test_timm_backbone_starts_from_its_own_weights_or_timms(tmp_path):
    """A timm backbone (energy on ConvNeXt) starts from its own export, whose `head.norm` is part of
    the backbone, and from a timm classifier checkpoint, whose `head.fc` is left out."""
    from model.interop import load_into_objective

    trained = _energy_on("convnext_atto", seed=0)
    with torch.no_grad():
        for p in trained.encoder.parameters():
            p.add_(0.01 * torch.randn_like(p))
    export = tmp_path / "encoder.safetensors"
    save_file({k: v.contiguous() for k, v in trained.encoder.state_dict().items()}, str(export))
    fresh = _energy_on("convnext_atto", seed=1)
    assert load_into_objective(fresh, export) == f"initialised timm convnext_atto from {export}"
    for name, p in trained.encoder.state_dict().items():
        assert torch.equal(fresh.encoder.state_dict()[name], p), name

    classifier = timm.create_model("convnext_atto", pretrained=False, num_classes=7)
    checkpoint = tmp_path / "timm_classifier.pth"
    torch.save(classifier.state_dict(), checkpoint)
    load_into_objective(fresh, checkpoint)
    assert torch.equal(fresh.encoder.state_dict()["head.norm.weight"], classifier.state_dict()["head.norm.weight"])

    with pytest.raises(ValueError, match="does not fit timm model 'vit_tiny_patch16_224'.*same timm model"):
        load_into_objective(_energy_on("vit_tiny_patch16_224", seed=0), export)


def test_a_mean_pooled_encoder_given_to_a_cls_model_is_told_the_option(tmp_path):
    from model.interop import load_into_objective
    from model.objectives.linear_probe import LinearProbeConfig

    finetuned = create_model("vit_debug_patch4", global_pool="avg", num_classes=0)
    with torch.no_grad():
        finetuned.fc_norm.weight.uniform_(0.5, 2.0)  # as fine-tuning leaves it: not the fresh init
    save_file({k: v.contiguous() for k, v in finetuned.state_dict().items()}, str(tmp_path / "ft.safetensors"))
    probe = build_objective("linprobe", create_model("vit_debug_patch4"), LinearProbeConfig(num_classes=3))
    with pytest.raises(ValueError, match=r"unexpected \['fc_norm.bias', 'fc_norm.weight'\]; it pools by the mean "
                                         r".*give --model.global_pool avg"):
        load_into_objective(probe, tmp_path / "ft.safetensors")
    avg = build_objective("linprobe", create_model("vit_debug_patch4", global_pool="avg"), LinearProbeConfig(num_classes=3))
    load_into_objective(avg, tmp_path / "ft.safetensors")
    assert torch.equal(avg.encoder.fc_norm.weight, finetuned.fc_norm.weight)


def test_tensors_the_encoder_has_no_place_for_are_refused_not_dropped(tmp_path):
    """iRPE tables given to an encoder without iRPE: loading the rest would silently lose them."""
    from model.interop import load_into_objective
    from model.objectives.linear_probe import LinearProbeConfig

    rpe = create_model("vit_debug_patch4", rpe=True)
    save_file({k: v.contiguous() for k, v in rpe.state_dict().items()}, str(tmp_path / "rpe.safetensors"))
    probe = build_objective("linprobe", create_model("vit_debug_patch4"), LinearProbeConfig(num_classes=3))
    with pytest.raises(ValueError, match=r"does not fit the configured encoder: missing \[\], unexpected "
                                         r"\['blocks.0.attn.rpe.table', 'blocks.1.attn.rpe.table'\]"):
        load_into_objective(probe, tmp_path / "rpe.safetensors")


@pytest.mark.parametrize("extra, says", [
    ({"blocks.9999999.norm1.weight": torch.ones(32)},
     r"holds 3 blocks numbered 0, 1, 9999999, not 0 to 2 in turn as a ViT's are: give a whole ViT encoder's weights"),
    ({"blocks.0.mlp.fc1.weight": torch.zeros(10**9, 0)},  # no values, yet an MLP 10**9 wide in every block
     r"does not hold the tensors of one ViT: it holds blocks.0.mlp.fc1.weight of shape \[1000000000, 0\] \(the "
     r"model's: \[1000000000, 32\]\)"),
    ({"blocks.1.attn.qkv.weight": torch.zeros(7, 32)},
     r"it holds blocks.1.attn.qkv.weight of shape \[7, 32\] \(the model's: \[96, 32\]\)"),
], ids=["a block numbered past the file's", "a hidden width set by one tensor", "one block of another shape"])
def test_an_encoder_state_is_judged_against_the_vit_it_implies_before_that_is_built(extra, says):
    """The depth is the count of blocks the file holds (numbered 0..n-1), and every tensor has the
    shape of the ViT the others imply: a name or a shape never sets the size of what is built."""
    state = create_model("vit_debug_patch4").state_dict() | extra
    with pytest.raises(ValueError, match=says):
        encoder_from_state(state, num_heads=2)


def test_vit_misfit_names_what_differs_without_building_the_depth_described():
    from model.interop import vit_misfit

    model = create_model("vit_debug_patch4", rpe=True)
    model.blocks[0].attn.rpe.set_shared_heads(False)  # a per-head iRPE table loads into a shared one
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    arch = {**model.arch, "rpe": True}
    assert vit_misfit(arch, shapes) == ""
    assert vit_misfit({**arch, "depth": 10**9}, shapes) == "2 blocks, where the model has 1000000000"
    assert vit_misfit({**arch, "embed_dim": 2**20, "num_heads": 1}, shapes) == ("cls_token of shape [1, 1, 32] (the "
                                                                             "model's: [1, 1, 1048576])")
    del shapes["blocks.1.mlp.fc2.bias"]
    assert vit_misfit(arch, shapes) == "no blocks.1.mlp.fc2.bias, which the model has"
    assert vit_misfit(arch, shapes | {"blocks.01.mlp.fc2.bias": (32,)}) == ("a tensor blocks.01.mlp.fc2.bias, which "
                                                                            "the model has not")


@pytest.mark.parametrize("change, says", [
    (lambda d: d.pop("decoder_embed.weight"), r"holds no decoder_embed.weight among its MAE decoder tensors: give a whole MAE decoder's weights"),
    (lambda d: d.update({"decoder_embed.weight": torch.zeros(2**20, 0)}),  # no values, yet a decoder 2**20 wide
     r"mask_token of shape \[1, 1, 64\] \(the model's: \[1, 1, 1048576\]\)"),
    (lambda d: d.update({"decoder_blocks.7.norm1.weight": torch.ones(64)}),
     r"holds 3 decoder_blocks numbered 0, 1, 7, not 0 to 2 in turn as an MAE decoder's are: give a whole MAE "
     r"pretraining checkpoint$"),
    (lambda d: d.update({"decoder_embed.weight": torch.zeros(0, 384)}),
     r"holds a decoder_embed.weight 0 wide, not a positive multiple of 4 as an MAE decoder's 2-D sin-cos position "
     r"table needs: give a whole MAE pretraining checkpoint$"),
    (lambda d: [d.pop(k) for k in list(d) if k.startswith("decoder_blocks.")],
     r"holds no decoder_blocks beside its decoder_embed: give a whole MAE pretraining checkpoint$"),
    (lambda d: d.update({"decoder_blocks.1.mlp.fc1.weight": torch.zeros(10**9, 0)}),
     r"decoder_blocks.1.mlp.fc1.weight of shape \[1000000000, 0\] \(the model's: \[256, 64\]\)"),
    (lambda d: d.pop("decoder_blocks.1.attn.proj.bias"), r"no decoder_blocks.1.attn.proj.bias, which the model has"),
], ids=["no embedding", "a width set by one tensor", "a block numbered past the file's", "no width", "no blocks",
        "a hidden width", "a tensor missing"])
def test_an_official_decoder_is_judged_against_the_decoder_it_implies_before_that_is_built(mae, tmp_path, change,
                                                                                           says):
    """As the encoder's: the decoder built is the one the file's tensors describe, each of its
    shapes checked on a one-block build on the meta device first."""
    state = _official_format(mae)
    change(state["model"])
    torch.save(state, tmp_path / "mae_pretrain.pth")
    with pytest.raises(ValueError, match=f"{tmp_path / 'mae_pretrain.pth'}.*{says}"):
        mae_from_official(tmp_path / "mae_pretrain.pth", decoder_heads=4)


def test_decoder_heads_that_do_not_divide_the_official_decoder_are_named_as_the_argument(mae, tmp_path):
    torch.save(_official_format(mae), tmp_path / "mae_pretrain.pth")
    with pytest.raises(ValueError, match=r"holds a decoder 64 wide \(decoder_embed.weight\), which decoder_heads 5 does "
                                         r"not divide: pass the decoder_heads it was trained with \(MAE's: 16\)$"):
        mae_from_official(tmp_path / "mae_pretrain.pth", decoder_heads=5)


def _bicubic_per_channel(table: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """MAE's interpolate_pos_embed, one channel at a time: entry 1 + r * n + c of the table is patch
    (row r, column c) of an n x n grid; each channel's n x n image is resized bicubically
    (align_corners=False), read back row-major, the cls entry kept as it is."""
    n = round((table.shape[1] - 1) ** 0.5)
    rows = [table[0, :1]]
    channels = []
    for ch in range(table.shape[2]):
        image = table[0, 1:, ch].reshape(n, n)  # image[r, c] = entry 1 + r * n + c
        resized = torch.nn.functional.interpolate(image[None, None], size=grid, mode="bicubic", align_corners=False)
        channels.append(resized[0, 0].flatten())
    rows.append(torch.stack(channels, dim=1))
    return torch.cat(rows)[None]


@pytest.mark.parametrize("grid", [(4, 4), (6, 6), (3, 5)])
def test_a_learned_position_table_is_resized_bicubically_patch_by_patch(grid):
    """A learned (fine-tuned) table resized to its own grid is the same table; to another grid, each
    channel is the bicubic resize of its image over the patch grid, the cls entry unchanged."""
    from model.interop import resize_pos_embed

    torch.manual_seed(0)
    table = torch.randn(1, 1 + 4 * 4, 8)
    resized = resize_pos_embed(table, grid)
    assert resized.shape == (1, 1 + grid[0] * grid[1], 8)
    if grid == (4, 4):
        assert torch.equal(resized, table)
    assert torch.allclose(resized, _bicubic_per_channel(table, grid), atol=1e-6)


def test_a_learned_position_table_near_sincos_is_kept_as_learned():
    """Fine-tuning moves the sin-cos table a little: it is a learned table then, resized as one,
    not replaced by the fixed sin-cos table it started from."""
    from model.interop import resize_pos_embed
    from model.pos_embed import sincos_2d

    torch.manual_seed(0)
    table = sincos_2d(8, (4, 4), cls_token=True)[None] + 0.05 * torch.randn(1, 17, 8)
    assert torch.equal(resize_pos_embed(table, (4, 4)), table)
    assert torch.allclose(resize_pos_embed(table, (6, 6)), _bicubic_per_channel(table, (6, 6)), atol=1e-6)
    fixed = sincos_2d(8, (4, 4), cls_token=True)[None]  # the fixed table itself: the target grid's own
    assert torch.equal(resize_pos_embed(fixed, (6, 6)), sincos_2d(8, (6, 6), cls_token=True)[None])


def test_an_encoder_file_missing_a_block_is_refused_naming_what_it_lacks(tmp_path):
    """Loading the rest would leave block 1 at its random initialisation without a word."""
    from model.interop import load_into_objective
    from model.objectives.linear_probe import LinearProbeConfig

    state = {k: v.contiguous() for k, v in create_model("vit_debug_patch4").state_dict().items()}
    lacking = sorted(k for k in state if k.startswith("blocks.1."))
    assert lacking and "head.weight" not in state
    save_file({k: v for k, v in state.items() if k not in lacking}, str(tmp_path / "partial.safetensors"))
    probe = build_objective("linprobe", create_model("vit_debug_patch4"), LinearProbeConfig(num_classes=3))
    with pytest.raises(ValueError) as e:
        load_into_objective(probe, tmp_path / "partial.safetensors")
    assert str(e.value) == (f"{tmp_path / 'partial.safetensors'} does not fit the configured encoder: missing "
                            f"{lacking}, unexpected []")
