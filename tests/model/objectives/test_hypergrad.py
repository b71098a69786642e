"""The finite-difference hypergradient against torch.autograd's exact second-order one, and the
bit-exact restoration of perturbed weights."""
import pytest
import torch

from model.objectives.hypergrad import Points, central_difference, full_fp32, mask_hypergradient
from model.objectives.masking_net import top_masking
from model.objectives.mlomae import MLOMAEConfig, MLOMAEObjective
from model.registry import create_model


def tiny_objective(seed: int = 0) -> MLOMAEObjective:
    torch.manual_seed(seed)
    encoder = create_model("vit_debug_patch4", img_size=8, in_chans=1, attn_backend="math")  # 2x2 patches
    obj = MLOMAEObjective(encoder, MLOMAEConfig(decoder_dim=16, decoder_depth=1, decoder_heads=2, mask_hidden=8,
                                                num_classes=3, mask_ratio=0.5)).double()
    obj.aux.mask_net.double()
    obj.aux.head.double()
    with torch.no_grad():  # a head large enough that both terms of Eq. 9 matter
        obj.aux.head.weight.normal_(0, 0.5)
    return obj


def batches(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    img = lambda: torch.randn(4, 1, 8, 8, generator=g, dtype=torch.float64)  # noqa: E731
    lab = lambda: torch.randint(0, 3, (4,), generator=g)  # noqa: E731
    return img(), img(), lab(), img(), lab()


def encoder_names(obj):
    return [n for n, p in obj.named_parameters() if n.startswith("encoder.") and p.requires_grad]


def exact_and_fd(obj, lr_enc, lr_head, through_head=True, eps_scale=0.01):
    """Exact dL3/dT through E' = E - lr grad L1 and C' = C - lr grad L2(E', C) (Eqs. 6-9), and the
    finite-difference estimate evaluated at the same points (H(L1) at E, H(L2) at (E', C))."""
    img1, img2, y2, img3, y3 = batches()
    state = dict([*obj.named_parameters(), *obj.named_buffers()])
    names = encoder_names(obj)
    E0 = [state[n] for n in names]
    T = list(obj.aux.mask_net.parameters())
    C0 = list(obj.aux.head.parameters())
    with torch.no_grad():
        t_in = obj.embed(img1)
        masking = top_masking(obj.aux.mask_net(t_in), obj.cfg.mask_ratio)

    # exact: differentiate through both unrolled steps
    l1 = obj.level1_loss(state, img1, t_in, masking, track_encoder=True)
    E1 = [e - lr_enc * g for e, g in zip(E0, torch.autograd.grad(l1, E0, create_graph=True))]
    state1 = {**state, **dict(zip(names, E1))}
    # without the head path, C' is taken as independent of E'
    state_l2 = state1 if through_head else {**state, **dict(zip(names, [e.detach() for e in E1]))}
    l2 = obj.class_loss(state_l2, C0, img2, y2)
    C1 = [c - lr_head * g for c, g in zip(C0, torch.autograd.grad(l2, C0, create_graph=True))]
    grads = torch.autograd.grad(obj.class_loss(state1, C1, img3, y3), [*T, *E1])
    # dL3/dE' in total (through C' too when it depends on E'): Eq. 9's w, whose norm is logged
    exact, w_exact = grads[:len(T)], grads[len(T):]

    # finite differences at the same points
    E1_leaf = [e.detach().requires_grad_() for e in E1]
    C0_copy = [c.detach().clone() for c in C0]
    C1_leaf = [c.detach().requires_grad_() for c in C1]
    s1 = {**state, **dict(zip(names, E1_leaf))}
    fd, stats = mask_hypergradient(
        level1=lambda: obj.level1_loss(state, img1, t_in, masking),
        level2=lambda: obj.class_loss(s1, C0_copy, img2, y2),
        level3=lambda: obj.class_loss(s1, C1_leaf, img3, y3),
        mask_params=T, points=Points(E0, E1_leaf, C0_copy, E1_leaf, C1_leaf),
        lr_enc=lr_enc, lr_head=lr_head, through_head=through_head, eps_scale=eps_scale)
    torch.testing.assert_close(stats["val_grad_norm"], flat(w_exact).norm(), rtol=2e-3, atol=0)
    return exact, fd, stats


def flat(ts):
    return torch.cat([t.flatten() for t in ts])


@pytest.mark.parametrize("through_head", [True, False])
def test_finite_difference_hypergradient_matches_autograd(through_head):
    """At the paper's eps (0.01 / ||v||) within 0.2%; the error is the central difference's
    O(eps^2) truncation: 10x smaller eps, >= 50x smaller error."""
    obj = tiny_objective()
    errors = []
    for eps_scale in (0.01, 0.001):
        exact, fd, stats = exact_and_fd(obj, 0.3, 2.0, through_head, eps_scale)
        e, f = flat(exact), flat(fd)
        assert e.norm() > 1e-3  # a real signal reaches T
        assert torch.isclose(stats["hypergrad_norm"], f.norm())
        errors.append(float((f - e).norm() / e.norm()))
    assert errors[0] < 2e-3, errors
    assert errors[1] < errors[0] / 50, errors


def test_the_head_path_of_eq9_matters():
    """Dropping dL3/dC' dC'/dE' gives a different hypergradient (so the full test above checks it)."""
    obj = tiny_objective()
    exact_full, _, _ = exact_and_fd(obj, 0.3, 2.0, through_head=True)
    exact_enc, _, _ = exact_and_fd(obj, 0.3, 2.0, through_head=False)
    diff = (flat(exact_full) - flat(exact_enc)).norm() / flat(exact_full).norm()
    assert diff > 1e-2


def test_weights_are_bit_identical_after_perturb_and_restore():
    obj = tiny_objective()
    before = {n: p.detach().clone() for n, p in obj.named_parameters()}
    head_before = [p.detach().clone() for p in obj.aux.head.parameters()]
    exact_and_fd(obj, 0.3, 2.0)
    for n, p in obj.named_parameters():
        assert torch.equal(p, before[n]), n
    for p, p0 in zip(obj.aux.head.parameters(), head_before):
        assert torch.equal(p, p0)


def test_restoration_is_exact_where_arithmetic_undoing_is_not():
    """theta + eps v - 2 eps v + eps v != theta in floating point for these values; copying back is exact."""
    torch.manual_seed(0)
    theta = [torch.randn(1000)]
    v = [torch.randn(1000)]
    eps = 0.01 / v[0].norm()
    undone = theta[0] + eps * v[0]
    undone = undone - 2 * eps * v[0]
    undone = undone + eps * v[0]
    assert not torch.equal(undone, theta[0])
    original = theta[0].clone()
    central_difference(theta, v, lambda: [theta[0].sum()])
    assert torch.equal(theta[0], original)


def test_restoration_survives_an_exception():
    p = [torch.randn(5)]
    original = p[0].clone()

    def boom():
        raise RuntimeError("inside the perturbed pass")

    with pytest.raises(RuntimeError):
        central_difference(p, [torch.ones(5)], boom)
    assert torch.equal(p[0], original)


def test_central_difference_of_a_quadratic_is_exact():
    """f(x) = 0.5 x^T A x: grad = A x, so the difference quotient along v is A v (up to rounding)."""
    torch.manual_seed(0)
    A = torch.randn(6, 6, dtype=torch.float64)
    A = A + A.T
    x = [torch.randn(6, dtype=torch.float64, requires_grad=True)]
    v = [torch.randn(6, dtype=torch.float64)]
    (hv,) = central_difference(x, v, lambda: torch.autograd.grad(0.5 * x[0] @ A @ x[0], x))
    torch.testing.assert_close(hv, A @ v[0], rtol=1e-8, atol=1e-10)


def test_central_difference_along_a_short_direction_perturbs_by_eps_scale_in_norm():
    """eps = 0.01 / ||v|| also for ||v|| < 1: the weights move by 0.01 in norm (~3e-4 per entry
    here), whatever the size of the validation gradient. f = sum(x^4) / 4 in fp32, whose HVP is
    3 x^2 v: fp32 rounding of the gradients (~6e-8 relative) over a per-entry step h gives a
    relative error of about (2/3) * 6e-8 * |x| / h ~ 1.3e-4 at h ~ 3e-4, and ~4e-2 if the
    radius were 0.01 * ||v|| (h ~ 1e-6); the truncation error h^2 / (3 x^2) is negligible."""
    torch.manual_seed(0)
    x = [torch.randn(1000, requires_grad=True)]
    v = [1e-4 * torch.randn(1000)]  # ||v|| ~ 3e-3
    (grad,) = torch.autograd.grad((x[0] ** 4).sum() / 4, x, create_graph=True)
    (exact,) = torch.autograd.grad(grad, x, v)  # autograd's Hessian-vector product
    (fd,) = central_difference(x, v, lambda: torch.autograd.grad((x[0] ** 4).sum() / 4, x))
    assert ((fd - exact).norm() / exact.norm()).item() < 2e-3


@pytest.mark.parametrize("matmul, cudnn", [(False, True), (True, False)])
def test_full_fp32_turns_tf32_off_inside_and_restores_both_flags(matmul, cudnn):
    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = tuple(f.allow_tf32 for f in flags)
    try:
        flags[0].allow_tf32, flags[1].allow_tf32 = matmul, cudnn
        with full_fp32():
            assert (flags[0].allow_tf32, flags[1].allow_tf32) == (False, False)
        assert (flags[0].allow_tf32, flags[1].allow_tf32) == (matmul, cudnn)
    finally:
        flags[0].allow_tf32, flags[1].allow_tf32 = saved
