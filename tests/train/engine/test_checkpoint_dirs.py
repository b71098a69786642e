import json
import pickle

import pytest

from train.engine.checkpoint import COMPLETE, LATEST, NoCheckpointThere, find_resume, latest_complete, prune, tag_for


def _tag(root, step, complete=True):
    d = root / tag_for(step)
    d.mkdir(parents=True)
    if complete:
        (d / COMPLETE).write_text(json.dumps({"step": step, "world_size": 1}))
    return d


def test_latest_pointer_and_incomplete_tags(tmp_path):
    root = tmp_path / "checkpoints"
    _tag(root, 10)
    good = _tag(root, 20)
    _tag(root, 30, complete=False)  # a save that crashed half-way
    assert latest_complete(root) == good
    (root / LATEST).write_text(tag_for(30))  # pointer to an incomplete tag is not trusted
    assert latest_complete(root) == good
    (root / LATEST).write_text(tag_for(10))
    assert latest_complete(root) == root / tag_for(10)


def test_find_resume(tmp_path):
    assert find_resume("", tmp_path) is None
    assert find_resume("auto", tmp_path) is None  # fresh run
    tag = _tag(tmp_path / "checkpoints", 5)
    assert find_resume("auto", tmp_path) == tag
    assert find_resume(str(tmp_path), tmp_path / "other") == tag
    assert find_resume(str(tag), tmp_path / "other") == tag
    with pytest.raises(NoCheckpointThere, match="missing': the path does not exist$"):
        find_resume(str(tmp_path / "missing"), tmp_path)
    with pytest.raises(NoCheckpointThere, match=r"'true': the path does not exist \(--resume is not a switch\)$"):
        find_resume("true", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoCheckpointThere, match=r"empty': no complete checkpoint there \(a tag folder with complete"):
        find_resume(str(tmp_path / "empty"), tmp_path)


