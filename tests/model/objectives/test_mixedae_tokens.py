"""MixedAE: which encoder tokens each part sees. HomoCon contrasts the patch tokens (never the cls
token), and under homologous TopK only patch queries are restricted; the cls query attends globally."""
import pytest
import torch

from model import create_model
from model.objectives import build_objective
from model.objectives.mixedae import MixedAEConfig
from model.objectives.mixing import mix_images


def _objective(seed=0, **kw):
    torch.manual_seed(seed)
    enc = create_model("vit_debug_patch4", in_chans=1, img_size=32)  # 8x8 patches at 32 px, 2 blocks
    cfg = MixedAEConfig(**{"cell_size": 8, "decoder_dim": 32, "decoder_depth": 1, "decoder_heads": 2,
                           "proj_dim": 16, **kw})
    return build_objective("mixedae", enc, cfg).double()


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _capture(obj):
    """Record the encoder's output (B, 1+T, D), cls first, and the projection head's input."""
    seen = {}
    obj.encoder.norm.register_forward_hook(lambda module, args, out: seen.setdefault("latent", out))
    obj.projector.register_forward_pre_hook(lambda module, args: seen.setdefault("projected", args[0]))
    return seen


@pytest.mark.parametrize("mixing", ["compose", "full"])
def test_homocon_of_mixed_images_projects_the_encoders_patch_tokens_without_cls(mixing):
    # The labels are per patch position (B', N): the tokens beside them must be those same N patches,
    # position for position, so the cls token (position 0 of the latent) is not among them.
    obj = _objective(mixing=mixing)
    seen = _capture(obj)
    images = torch.randn(8, 1, 32, 32, dtype=torch.float64, generator=_gen(1))
    obj.forward_mixed(images, obj.draw_mixing(8, torch.device("cpu"), _gen(2)))
    latent = seen["latent"]
    assert latent.shape[1] == 1 + 64
    assert torch.equal(seen["projected"], latent[:, 1:])


def test_without_mixing_homocon_projects_each_images_visible_patch_tokens_without_cls():
    obj = _objective(mixing="none", attention="global")
    seen = _capture(obj)
    torch.manual_seed(3)
    obj(dict(image=torch.randn(8, 1, 32, 32, dtype=torch.float64)))
    latent = seen["latent"]
    assert latent.shape[1] == 1 + 16  # cls + r N visible tokens
    assert torch.equal(seen["projected"], latent[:, 1:])


def test_under_homologous_topk_the_cls_query_attends_to_every_key():
    # Block 1 homologous, block 0 global: both objectives feed block 1 the same tokens (same weights),
    # so a cls query that attends globally leaves cls identical to the global-attention encoder's,
    # while the patch queries, restricted to their top K = 16 of 65 keys, differ.
    topk = _objective(homologous_blocks="1").eval()
    dense = _objective(attention="global").eval()
    images = torch.randn(4, 1, 32, 32, dtype=torch.float64, generator=_gen(1))
    mixing = topk.draw_mixing(4, torch.device("cpu"), _gen(2))
    mixed = mix_images(images, mixing, 4)
    restricted, stats = topk.encode_mixed(mixed, mixing.segment)
    full, _ = dense.encode_mixed(mixed, mixing.segment)
    assert "topk_acc_block1" in stats
    torch.testing.assert_close(restricted[:, 0], full[:, 0], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(restricted[:, 1:], full[:, 1:], atol=1e-6)
