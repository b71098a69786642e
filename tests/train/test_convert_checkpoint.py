"""A checkpoint tag of the earlier layout (model.pt with every weight + optim_rank*.pt holding the
optimizer state by flat range of padded, 64-aligned buffers, split between ranks mid-parameter) is
refused by a resume with the command that converts it; converted, it loads into the engine with
the same weights, moments, step counts and client state, bit for bit."""
import json

import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET

from train.config.ds_config import resolve
from train.config.parsing import parse_args, to_dict
from train.convert_checkpoint import main as convert
from train.engine import checkpoint
from train.pretrain import main as pretrain
from train.run.build import build_engine
from train.run.cli import cli

ALIGN = 64


def engine():
    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET)])
    ds, _ = resolve(cfg, 1)
    return build_engine(cfg, ds, torch.device("cpu"), 1e-3, 1, 10)[0], cfg


def trained_engine():
    torch.manual_seed(0)
    eng, cfg = engine()
    for _ in range(2):
        eng.backward(eng({"image": torch.randn(8, 1, 28, 28)})["loss"])
        eng.step()
    return eng, cfg


def write_legacy_tag(eng, cfg, tag):
    """The earlier engine's files for `eng`'s state, written as two ranks of ZeRO-1 wrote them."""
    layout, offset = [], 0
    for name, t in eng.master_weights().items():
        layout.append([name, offset, t.numel()])
        offset = -(-(offset + t.numel()) // ALIGN) * ALIGN
    padded = -(-offset // (ALIGN * 2)) * ALIGN * 2
    flat = {key: torch.zeros(padded) for key in ("exp_avg", "exp_avg_sq")}
    for (name, start, n), t in zip(layout, eng.master_weights().values()):
        for key in flat:
            flat[key][start:start + n] = eng.optimizer.state[t][key].reshape(-1)
    step = next(iter(eng.optimizer.state.values()))["step"]
    tag.mkdir(parents=True)
    half = padded // 2
    for rank, (a, b) in enumerate(((0, half), (half, padded))):  # one piece per rank: a cut through a parameter
        torch.save({"layout": layout, "optimizer": "AdamW", "pieces": [
            {"start": a, "end": b, "state": {"step": step.clone(), **{k: v[a:b].clone() for k, v in flat.items()}}}]},
            tag / f"optim_rank{rank:05d}.pt")
    module = {k: (eng.master_weights()[k] if k in eng.master_weights() else v).detach().clone()
              for k, v in eng.module.state_dict().items()}
    counters = eng.counters()
    torch.save({"module": module, "layout": layout, "schedule": counters.pop("schedule"), "engine": counters,
                "client": {"step": 2, "data": [{"position": 16}]}}, tag / "model.pt")
    torch.save(checkpoint.rng_state(), tag / "rng_rank0.pt")
    files = {f.name: f.stat().st_size for f in tag.iterdir()}
    (tag / "complete.json").write_text(json.dumps({"step": 2, "world_size": 2, "global_batch": 8, "zero_stage": 1,
                                                   "objective": "mae", "config": to_dict(cfg), "files": files}))
    return {k: v.clone() for k, v in eng.master_weights().items()}


def test_a_tag_of_the_earlier_layout_is_refused_then_converted_and_resumed_exactly(tmp_path, capsys, monkeypatch):
    eng, cfg = trained_engine()
    tag = tmp_path / "old" / "checkpoints" / "step00000002"
    weights = write_legacy_tag(eng, cfg, tag)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as status:
        cli(lambda: pretrain(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir",
                              str(tmp_path / "run"), "--resume", str(tag)]))
    err = capsys.readouterr().err
    assert status.value.code == 2 and f"python -m train.convert_checkpoint {tag}" in err, err
    assert not torch.distributed.is_initialized() and not (tmp_path / "run" / "checkpoints").exists()

    assert convert([str(tmp_path / "old")]) == [tag]  # a run folder: every tag of the earlier layout
    assert not (tag / "model.pt").exists() and not list(tag.glob("optim_rank*.pt"))
    assert checkpoint.check_files(tag) is None  # complete.json lists the new files with their sizes
    checkpoint.verify_safe(tag)
    meta = json.loads((tag / "complete.json").read_text())  # ... and their crc32s, as a save does
    assert meta["crc32"] == {name: checkpoint.crc32(tag / name) for name in meta["files"]}
    torch.manual_seed(1)  # other starting weights: everything must come from the tag
    fresh, _ = engine()
    assert fresh.load(tag) == {"step": 2, "data": [{"position": 16}]}
    assert fresh.steps == eng.steps == 2 and fresh.get_lr() == eng.get_lr()
    for name, t in fresh.master_weights().items():
        assert torch.equal(t, weights[name]), name
        for key, value in eng.optimizer.state[eng.master_weights()[name]].items():
            assert torch.equal(fresh.optimizer.state[t][key], value), (name, key)
    with pytest.raises(SystemExit) as status:  # converted once: a second time is refused, nothing changes
        cli(lambda: convert([str(tag)]))
    assert status.value.code == 2 and "not a tag of the earlier layout" in capsys.readouterr().err
    weights_file = tag / "model.safetensors"  # damaged bytes at the right size: the resume's check finds them
    raw = bytearray(weights_file.read_bytes())
    raw[-64:] = bytes(b ^ 0xFF for b in raw[-64:])
    weights_file.write_bytes(bytes(raw))
    assert checkpoint.check_files(tag) is None
    assert checkpoint.tag_problem(tag) == f"{weights_file} does not hold the bytes written (its crc32 differs from the " \
                                          f"one recorded)"


def test_a_tag_whose_files_are_damaged_is_refused_and_kept(tmp_path, capsys):
    """Bytes of model.pt's tensor data flipped at the same size passed the size check, converted
    into weights up to 1e24 and the original was deleted; a damaged pickle gave a traceback."""
    import zipfile

    eng, cfg = trained_engine()
    tag = tmp_path / "checkpoints" / "step00000002"
    write_legacy_tag(eng, cfg, tag)
    raw = bytearray((tag / "model.pt").read_bytes())
    with zipfile.ZipFile(tag / "model.pt") as archive:  # the largest tensor's record: its data starts after its header
        record = max(archive.infolist(), key=lambda r: r.file_size)
    start = record.header_offset + 30 + len(record.filename.encode()) + len(record.extra) + 64
    raw[start:start + 120] = bytes(b ^ 0xFF for b in raw[start:start + 120])
    (tag / "model.pt").write_bytes(bytes(raw))
    before = {f.name: f.read_bytes() for f in tag.iterdir()}
    with pytest.raises(SystemExit) as status:
        cli(lambda: convert([str(tag)]))
    err = capsys.readouterr().err
    assert status.value.code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert f"{tag / 'model.pt'} is damaged: its record" in err and "fails its CRC check; nothing was converted" in err
    assert {f.name: f.read_bytes() for f in tag.iterdir()} == before


def test_an_unknown_option_or_a_missing_path_is_named_and_nothing_is_converted(tmp_path, capsys):
    eng, cfg = trained_engine()
    tag = tmp_path / "checkpoints" / "step00000002"
    write_legacy_tag(eng, cfg, tag)
    before = {f.name: f.read_bytes() for f in tag.iterdir()}
    (tmp_path / "file").write_text("")
    for argv, says in ((["--foo"], "error: unrecognized arguments: --foo"),
                       ([str(tag), "--foo"], "error: unrecognized arguments: --foo"),
                       ([], "error: the following arguments are required: TAG"),
                       ([str(tag), str(tmp_path / "nope")], f"{tmp_path / 'nope'} does not exist; give a tag folder"),
                       ([str(tag), str(tmp_path / "file")], f"{tmp_path / 'file'} is a file, not a folder")):
        with pytest.raises(SystemExit) as status:
            cli(lambda: convert(argv))
        err = capsys.readouterr().err
        assert status.value.code == 2 and err.count("\n") == 1 and says in err, err
    assert {f.name: f.read_bytes() for f in tag.iterdir()} == before


def _tag_of(tmp_path, model, optim):
    """A complete tag of the earlier layout holding `model` (model.pt) and `optim` (optim_rank00000.pt, if not None)."""
    tag = tmp_path / "checkpoints" / "step00000001"
    tag.mkdir(parents=True)
    torch.save(model, tag / "model.pt")
    if optim is not None:
        torch.save(optim, tag / "optim_rank00000.pt")
    files = {f.name: f.stat().st_size for f in tag.iterdir()}
    (tag / "complete.json").write_text(json.dumps({"step": 1, "files": files}))
    return tag


def _model(**entries):
    return {"module": {"w": torch.zeros(2, 5), "b": torch.zeros(3)}, "engine": {"steps": 1, "health": {}},
            "schedule": {}, "client": {}, **entries}


def _optim(layout=(("w", 0, 10), ("b", 16, 3)), pieces=None, **entries):
    pieces = [{"start": 0, "end": 19, "state": {"step": torch.tensor(1.0), "exp_avg": torch.ones(19)}}] \
        if pieces is None else pieces
    return {"layout": [list(e) for e in layout], "optimizer": "AdamW", "pieces": pieces, **entries}


@pytest.mark.parametrize("model,optim,file,problem", [
    ({"foo": 1}, None, "model.pt", "no 'module' entry"),
    ([1, 2, 3], None, "model.pt", "it holds a list, not a dict"),
    (_model(module=[1]), _optim(), "model.pt", "its 'module' entry is a list, not a dict"),
    (_model(engine={"health": {}}), _optim(), "model.pt", "its 'engine' entry has no integer 'steps'"),
    (_model(), [1], "optim_rank00000.pt", "it holds a list, not a dict"),
    (_model(), _optim(layout=[("zz", 0, 10)]), "optim_rank00000.pt",
     "its layout names 'zz', which is no tensor of model.pt"),
    (_model(), _optim(layout=[("w", 0, 10 ** 11)]), "optim_rank00000.pt",
     "its layout gives 'w' 100000000000 values, model.pt's tensor holds 10"),
    (_model(), _optim(layout=[("w", 0, 10), ("w", 10, 10)]), "optim_rank00000.pt", "its layout names 'w' twice"),
    (_model(), _optim(layout=[("w", -1, 10)]), "optim_rank00000.pt", "layout entry ['w', -1, 10] is not"),
    (_model(), _optim(pieces=[{"start": 0, "end": 19, "state": {"exp_avg": torch.ones(5)}}]), "optim_rank00000.pt",
     "state 'exp_avg' of its piece [0, 19) is not a tensor of 19 values"),
    (_model(), _optim(pieces=[{"start": 0, "end": 19, "state": {1: torch.ones(19), "exp_avg": torch.ones(19)}}]),
     "optim_rank00000.pt", "state '1' of its piece [0, 19) is not a tensor of 19 values"),
    (_model(), _optim(pieces=[{"start": 0}]), "optim_rank00000.pt", "a piece is not {start, end, state}"),
    (_model(), _optim(optimizer=3), "optim_rank00000.pt", "its 'optimizer' entry is of type int, not str"),
])
def test_a_malformed_tag_is_refused_in_one_line_naming_the_file_and_nothing_changes(
        tmp_path, capsys, model, optim, file, problem):
    tag = _tag_of(tmp_path, model, optim)
    before = {f.name: f.read_bytes() for f in tag.iterdir()}
    with pytest.raises(SystemExit) as status:
        cli(lambda: convert([str(tag)]))
    err = capsys.readouterr().err
    assert status.value.code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert f"{tag / file} is not a file of the earlier layout ({problem}" in err, err
    assert "nothing was converted" in err
    assert {f.name: f.read_bytes() for f in tag.iterdir()} == before


def test_optimizer_state_the_pieces_do_not_cover_exactly_is_refused(tmp_path, capsys):
    """A gap (a rank's file missing from the tag) would convert into zero moments without a word."""
    state = {"exp_avg": torch.ones(10)}
    tag = _tag_of(tmp_path, _model(), _optim(pieces=[{"start": 0, "end": 10, "state": state}]))
    before = {f.name: f.read_bytes() for f in tag.iterdir()}
    with pytest.raises(SystemExit) as status:
        cli(lambda: convert([str(tag)]))
    err = capsys.readouterr().err
    assert status.value.code == 2 and err.count("\n") == 1, err
    assert f"{tag}: the optim_rank*.pt files hold 0 of the 3 values of b's exp_avg" in err, err
    assert {f.name: f.read_bytes() for f in tag.iterdir()} == before


def test_overlapping_pieces_that_add_up_to_the_tensor_are_refused(tmp_path, capsys):
    """Pieces [0, 5) and [3, 8) of w's 10 values add up to 10 but give 3..4 twice and 8..9 never:
    the count alone would pass and 8..9 would convert into zeros."""
    pieces = [{"start": lo, "end": hi, "state": {"exp_avg": torch.ones(hi - lo)}} for lo, hi in ((0, 5), (3, 8))]
    tag = _tag_of(tmp_path, _model(), _optim(layout=[("w", 0, 10)], pieces=pieces))
    before = {f.name: f.read_bytes() for f in tag.iterdir()}
    with pytest.raises(SystemExit) as status:
        cli(lambda: convert([str(tag)]))
    err = capsys.readouterr().err
    assert status.value.code == 2 and err.count("\n") == 1, err
    assert f"{tag}: the optim_rank*.pt files hold 10 of the 10 values of w's exp_avg, some more than once" in err, err
    assert {f.name: f.read_bytes() for f in tag.iterdir()} == before


def test_a_run_folder_converts_only_its_tags_of_the_earlier_layout(tmp_path, capsys):
    """A run converted in part (a tag converted, a later one still legacy): the run folder names only the legacy one."""
    converted = _tag_of(tmp_path, _model(), _optim())
    assert convert([str(converted)]) == [converted]
    done = {f.relative_to(converted): f.read_bytes() for f in converted.rglob("*") if f.is_file()}
    legacy = _tag_of(tmp_path / "later", _model(), _optim()).rename(converted.with_name("step00000002"))
    assert convert([str(tmp_path)]) == [legacy]
    # the converted tag left as it was
    assert {f.relative_to(converted): f.read_bytes() for f in converted.rglob("*") if f.is_file()} == done


def test_a_piece_of_no_values_converts(tmp_path):
    """A rank whose flat range held no value wrote a piece [19, 19): nothing to copy, no error; the
    moments come from the other piece."""
    from train.engine.state_files import read_contents

    pieces = [{"start": 0, "end": 19, "state": {"step": torch.tensor(1.0), "exp_avg": torch.arange(19.0)}},
              {"start": 19, "end": 19, "state": {"step": torch.tensor(1.0), "exp_avg": torch.ones(0)}}]
    tag = _tag_of(tmp_path, _model(), _optim(pieces=pieces))
    assert convert([str(tag)]) == [tag]
    assert read_contents(tag).optimizer == "AdamW" and not (tag / "model.pt").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_moments_of_any_float_dtype_convert_into_fp32_a_resume_reads(tmp_path, dtype):
    """The engine's moments are fp32, and a tag's optimizer metadata admits fp32 tensors only: 16-bit
    moments are widened, exactly."""
    import torch.distributed.checkpoint as dcp

    from train.engine.state_files import read_contents, single_process_quiet
    from train.engine.tag_reader import CheckedMetadataReader

    moments = torch.linspace(-3, 3, 19).to(dtype)
    pieces = [{"start": 0, "end": 19, "state": {"step": torch.tensor(1.0), "exp_avg": moments}}]
    tag = _tag_of(tmp_path, _model(), _optim(pieces=pieces))
    assert convert([str(tag)]) == [tag]
    assert read_contents(tag).optimizer == "AdamW"  # the check a resume makes before start
    into = {f"{name}/exp_avg": torch.zeros(shape) for name, shape in (("w", (2, 5)), ("b", (3,)))}
    with single_process_quiet():
        dcp.load(into, storage_reader=CheckedMetadataReader(tag / "optim"), no_dist=True)
    assert torch.equal(into["w/exp_avg"].flatten(), moments[:10].float())
    assert torch.equal(into["b/exp_avg"], moments[16:19].float())


def test_non_tensor_module_state_is_carried_into_the_converted_tag(tmp_path):
    """A module's _extra_state (not a tensor, e.g. {'version': 3}) is kept beside the weights, as a
    save keeps it, so a resume restores it."""
    from train.engine.state_files import read_module_state

    model = _model()
    model["module"]["blk._extra_state"] = {"version": 3}
    tag = _tag_of(tmp_path, model, _optim())
    convert([str(tag)])
    state = read_module_state(tag)
    assert state["blk._extra_state"] == {"version": 3}
    assert set(state) == {"w", "b", "blk._extra_state"}