def test_prune_keeps_newest_complete(tmp_path):
    root = tmp_path / "checkpoints"
    for s in (1, 2, 3):
        _tag(root, s)
    _tag(root, 4, complete=False)
    _tag(root, 5)
    prune(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == [tag_for(3), tag_for(4), tag_for(5)]


class Payload:
    def __reduce__(self):
        return (print, ("executed",))


def test_verify_safe_refuses_foreign_objects(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from train.engine.checkpoint import verify_safe
    from train.engine.state_files import single_process_quiet

    tag = _tag(tmp_path, 1)
    save_file({"w": torch.zeros(2)}, tag / "model.safetensors")
    with single_process_quiet():
        dcp.save({"w/exp_avg": torch.zeros(2)}, checkpoint_id=tag / "optim", no_dist=True)
    torch.save({"engine": {"steps": 1}, "client": {"step": 1}}, tag / "state.pt")
    verify_safe(tag)  # tensors, plain containers and the optimizer state's own metadata pass
    torch.save({"engine": {"steps": 1}, "x": Payload()}, tag / "state.pt")
    with pytest.raises(ValueError, match="builtins.print"):
        verify_safe(tag)
    torch.save({"engine": {"steps": 1}}, tag / "state.pt")
    (tag / "optim" / ".metadata").write_bytes(pickle.dumps(Payload()))  # DCP unpickles its metadata
    with pytest.raises(ValueError, match="builtins.print"):
        verify_safe(tag)


def test_prune_spares_pinned_tags(tmp_path):
    root = tmp_path / "checkpoints"
    for s in (1, 2, 3, 4, 5):
        _tag(root, s)
    for s in (2, 4):  # epoch checkpoints (run.keep_every_epochs): never deleted, not counted in `keep`
        meta = json.loads((root / tag_for(s) / COMPLETE).read_text())
        (root / tag_for(s) / COMPLETE).write_text(json.dumps({**meta, "pinned": True}))
    prune(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == [tag_for(2), tag_for(4), tag_for(5)]


def test_prune_counts_and_deletes_nothing_after_the_tag_just_saved(tmp_path):
    """A run resumed from step 2 has just saved step 3; steps 4 and 5 are an earlier run's: they are
    neither counted toward `keep` (which would delete step 3) nor deleted."""
    root = tmp_path / "checkpoints"
    for s in (1, 2, 3, 4, 5):
        _tag(root, s)
    prune(root, keep=1, newest=tag_for(3))
    assert sorted(p.name for p in root.iterdir()) == [tag_for(3), tag_for(4), tag_for(5)]


def test_resume_falls_back_from_latest_to_the_tags_before_it_then_after(tmp_path, caplog):
    """`latest` names the last save; where it fails the check, the tags before it come first (newest
    first), the ones after it (another history, or a save that never moved `latest`) last."""
    root = tmp_path / "checkpoints"
    for s in (2, 4, 6, 8):
        _tag(root, s)
    (root / LATEST).write_text(tag_for(6))
    assert latest_complete(root) == root / tag_for(6)
    failing = {tag_for(6)}
    assert latest_complete(root, lambda t: "damaged" if t.name in failing else None) == root / tag_for(4)
    failing = {tag_for(2), tag_for(4), tag_for(6)}
    assert latest_complete(root, lambda t: "damaged" if t.name in failing else None) == root / tag_for(8)
    (root / LATEST).write_text(tag_for(7))  # names no tag there: said, and the newest taken
    assert latest_complete(root) == root / tag_for(8) and "names step00000007, which is not a complete" in caplog.text


DEEP_JSON = "[" * 100_000 + "]" * 100_000  # json raises RecursionError, not a ValueError, for this


def test_a_complete_json_nested_too_deep_is_unreadable_not_a_recursion_error(tmp_path):
    from train.engine.checkpoint import check_files, read_meta

    tag = _tag(tmp_path, 3)
    (tag / COMPLETE).write_text(DEEP_JSON)
    with pytest.raises(ValueError) as e:
        read_meta(tag)
    assert str(e.value) == f"{tag / COMPLETE} is nested too deep to be read as JSON: not a {COMPLETE} this code wrote"
    assert check_files(tag) == f"{tag / COMPLETE} is not readable JSON"


def test_prune_keeps_a_tag_whose_complete_json_is_nested_too_deep(tmp_path):
    """Pruning after a save read every older tag's complete.json for its pin: a deep one ended the run
    in a traceback after training. Unreadable, it cannot say it is unpinned: kept, as a malformed one is."""
    root = tmp_path / "checkpoints"
    for s in (1, 2, 3):
        _tag(root, s)
    (root / tag_for(1) / COMPLETE).write_text(DEEP_JSON)
    prune(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == [tag_for(1), tag_for(3)]


def test_a_complete_json_larger_than_this_code_writes_is_not_read(tmp_path, monkeypatch):
    """Pruning reads every older tag's complete.json: one over the bound is not read into memory, and kept."""
    from train.engine import checkpoint

    monkeypatch.setattr(checkpoint, "MAX_COMPLETE_BYTES", 64)
    root = tmp_path / "checkpoints"
    for s in (1, 2, 3):
        _tag(root, s)
    big = root / tag_for(1) / COMPLETE
    big.write_text(json.dumps({"step": 1, "world_size": 1, "pad": "x" * 100}))
    with pytest.raises(ValueError, match=f"{big} has {big.stat().st_size} bytes: not a {COMPLETE} this code wrote"):
        checkpoint.read_meta(root / tag_for(1))
    prune(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == [tag_for(1), tag_for(3)]


def test_crc32_covers_every_16_mib_piece_of_a_file(tmp_path):
    import os
    import zlib

    from train.engine.checkpoint import crc32

    data = os.urandom((1 << 24) + 10)  # two pieces: a checksum of the last alone would differ
    (tmp_path / "big").write_bytes(data)
    assert crc32(tmp_path / "big") == zlib.crc32(data)


def test_reseed_gives_a_stream_of_seed_rank_and_step():
    import torch

    from train.engine.checkpoint import reseed

    def draw(seed, rank, step):
        reseed(seed, rank, step)
        return torch.rand(4)

    assert torch.equal(draw(0, 1, 5), draw(0, 1, 5))
    assert not torch.equal(draw(0, 0, 5), draw(0, 1, 5))  # another rank: another stream
    assert not torch.equal(draw(0, 0, 5), draw(0, 0, 6))  # a later continuation: another stream
    assert not torch.equal(draw(0, 0, 5), draw(1, 0, 5))


def test_rng_state_round_trips_torch_numpy_and_python():
    import random

    import numpy as np
    import torch

    from train.engine.checkpoint import rng_state, set_rng_state

    def draws():
        # standard_normal twice: the second comes from numpy's cached gauss, which the state holds too
        return (random.random(), np.random.rand(), np.random.standard_normal(), np.random.standard_normal(),
                torch.rand(1).item())

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    np.random.standard_normal()  # a cached gauss value in the state
    state = rng_state()
    expected = draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(state)
    assert draws() == expected


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rows_are_torch_chunks_split_of_dim0(world):
    import torch

    from train.engine.state_files import _rows

    for n in range(1, 10):
        chunks = torch.arange(n).chunk(world)  # FSDP2's split: fewer chunks than ranks when n is small
        starts = [int(c[0]) for c in chunks] + [n] * (world - len(chunks))
        ends = [int(c[-1]) + 1 for c in chunks] + [n] * (world - len(chunks))
        assert [_rows(torch.Size([n, 2]), r, world) for r in range(world)] == list(zip(starts, ends)), n
