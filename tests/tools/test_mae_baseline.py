"""tools/mae_baseline.py, the plain-PyTorch MAE our engine is measured against: its loss is the
paper's (He et al. 2022: argsort-of-noise masking, per-patch normalised pixels, MSE over the
removed patches only) and its AdamW the reference's (betas 0.9/0.95, weight decay on matrices only)."""
import pytest
import torch

from tools.mae_baseline import BaselineMAE, optimizer

P, GRID, C = 4, 4, 3  # 16 patches of 4 x 4 x 3 pixels


@pytest.fixture
def model():
    torch.manual_seed(0)
    return BaselineMAE(P * GRID, P, C, embed_dim=16, depth=1, num_heads=2, decoder_dim=8, decoder_depth=1,
                       decoder_heads=2, mask_ratio=0.75)


def reference_loss(m: BaselineMAE, images: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The paper's step written out with the model's own layers and positions."""
    B, N, keep = images.shape[0], GRID * GRID, GRID * GRID // 4
    rows = torch.arange(B)[:, None]
    x = m.patch_embed(images).flatten(2).transpose(1, 2) + m.pos  # every patch with its position
    order = noise.argsort(dim=1)  # lowest noise kept
    kept, removed_ids = order[:, :keep], order[:, keep:]
    x = torch.cat([m.cls_token.expand(B, -1, -1), x[rows, kept]], dim=1)
    for blk in m.blocks:
        x = blk(x)
    x = m.decoder_embed(m.norm(x))
    y = torch.zeros(B, N, x.shape[-1])
    y[rows, kept] = x[:, 1:]
    y[rows, removed_ids] = m.mask_token.expand(B, N - keep, -1)
    y = torch.cat([x[:, :1], y + m.decoder_pos], dim=1)  # the cls token has no position
    for blk in m.decoder_blocks:
        y = blk(y)
    pred = m.decoder_pred(m.decoder_norm(y))[:, 1:]
    # patch (h, w) as its p x p x C pixels, row by row, channels last
    target = images.unfold(2, P, P).unfold(3, P, P).permute(0, 2, 3, 4, 5, 1).reshape(B, N, P * P * C)
    target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
    per_patch = ((pred - target) ** 2).mean(-1)
    return per_patch[rows, removed_ids].mean()  # the removed patches only


def test_the_loss_is_the_papers_on_removed_patches_of_normalised_pixels(model):
    torch.manual_seed(1)
    images = torch.randn(2, C, P * GRID, P * GRID) * 3 + 1  # a mean and scale per-patch normalisation removes
    torch.manual_seed(2)
    loss = model(images)
    torch.manual_seed(2)
    noise = torch.rand(2, GRID * GRID)  # the draw the forward makes
    torch.testing.assert_close(loss, reference_loss(model, images, noise))


def test_the_positions_are_2d_sincos_half_rows_half_columns(model):
    """Channels [0, D/4) sin(row w), [D/4, D/2) cos(row w), then the same of the column."""
    D = 16
    w = 1.0 / 10000 ** (torch.arange(D // 4) / (D // 4))
    row, col = torch.arange(GRID).repeat_interleave(GRID).float(), torch.arange(GRID).repeat(GRID).float()
    expected = torch.cat([(row[:, None] * w).sin(), (row[:, None] * w).cos(),
                          (col[:, None] * w).sin(), (col[:, None] * w).cos()], dim=1)
    torch.testing.assert_close(model.pos[0], expected)


def test_adamw_decays_matrices_only_with_the_references_betas(model):
    opt = optimizer(model, lr=1e-3)
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert len(decay) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        assert decay[id(p)] == (0.05 if p.ndim >= 2 else 0.0), name  # not biases, norms, tokens
    assert all(g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    assert opt.defaults["fused"] is None
