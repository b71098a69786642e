"""Activation checkpointing (the ds_config's activation_checkpointing section): recomputing the
blocks in backward changes no loss or gradient, also with drop path and a double backward."""
import pytest
import torch

from model.objectives import build_objective
from model.objectives.energy import EnergyConfig
from model.objectives.mae import MAEConfig
from model.registry import create_model


def loss_and_grads(name, cfg, backend, recompute):
    torch.manual_seed(0)
    encoder = create_model("vit_debug_patch4", in_chans=1, drop_path_rate=0.3, attn_backend=backend)
    objective = build_objective(name, encoder, cfg).double()
    for m in objective.modules():
        if hasattr(m, "set_grad_checkpointing"):
            m.set_grad_checkpointing(recompute)
    torch.manual_seed(1)  # the same masking noise, drop-path draws and corruptions in both runs
    loss = objective({"image": torch.randn(4, 1, 28, 28, dtype=torch.float64)})["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in objective.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name,cfg,backend", [
    ("mae", MAEConfig(decoder_dim=32, decoder_depth=2, decoder_heads=2), "sdpa"),
    ("energy", EnergyConfig(grid_cell=4, sr_scale=2, mixture="grid,sr,denoise"), "math"),  # double backward
])
def test_recomputed_blocks_give_identical_loss_and_gradients(name, cfg, backend):
    loss, grads = loss_and_grads(name, cfg, backend, False)
    loss_r, grads_r = loss_and_grads(name, cfg, backend, True)
    assert torch.equal(loss, loss_r)
    assert grads.keys() == grads_r.keys() and len(grads) > 20
    for k in grads:
        assert torch.equal(grads[k], grads_r[k]), k


def test_checkpointing_actually_recomputes():
    encoder = create_model("vit_debug_patch4", in_chans=1)
    calls = []
    encoder.blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))
    encoder.set_grad_checkpointing()
    encoder(torch.randn(2, 1, 28, 28)).sum().backward()
    assert len(calls) == 2  # forward, then again in backward
