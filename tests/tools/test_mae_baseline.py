"""tools/mae_baseline.py, the plain-PyTorch MAE our engine is measured against: its loss is the
paper's (He et al. 2022: argsort-of-noise masking, per-patch normalised pixels, MSE over the
removed patches only) and its AdamW the reference's (betas 0.9/0.95, weight decay on matrices only)."""
from types import SimpleNamespace

import pytest
import torch

from tools import mae_baseline
from tools.mae_baseline import BaselineMAE, BaselineStep, optimizer, time_training

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
        assert decay[id(p)] == (0.05 if p.ndim >= 2 else 0.0), name  # the tokens (ndim 3) too; not biases, norms
    assert all(g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    assert opt.defaults["fused"] is None


CPU = torch.device("cpu")


class Batches:
    """Two random images a batch, as time_training reads them."""
    batch_size = 2

    def __init__(self):
        self.gen = torch.Generator().manual_seed(0)

    def __next__(self):
        return {"image": torch.randn(self.batch_size, C, P * GRID, P * GRID, generator=self.gen)}


def test_time_training_times_only_the_steps_after_the_warmup(model, monkeypatch):
    """The first step is the cold one (allocator, lazy init): the warmup must take it out of the
    timed window. A stand-in clock charges the first step 10 s and every later one 1 s."""
    clock, calls = [0.0], []
    real = BaselineStep.__call__

    def charged(self, *a):
        real(self, *a)
        calls.append(1)
        clock[0] += 10.0 if len(calls) == 1 else 1.0

    monkeypatch.setattr(BaselineStep, "__call__", charged)
    monkeypatch.setattr(mae_baseline, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    out = time_training(model, Batches(), steps=3, warmup=2, dtype=torch.float32, device=CPU)
    assert len(calls) == 2 + 3
    assert out["step_time_s"] == 1.0 and out["images_per_s"] == Batches.batch_size / 1.0


@pytest.mark.parametrize("fused, said", [(None, "foreach"), (True, "fused")])
def test_the_record_names_the_adamw_that_ran(model, fused, said):
    out = time_training(model, Batches(), steps=1, warmup=0, dtype=torch.float32, device=CPU, fused=fused)
    assert out["optimizer"] == said


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_only_fp16_scales_the_loss(model, dtype):
    step = BaselineStep(model, Batches(), dtype, CPU)
    assert step.scaler.is_enabled() == (dtype == torch.float16)
