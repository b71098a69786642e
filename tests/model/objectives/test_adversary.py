"""The adversary's update rules (sign / normalised / Adam ascent), its projection, and the rank mean;
its step makes no host-device sync."""
import pytest
import torch

from model.objectives import adversary as adv
from model.objectives.adversary import Adversaries
from train.estimate.counting import counting_syncs


def _with_grad(a: Adversaries, name: str, g: torch.Tensor) -> None:
    a.tensors[name].grad = g.clone()


# The update rules one tensor at a time, written from their definitions: the reference for the
# flat update over every tensor at once.
def project(a: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    return a.clamp(-eps, eps) if norm == "linf" else a * (eps / a.norm().clamp_min(1e-12)).clamp(max=1.0)


def ascent(a: torch.Tensor, g: torch.Tensor, update: str, step: float, state: dict) -> torch.Tensor:
    if update == "sign":
        return a + step * g.sign()
    if update == "normalised":
        return a + g * (step / g.norm().clamp_min(1e-30))
    b1, b2 = 0.9, 0.95
    state["t"] = state.get("t", 0) + 1
    state["m"] = b1 * state.get("m", torch.zeros_like(a)) + (1 - b1) * g
    state["v"] = b2 * state.get("v", torch.zeros_like(a)) + (1 - b2) * g * g
    return a + step * (state["m"] / (1 - b1 ** state["t"])) / ((state["v"] / (1 - b2 ** state["t"])).sqrt() + 1e-8)


@pytest.mark.parametrize("norm,update", [("linf", "sign"), ("l2", "normalised"), ("l2", "adam"), ("linf", "adam")])
def test_the_flat_update_of_many_tensors_equals_each_tensors_own(norm, update):
    torch.manual_seed(0)
    shapes = {"a": (2,), "b": (3, 4), "c": (5, 2, 3)}
    adv = Adversaries(shapes, norm, eps=0.3, scale=0.7, update=update)
    ref = {n: torch.zeros(s) for n, s in shapes.items()}
    states = {n: {} for n in shapes}
    for _ in range(4):
        grads = {n: torch.randn(s) for n, s in shapes.items()}
        for n, g in grads.items():
            _with_grad(adv, n, g)
            ref[n] = project(ascent(ref[n], g, update, 0.05 * 0.7, states[n]), norm, 0.3)
        with counting_syncs() as syncs:
            adv.step(lr=0.05)
        assert not syncs.records, syncs.records  # nothing in the step waits for the device
        for n in shapes:
            torch.testing.assert_close(adv.tensors[n].detach(), ref[n], rtol=1e-5, atol=1e-6, msg=n)


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


def test_logged_norms_are_the_constraints_norm():
    for norm, want in (("linf", 0.4), ("l2", 0.5)):
        a = Adversaries({"x": (2,)}, norm, eps=1.0, scale=1.0)
        a.tensors["x"] = torch.tensor([0.3, -0.4], requires_grad=True)
        assert a.norms()["adv_x"].item() == pytest.approx(want)


def test_rpe_embed_perturbation_equals_adding_it_to_the_table_for_masked_query_rows():
    # AdPE rpe_embed: masked query rows read r_ij + a_ij, the same q . (r + a) / sqrt(d) as a perturbed table
    from model.irpe import ContextualRPE
    from model.objectives.adversary import RPEPerturbation

    gen = torch.Generator().manual_seed(0)
    rpe = ContextualRPE(num_heads=2, head_dim=16, grid_size=(7, 7)).double()
    with torch.no_grad():
        rpe.table.normal_(0, 0.5, generator=gen)
    q = torch.randn(2, 2, 50, 16, dtype=torch.float64, generator=gen)
    e = torch.randn(rpe.table.shape, dtype=torch.float64, generator=gen)  # (buckets, 1, d): the shared table's shape
    attacked = rpe(q, RPEPerturbation(torch.ones(2, 49, dtype=torch.bool), embed=e))
    with torch.no_grad():
        rpe.table += e
    torch.testing.assert_close(attacked[:, :, 1:], rpe(q)[:, :, 1:], rtol=1e-10, atol=1e-12)  # patch query rows


def test_a_step_consumes_the_gradients_so_the_next_step_ascends_its_own_only():
    # The adversaries are no optimizer's parameters: nothing else zeroes their .grad between steps,
    # and an accumulated gradient would steer each step by every past one.
    a = Adversaries({"x": (4,)}, "linf", eps=10.0, scale=1.0, update="sign")
    first, second = torch.tensor([3.0, 3.0, -3.0, -3.0]), torch.tensor([-1.0, 1.0, -1.0, 1.0])
    (a.tensors["x"] * first).sum().backward()
    a.step(lr=0.1)
    assert a.tensors["x"].grad is None
    (a.tensors["x"] * second).sum().backward()
    a.step(lr=0.1)
    assert a.tensors["x"].grad is None
    torch.testing.assert_close(a.tensors["x"].detach(), 0.1 * first.sign() + 0.1 * second.sign())
