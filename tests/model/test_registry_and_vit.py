import pytest
import torch
from torch import nn

from model import create_model, list_models
from model.registry import model_arch
from model.init import mae_init_

TINY = ["vit_debug_patch4", "vit_mini_patch4"]


def test_list_models_has_every_size():
    names = list_models()
    for n in ["vit_tiny_patch16", "vit_small_patch16", "vit_base_patch16", "vit_large_patch16", "vit_huge_patch14", *TINY]:
        assert n in names
    assert list_models("vit_*_patch4") == sorted(TINY)


def test_unknown_model_names_closest():
    with pytest.raises(ValueError, match="did you mean 'vit_base_patch16'"):
        create_model("vit_bsae_patch16")


@pytest.mark.parametrize("name", list_models())
def test_sweep_forward_backward(name):
    # Standard sizes run at a small image size (2x2 patches) to keep CPU time low.
    patch = int(name.rsplit("patch", 1)[1])
    m = create_model(name) if name in TINY else create_model(name, img_size=2 * patch)
    size = m.patch_embed.img_size
    x = torch.randn(2, 3, size, size)
    feats = m.forward_features(x)
    assert feats.shape == (2, 1 + m.num_patches, m.embed_dim)
    feats.float().pow(2).mean().backward()
    assert torch.isfinite(feats).all()
    assert m.patch_embed.proj.weight.grad is not None and m.patch_embed.proj.weight.grad.abs().sum() > 0
    assert m.pos_embed.grad is None  # the sin-cos table is fixed


@pytest.mark.parametrize("name,dim,depth,heads,patch,img", [
    ("vit_tiny_patch16", 192, 12, 3, 16, 224), ("vit_small_patch16", 384, 12, 6, 16, 224),
    ("vit_base_patch16", 768, 12, 12, 16, 224), ("vit_large_patch16", 1024, 24, 16, 16, 224),
    ("vit_huge_patch14", 1280, 32, 16, 14, 224),
    # the tiny ones: tests (28 px, a 7x7 grid) and the Fashion-MNIST demo (32 px, an 8x8 grid)
    ("vit_mini_patch4", 128, 4, 4, 4, 32), ("vit_debug_patch4", 32, 2, 2, 4, 28),
])
def test_standard_sizes(name, dim, depth, heads, patch, img):
    with torch.device("meta"):
        m = create_model(name)
    assert (m.embed_dim, len(m.blocks), m.blocks[0].attn.num_heads, m.patch_embed.patch_size) == (dim, depth, heads, patch)
    assert m.patch_embed.img_size == img
    assert m.blocks[0].mlp.fc1.out_features == 4 * dim
    assert m.norm.eps == 1e-6 and m.blocks[0].norm1.eps == 1e-6


def test_mae_init():
    torch.manual_seed(0)
    m = create_model("vit_debug_patch4")
    for mod in m.modules():
        if isinstance(mod, nn.Linear):
            bound = (6 / (mod.in_features + mod.out_features)) ** 0.5
            assert mod.weight.abs().max() <= bound and mod.weight.abs().max() > 0.9 * bound
            assert torch.all(mod.bias == 0)
        if isinstance(mod, nn.LayerNorm):
            assert torch.all(mod.weight == 1) and torch.all(mod.bias == 0)
    w = m.patch_embed.proj.weight  # (D, C, p, p) viewed as (D, C*p*p)
    bound = (6 / (w.shape[0] + w[0].numel())) ** 0.5
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert torch.all(m.patch_embed.proj.bias == 0)  # zeroed like the Linears' (PyTorch's Conv2d default is uniform)
    big = create_model("vit_small_patch16", img_size=32)
    assert abs(big.cls_token.std().item() - 0.02) < 0.004


def test_mae_init_is_deterministic_and_reapplicable():
    torch.manual_seed(1)
    a = create_model("vit_debug_patch4")
    torch.manual_seed(1)
    b = create_model("vit_debug_patch4")
    for (n, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), n
    mae_init_(a)
    assert torch.all(a.blocks[0].attn.qkv.bias == 0)


def test_bad_image_size_is_clear():
    m = create_model("vit_debug_patch4")
    with pytest.raises(ValueError, match="expected 28x28"):
        m(torch.randn(1, 3, 32, 32))


def test_drop_path_keeps_each_sample_at_its_rate_in_any_dtype():
    """Stochastic depth (model/vit.py DropPath): per sample, kept with probability 1 - p and scaled
    by its inverse, so the expectation is the input; its rate stays fp32 when the module is cast
    to bf16 (0.9 would become 0.8984); identity in eval; no state_dict entry (timm's names)."""
    from model.vit import DropPath

    drop = DropPath(0.1).to(torch.bfloat16)
    assert drop.keep_bits.view(torch.float32).item() == pytest.approx(0.9, abs=1e-7)
    torch.manual_seed(0)
    out = drop(torch.ones(200_000, 3, 2, dtype=torch.bfloat16))
    kept = out[:, 0, 0] != 0
    assert ((out != 0) == kept[:, None, None]).all()  # the whole sample, or nothing of it
    assert kept.float().mean().item() == pytest.approx(0.9, abs=0.003)  # 9 sigma of 0.00067
    assert torch.equal(out[kept], torch.full_like(out[kept], 1 / 0.9))  # bf16 of 1.111
    x = torch.randn(4, 5, 6)
    assert drop.float().eval()(x) is x and not drop.state_dict()
    assert create_model("vit_debug_patch4", drop_path_rate=0.2).state_dict().keys() == \
        create_model("vit_debug_patch4").state_dict().keys()


def test_drop_path_at_rate_one_drops_every_sample_to_zeros_not_nan():
    """As timm's: nothing is kept, and the kept samples' 1 / keep is never formed (0 / 0 would be NaN)."""
    from model.vit import DropPath

    out = DropPath(1.0)(torch.randn(64, 3, 2))
    assert torch.equal(out, torch.zeros_like(out))


def test_stochastic_depth_rate_grows_linearly_from_zero_to_the_rate_at_the_last_block():
    # timm's rule: dpr = torch.linspace(0, drop_path_rate, depth); the last block gets the full rate
    m = create_model("vit_tiny_patch16", img_size=32, drop_path_rate=0.1)  # 12 blocks
    want = torch.linspace(0, 0.1, 12).tolist()
    assert [b.drop_path.drop_prob if i else 0.0 for i, b in enumerate(m.blocks)] == pytest.approx(want)
    keeps = [b.drop_path.keep_bits.view(torch.float32).item() for b in m.blocks[1:]]  # what forward reads
    assert keeps == pytest.approx([1 - p for p in want[1:]], abs=1e-7)


@pytest.mark.parametrize("name, img_size", [("vit_mini_patch4", 16), ("timm/convnext_atto", 32)])
def test_model_arch_reports_the_img_size_asked_for(name, img_size):
    """An override wins over the registered size (mini: 32) and a timm model's default (224), as
    create_model builds it: the configs' checks (a cell, a crop that fits) read model_arch."""
    assert model_arch(name, img_size=img_size)["img_size"] == img_size
    with torch.device("meta"):
        assert create_model(name, img_size=img_size).img_size == img_size
