"""MLO-MAE's networks outside the engine, the masking network T and the level-II head C: their
init, their AdamW, and the step that averages their gradients over ranks."""
import math
import textwrap

import torch
from conftest import run_ranks

from model.objectives.masking_net import MaskingNetwork
from model.objectives.mlomae import Auxiliary


def auxiliary(seed=0, num_patches=4, dim=256, num_classes=100) -> Auxiliary:
    torch.manual_seed(seed)
    return Auxiliary(num_patches, dim, hidden=8, num_classes=num_classes, weight_decay=0.05)


def test_the_masking_network_starts_xavier_uniform_with_zero_biases():
    """docs/methods/MLOMAE.md: T is Linear(N*D, 512), ReLU, Linear(512, N) with xavier init: weights
    uniform within +-sqrt(6 / (fan_in + fan_out)), std sqrt(2 / (fan_in + fan_out)) (torch's
    default Linear init would give about half that std here, and nonzero biases)."""
    torch.manual_seed(0)
    net = MaskingNetwork(num_patches=49, dim=32, hidden=512)
    for layer in (net.net[1], net.net[3]):
        fan_out, fan_in = layer.weight.shape
        std = math.sqrt(2 / (fan_in + fan_out))
        assert abs(layer.weight.std().item() / std - 1) < 0.05  # >= 25k draws: a sampling error under 1%
        assert layer.weight.abs().max().item() <= math.sqrt(3) * std * (1 + 1e-6)  # the uniform's bound
        assert torch.all(layer.bias == 0)


def test_the_level2_head_starts_at_std_0_01_with_zero_bias():
    """C is MLO-MAE's linear probe; MAE's linear-probe head starts at trunc_normal_(std=0.01)
    (docs/EVALUATION.md, MAE's main_linprobe.py)."""
    head = auxiliary().head
    assert head.weight.shape == (100, 256)
    assert abs(head.weight.std().item() / 0.01 - 1) < 0.05  # 25,600 draws: a sampling error under 1%
    assert torch.all(head.bias == 0)


def test_both_adamws_use_betas_0_9_0_95():
    # docs/methods/MLOMAE.md: C's and T's AdamW (0.9, 0.95), as in the released code
    aux = auxiliary()
    for opt in (aux.mask_opt, aux.head_opt):
        assert [g["betas"] for g in opt.param_groups] == [(0.9, 0.95)] * len(opt.param_groups)


def test_a_step_with_a_nan_gradient_entry_leaves_the_head_finite():
    """Non-finite gradient entries are zeroed before the AdamW step: the rest still trains."""
    aux = auxiliary(num_classes=3, dim=8)
    head = aux.head
    before = head.weight.detach().clone()
    grads = [torch.randn_like(p) for p in head.parameters()]
    grads[0][0, 0] = float("nan")
    Auxiliary.step(head, aux.head_opt, grads, lr=1e-2)
    assert torch.isfinite(head.weight).all() and torch.isfinite(head.bias).all()
    moved = head.weight != before
    assert moved.flatten()[1:].all()  # every entry with a finite gradient stepped


# Each of 2 ranks all-reduces its own tensors; rank 0 saves what it then holds to argv[1].
SCRIPT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from model.objectives.mlomae import _all_reduce_mean_

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tensors = [torch.tensor([1.0 + rank]), torch.full((2, 3), 10.0 * (rank + 1))]
    _all_reduce_mean_(tensors)
    if rank == 0:
        torch.save(tensors, sys.argv[1])
    dist.destroy_process_group()
""")


def test_gradients_are_averaged_over_ranks_not_summed(tmp_path):
    script, out = tmp_path / "all_reduce.py", tmp_path / "seen.pt"
    script.write_text(SCRIPT)
    run_ranks(2, script, str(out), timeout=60)
    scalar, matrix = torch.load(out, weights_only=True)
    assert torch.equal(scalar, torch.tensor([1.5]))  # (1 + 2) / 2
    assert torch.equal(matrix, torch.full((2, 3), 15.0))  # (10 + 20) / 2, each tensor back in its shape
