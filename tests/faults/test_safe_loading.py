"""Checkpoints and imported weights never unpickle code: a file that would run something when
loaded is refused, and the something does not run."""
import json
import re

import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET
from safetensors.torch import save_file

from train.config.parsing import parse_args, to_dict
from train.pretrain import main
from train.run.cli import cli


class RunsCode:
    """Unpickling this calls open(marker, "w"): the file appearing means code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    marker = tmp_path / "ran"
    argv = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(tmp_path / "run")]
    tag = tmp_path / "elsewhere" / "checkpoints" / "step00000004"
    tag.mkdir(parents=True)
    meta = {"step": 4, "world_size": 1, "global_batch": 8, "config": to_dict(parse_args(argv))}
    (tag / "complete.json").write_text(json.dumps(meta))
    save_file({"w": torch.zeros(2)}, tag / "model.safetensors")
    torch.save({"engine": {"steps": 4}, "client": {"step": 4, "data": [RunsCode(marker)]}}, tag / "state.pt")
    with pytest.raises(SystemExit) as exit_info:
        cli(lambda: main([*argv, "--resume", str(tag)]))
    assert exit_info.value.code == 2
    assert re.search(r"state.pt would unpickle \['_?io.open'\]; refused", capsys.readouterr().err)  # _io: Python 3.12
    assert not marker.exists()
    assert not torch.distributed.is_initialized()


def test_imported_weights_that_would_run_code_are_refused(tmp_path):
    from model.weights_reader import safe_load

    marker = tmp_path / "ran"
    path = tmp_path / "mae_pretrain_vit_base.pth"
    torch.save({"model": {"cls_token": torch.zeros(1, 1, 8)}, "args": RunsCode(marker)}, path)
    with pytest.raises(ValueError, match="holds objects other than tensors"):
        safe_load(path)
    assert not marker.exists()
    torch.save({"model": {"cls_token": torch.zeros(1, 1, 8)}}, path)  # plain tensors load
    assert safe_load(path)["model"]["cls_token"].shape == (1, 1, 8)


def test_a_small_torch_file_claiming_a_large_broadcast_tensor_is_refused_before_any_computation(tmp_path):
    """torch.save keeps an expanded view as its small storage and its strides: a file of kilobytes
    stands for a (10**7, 32) tensor, which the finiteness check would materialise (gigabytes)."""
    from model.weights_reader import WeightsFileError, safe_load, weights_shapes

    path = tmp_path / "broadcast.pth"
    torch.save({"model": {"cls_token": torch.zeros(1, 1, 32),
                          "blocks.0.attn.qkv.weight": torch.zeros(1, 32).expand(10**7, 32)}}, path)
    assert path.stat().st_size < 10_000
    for read in (safe_load, weights_shapes):  # the shapes alone (model.init_from's check) too
        with pytest.raises(WeightsFileError, match=r"broadcast.pth: tensor model.blocks.0.attn.qkv.weight claims "
                                                   r"320,000,000 values \(shape \[10000000, 32\]\) of 1,280,000,000 "
                                                   r"bytes but stores 128 .*: give weights saved as whole tensors"):
            read(path)


@pytest.mark.parametrize("state, name, rows, width", [
    ({"w": torch.ones(4), "ema": [torch.zeros(1, 32).expand(10**6, 32)]}, "ema.0", 10**6, 32),  # inside a list
    ({"w": torch.ones(4), "ema": ({"k": torch.zeros(1, 8).expand(3, 8)},)}, "ema.0.k", 3, 8),  # a tuple of dicts
    ({"model": {"w": torch.zeros(1, 4).expand(2, 4)}}, "model.w", 2, 4),  # twice its storage, no more
], ids=["a million-fold view in a list", "a view in a tuple", "a two-fold view"])
def test_a_broadcast_view_is_refused_wherever_it_is_nested_and_however_small_its_claim(tmp_path, state, name, rows,
                                                                                       width):
    """Any view claiming more bytes than its storage holds is refused, in any container the file
    holds (the finiteness check looks only at the top-level tensors, a copy would materialise it)."""
    from model.weights_reader import WeightsFileError, safe_load, weights_shapes

    path = tmp_path / "view.pth"
    torch.save(state, path)
    said = (rf"view.pth: tensor {re.escape(name)} claims {rows * width:,} values \(shape \[{rows}, {width}\]\) of "
            rf"{4 * rows * width:,} bytes but stores {4 * width} ")
    for read in (safe_load, weights_shapes):
        with pytest.raises(WeightsFileError, match=said):
            read(path)


def test_a_structure_that_holds_itself_is_walked_once(tmp_path):
    """A list or dict inside itself (a pickle's memo makes one) is walked once: the check ends, and
    still finds a broadcast view after it. An alarm fails the test rather than letting a walk that
    never ends hang the suite."""
    import signal

    from model.weights_reader import WeightsFileError, check_stored_whole

    loop = [torch.ones(3)]
    loop.append(loop)
    table = {"x": torch.ones(2)}
    table["self"] = table
    state = {"args": [loop, table, loop], "model": {"w": torch.zeros(1, 4).expand(8, 4)}}

    def too_long(signum, frame):
        raise TimeoutError("the walk over a self-containing structure did not end within 5 s")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(5)
    try:
        check_stored_whole(tmp_path / "a.pth", {"args": [loop, table, loop]})  # nothing to refuse: returns
        with pytest.raises(WeightsFileError, match=r"tensor model.w claims 32 values"):
            check_stored_whole(tmp_path / "a.pth", state)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_views_their_storage_holds_whole_still_load(tmp_path):
    """A transposed tensor, a slice and a strided column take no more than their storage holds."""
    from model.weights_reader import safe_load

    base = torch.arange(40.0).reshape(4, 10)
    inside_itself = [base]
    inside_itself.append(inside_itself)  # the pickle's memo makes a list that holds itself: walked once
    torch.save({"transposed": base.t(), "rows": base[1:3], "column": base[:, 2], "args": inside_itself},
               tmp_path / "views.pth")
    state = safe_load(tmp_path / "views.pth")
    assert torch.equal(state["transposed"], base.t()) and torch.equal(state["rows"], base[1:3])
    assert torch.equal(state["column"], base[:, 2]) and state["args"][1] is state["args"]


def test_dcp_load_through_the_checked_reader_refuses_metadata_that_would_run_code(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: DCP wraps the refusal

    from train.engine.state_files import single_process_quiet
    from train.engine.tag_reader import CheckedMetadataReader

    folder = tmp_path / "optim"
    with single_process_quiet():
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=folder, no_dist=True)
        into = {"w": torch.zeros(4)}
        dcp.load(into, storage_reader=CheckedMetadataReader(folder), no_dist=True)  # its own metadata loads
        assert torch.equal(into["w"], torch.arange(4.0))
        marker = tmp_path / "ran"
        (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
        with pytest.raises(CheckpointException, match=r"would unpickle _?io\.open; refused"):
            dcp.load(into, storage_reader=CheckedMetadataReader(folder), no_dist=True)
    assert not marker.exists()


def test_each_layer_of_load_pickle_file_refuses_code_alone(tmp_path, monkeypatch):
    """The globals scan first, then torch.load(weights_only=True): either alone keeps the code from running."""
    from train.engine import tag_reader

    marker = tmp_path / "ran"
    path = tmp_path / "state.pt"
    torch.save({"x": RunsCode(marker)}, path)
    with monkeypatch.context() as m:  # the scan misses the global: the weights-only unpickler refuses it
        m.setattr(tag_reader, "get_unsafe_globals_in_checkpoint", lambda f: [])
        with pytest.raises(ValueError, match="does not load as tensors and plain containers"):
            tag_reader.load_pickle_file(path)
    assert not marker.exists()
    with monkeypatch.context() as m:  # the load would run it: the scan refuses first
        m.setattr(tag_reader.torch, "load", lambda *a, **k: pytest.fail("loaded"))
        with pytest.raises(ValueError, match=r"would unpickle \['_?io.open'\]"):
            tag_reader.load_pickle_file(path)
    assert not marker.exists()
