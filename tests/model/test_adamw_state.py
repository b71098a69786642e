"""model/adamw_state.py: AdamW's state made before the first step for every parameter of every
group, and a state dict loaded into a fused AdamW that then counts its own steps."""
import torch

from model.adamw_state import load_fused, with_state


def _two_groups(fused):
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))
    groups = [{"params": [w], "weight_decay": 0.05}, {"params": [b], "weight_decay": 0.0}]
    return [w, b], torch.optim.AdamW(groups, lr=1e-2, fused=fused)


def test_every_parameter_of_every_group_has_its_state_before_the_first_step():
    params, opt = _two_groups(fused=True)
    with_state(opt)
    assert len(opt.state_dict()["state"]) == 2  # the no-decay group's bias too
    for p in params:
        state = opt.state[p]
        assert state["step"].dtype == torch.float32 and state["step"].shape == () and state["step"] == 0
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[moment], torch.zeros_like(p))


def test_steps_from_the_made_state_are_torchs_default_adamw():
    (fused, opt), (plain, reference) = _two_groups(fused=True), _two_groups(fused=False)
    with_state(opt)
    for i in range(3):
        grads = [torch.randn_like(p) for p in fused]
        for ps, o in ((fused, opt), (plain, reference)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.step()
    for p, q in zip(fused, plain):
        assert torch.allclose(p, q, atol=1e-6)


def test_a_loaded_state_counts_only_its_optimizers_steps():
    """A state dict of torch's default AdamW (`fused: False` in its groups) loads into the fused one
    and keeps it fused. Optimizer.load_state_dict keeps a tensor as given (same dtype and device):
    shared, the other optimizer's steps would advance its step count and moments too."""
    pa, pb = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    a = torch.optim.AdamW([pa], lr=1e-2)
    b = torch.optim.AdamW([pb], lr=1e-2, fused=True)
    pa.grad = torch.randn(3)
    a.step()
    saved = a.state_dict()
    moments = {k: a.state[pa][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    load_fused(b, saved)
    for _ in range(2):
        pb.grad = torch.randn(3)
        b.step()
    assert b.param_groups[0]["fused"] and b.state[pb]["step"].dtype == torch.float32
    assert b.state[pb]["step"].item() == 3
    assert a.state[pa]["step"].item() == 1 and saved["state"][0]["step"].item() == 1
    for key, before in moments.items():
        assert torch.equal(a.state[pa][key], before) and torch.equal(saved["state"][0][key], before), key
        assert not torch.equal(b.state[pb][key], before), key  # b's own steps moved its copies
