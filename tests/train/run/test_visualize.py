import torch

from model import create_model
from model.objectives import build_objective
from model.objectives.mae import MAEConfig
from model.objectives.patches import patchify
from train.run.visualize import MIN_TILE, PAD, cls_attention, grid, to_uint8, write_figures


def _mae():
    torch.manual_seed(0)
    return build_objective("mae", create_model("vit_debug_patch4", img_size=32),
                           MAEConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2)).eval()


def test_cls_attention_is_uniform_when_keys_are_zero():
    enc = _mae().encoder
    D = enc.embed_dim
    with torch.no_grad():
        enc.blocks[-1].attn.qkv.weight[D : 2 * D] = 0  # k = 0 -> every logit 0
        enc.blocks[-1].attn.qkv.bias[D : 2 * D] = 0
    att = cls_attention(enc, torch.randn(2, 3, 32, 32))
    assert att.shape == (2, 8, 8)
    assert torch.allclose(att, torch.full_like(att, 1 / 65))  # 64 patches + cls


def test_reconstruction_rows_keep_visible_patches():
    obj = _mae()
    images, noise = torch.randn(3, 3, 32, 32), torch.rand(3, 64)
    original, masked, recon, pasted = obj.visualizations(images, noise)["mae_reconstruction"]
    mask = obj.make_masking({"mask_noise": noise}, 3, images.device).mask.bool()  # (B, N), True = removed
    assert torch.equal(original, images)
    assert torch.allclose(patchify(pasted, 4)[~mask], patchify(images, 4)[~mask], atol=1e-5)
    assert torch.all(patchify(masked, 4)[mask] == 0)
    assert not torch.allclose(patchify(recon, 4)[mask], patchify(images, 4)[mask])


def test_png_files_have_the_grid_size(tmp_path):
    obj = _mae()
    paths = write_figures(obj, torch.randn(5, 3, 32, 32), torch.rand(5, 64), tmp_path, step=7)
    from PIL import Image

    tile = 32 * -(-MIN_TILE // 32)  # enlarged to at least MIN_TILE
    sizes = {p.name: Image.open(p).size for p in paths}
    assert sizes == {
        "mae_reconstruction_step00000007.png": (PAD + 5 * (tile + PAD), PAD + 4 * (tile + PAD)),
        "cls_attention_step00000007.png": (PAD + 5 * (tile + PAD), PAD + 2 * (tile + PAD)),
    }


def test_to_uint8_inverts_the_normalisation():
    from data.transforms import IMAGENET_MEAN, IMAGENET_STD

    pixels = torch.tensor([0.0, 0.5, 1.0])
    x = ((pixels[None, :, None, None] - torch.tensor(IMAGENET_MEAN)[None, :, None, None])
         / torch.tensor(IMAGENET_STD)[None, :, None, None])
    assert to_uint8(x)[0, 0, 0].tolist() == [0, 128, 255]
    assert grid([to_uint8(x)]).size == (PAD + MIN_TILE + PAD, PAD + MIN_TILE + PAD)


def test_a_timm_vit_backbone_gets_its_objective_figures_without_the_cls_map(tmp_path):
    """A timm ViT has `blocks` too, but none of our cls-token API: the cls attention map is ours only."""
    from model.objectives.energy import EnergyConfig

    cfg = EnergyConfig(grid_cell=8)
    backbone = create_model("timm/vit_tiny_patch16_224", img_size=32, in_chans=3, **cfg.encoder_overrides())
    paths = write_figures(build_objective("energy", backbone, cfg).eval(), torch.randn(2, 3, 32, 32),
                          torch.rand(2, 4), tmp_path, step=1)
    names = sorted(p.name.rsplit("_step", 1)[0] for p in paths)
    assert names and "cls_attention" not in names


def test_cls_attention_is_the_last_block_s_softmax_of_the_cls_query_over_patch_keys():
    """Plain reference: the last attention's input (norm1 of the block input, captured by a hook),
    q and k per head from its qkv weights, softmax(q k^T / sqrt(d)) of the cls query, the patch keys'
    columns (not the cls key's), mean over heads."""
    enc = _mae().encoder
    attn = enc.blocks[-1].attn
    with torch.no_grad():  # larger projections than the init's: attention far from uniform
        attn.qkv.weight.mul_(5)
    images = torch.randn(2, 3, 32, 32)
    seen = []
    hook = attn.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        enc.forward_features(images)
    hook.remove()
    a = seen[0]  # (B, T, D)
    B, T, D = a.shape
    H = attn.num_heads
    d = D // H
    W, b = attn.qkv.weight.detach(), attn.qkv.bias.detach()
    q = (a @ W[:D].T + b[:D]).reshape(B, T, H, d).transpose(1, 2)  # (B, H, T, d)
    k = (a @ W[D : 2 * D].T + b[D : 2 * D]).reshape(B, T, H, d).transpose(1, 2)
    weights = torch.softmax(q[:, :, :1] @ k.transpose(-2, -1) / d ** 0.5, dim=-1)  # (B, H, 1, T)
    expected = weights[:, :, 0, 1:].mean(1).reshape(B, 8, 8)
    att = cls_attention(enc, images)
    torch.testing.assert_close(att, expected, atol=1e-6, rtol=0)
