"""The adversary's update rules (sign / normalised / Adam ascent), its projection, and the rank mean."""
import pytest
import torch

from model.objectives import adversary as adv
from model.objectives.adversary import Adversaries


def _with_grad(a: Adversaries, name: str, g: torch.Tensor) -> None:
    a.tensors[name].grad = g.clone()


def test_one_adam_ascent_step_matches_a_hand_computation():
    torch.manual_seed(0)
    a = Adversaries({"x": (5,)}, "linf", eps=10.0, scale=2.0, update="adam")
    g = torch.randn(5)
    _with_grad(a, "x", g)
    a.step(lr=0.1)
    b1, b2 = 0.9, 0.95
    m_hat = (1 - b1) * g / (1 - b1)  # bias-corrected first moment after one step: g
    v_hat = (1 - b2) * g * g / (1 - b2)  # ... second moment: g^2
    step = 0.1 * 2.0
    want = step * m_hat / (v_hat.sqrt() + 1e-8)  # = lr * g / (|g| + eps): up the gradient
    torch.testing.assert_close(a.tensors["x"].detach(), want, rtol=1e-6, atol=0)
    # second step by hand, from the moments of the first
    g2 = torch.randn(5)
    _with_grad(a, "x", g2)
    a.step(lr=0.1)
    m = b1 * (1 - b1) * g + (1 - b1) * g2
    v = b2 * (1 - b2) * g * g + (1 - b2) * g2 * g2
    want2 = want + step * (m / (1 - b1**2)) / ((v / (1 - b2**2)).sqrt() + 1e-8)
    torch.testing.assert_close(a.tensors["x"].detach(), want2, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_adam_steps_are_projected(norm):
    torch.manual_seed(0)
    a = Adversaries({"x": (6,)}, norm, eps=0.05, scale=1.0, update="adam")
    for _ in range(3):
        _with_grad(a, "x", torch.randn(6))
        a.step(lr=1.0)  # far larger than eps
        x = a.tensors["x"].detach()
        size = x.abs().max() if norm == "linf" else x.norm()
        assert size <= 0.05 + 1e-7
    assert torch.isclose(size, torch.tensor(0.05))  # on the boundary


def test_steepest_is_sign_for_linf_and_normalised_for_l2_and_each_can_be_chosen():
    g = torch.tensor([3.0, -4.0])
    moved = {}
    for norm, update in (("linf", "steepest"), ("l2", "steepest"), ("l2", "sign"), ("linf", "normalised")):
        a = Adversaries({"x": (2,)}, norm, eps=100.0, scale=1.0, update=update)
        _with_grad(a, "x", g)
        a.step(lr=0.5)
        moved[norm, update] = a.tensors["x"].detach()
    assert torch.equal(moved["linf", "steepest"], torch.tensor([0.5, -0.5]))
    torch.testing.assert_close(moved["l2", "steepest"], torch.tensor([0.3, -0.4]))
    assert torch.equal(moved["l2", "sign"], moved["linf", "steepest"])
    assert torch.equal(moved["linf", "normalised"], moved["l2", "steepest"])
    with pytest.raises(ValueError, match="update"):
        Adversaries({"x": (2,)}, "linf", 1.0, 1.0, update="momentum")


def test_gradients_are_averaged_over_ranks(monkeypatch):
    """A fake 2-rank all_reduce adds the other rank's gradient; the step must use the mean. Tiny
    gradients make Adam's step depend on their scale (eps = 1e-8), so a sum would show."""
    other = torch.tensor([3e-8, -1e-8])
    monkeypatch.setattr(adv.dist, "is_available", lambda: True)
    monkeypatch.setattr(adv.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(adv.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(adv.dist, "all_reduce", lambda t: t.add_(other))
    a = Adversaries({"x": (2,)}, "linf", eps=10.0, scale=1.0, update="adam")
    mine = torch.tensor([1e-8, 1e-8])
    _with_grad(a, "x", mine)
    a.step(lr=1.0)
    mean = (mine + other) / 2  # [2e-8, 0]
    torch.testing.assert_close(a.tensors["x"].detach(), mean / (mean.abs() + 1e-8), rtol=1e-5, atol=1e-7)
    assert torch.isclose(a.tensors["x"].detach()[0], torch.tensor(2 / 3), rtol=1e-5)  # a sum would give 4/5


def test_adam_moments_are_checkpointed_and_old_checkpoints_load():
    torch.manual_seed(0)
    a = Adversaries({"x": (4,)}, "l2", eps=1.0, scale=1.0, update="adam")
    _with_grad(a, "x", torch.randn(4))
    a.step(lr=0.01)
    b = Adversaries({"x": (4,)}, "l2", eps=1.0, scale=1.0, update="adam")
    b.load_state_dict(a.state_dict())
    g = torch.randn(4)
    for x in (a, b):
        _with_grad(x, "x", g)
        x.step(lr=0.01)
    assert torch.equal(a.tensors["x"], b.tensors["x"])
    old = {"x": torch.full((4,), 0.1)}  # a checkpoint from before Adam: no moments
    b.load_state_dict(old)
    assert b.adam["x"] == {} and torch.equal(b.tensors["x"].detach(), old["x"])


def test_a_non_finite_gradient_moves_neither_the_adversary_nor_the_adam_moments():
    a = Adversaries({"x": (2,)}, "linf", eps=1.0, scale=1.0, update="adam")
    _with_grad(a, "x", torch.tensor([1.0, 2.0]))
    a.step(lr=0.01)
    before = a.tensors["x"].detach().clone(), {k: v.clone() for k, v in a.adam["x"].items()}
    _with_grad(a, "x", torch.tensor([float("inf"), 1.0]))
    a.step(lr=0.01)
    assert torch.equal(a.tensors["x"].detach(), before[0])
    assert all(torch.equal(a.adam["x"][k], v) for k, v in before[1].items())
