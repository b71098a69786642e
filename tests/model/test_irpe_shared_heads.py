"""iRPE tables shared across the heads of a layer (the default, as the official configs'
shared_head=True) or one per head (the knob)."""
import torch

from model.irpe import ContextualRPE, num_buckets


def _rpe(shared: bool, heads=4, d=8, grid=(7, 7)) -> ContextualRPE:
    return ContextualRPE(heads, d, grid, shared_heads=shared)


def test_shared_table_has_one_heads_share_of_the_per_head_parameters():
    shared, per_head = _rpe(True), _rpe(False)
    assert shared.shared_heads and not per_head.shared_heads
    assert shared.table.numel() == num_buckets() * 8 == 50 * 8
    assert per_head.table.numel() == 4 * shared.table.numel()
    # ViT-B at a 7x7 grid: 12 heads of 64 -> 3,200 vs 38,400 per layer (docs/methods/MAEPLUS_ADPE.md)
    assert _rpe(True, 12, 64).table.numel() == 3200 and _rpe(False, 12, 64).table.numel() == 38400


def test_shared_equals_per_head_with_identical_tables_and_a_plain_reference():
    torch.manual_seed(0)
    shared, per_head = _rpe(True).double(), _rpe(False).double()
    with torch.no_grad():
        shared.table.normal_()
        per_head.table.copy_(shared.table.expand_as(per_head.table))
    q = torch.randn(2, 4, 50, 8, dtype=torch.float64)
    got = shared(q)
    assert torch.equal(got, per_head(q))
    # plain reference: bias[b, h, i, j] = q[b, h, i] . table[bucket(i, j), 0] / sqrt(d)
    r = shared.table[:, 0][shared.buckets]  # (T, T, d)
    want = torch.einsum("bhid,ijd->bhij", q, r) / 8**0.5
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_state_dict_of_the_other_layout_loads_and_keeps_its_values():
    """Older per-head checkpoints load into a shared-default module (and back): the table adopts
    the stored layout, with the stored values."""
    torch.manual_seed(0)
    old = _rpe(False)
    torch.nn.init.normal_(old.table)
    new = _rpe(True)
    new.load_state_dict(old.state_dict())
    assert not new.shared_heads and torch.equal(new.table, old.table)
    back = _rpe(False)
    back.load_state_dict(_rpe(True).state_dict())
    assert back.shared_heads
