"""A checkpoint is read without executing anything in it, and checked before anything starts.

Every hostile pickle of tests/faults/hostile_pickles.py, put in each file a resume unpickles (the
optimizer state's `.metadata`, state.pt, rng_rank0.pt; the .pt files both as torch.save archives and
as bare pickles) of an otherwise intact tag, is refused by the check `--resume` runs before start,
naming the file, and never runs; for a sample the real entry point is run too (`--resume auto`,
`--resume TAG`, `--model.init_from RUN`): exit status 2, one line, no process group, nothing
written. Garbled safetensors headers, complete.json files and well-formed files of the wrong
content are refused the same way, and garbage of the right size fails the tag's crc32s.
"""
import copy
import io
import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import CPU_DS, DEBUG_PRESET, run_pretrain
from hostile_pickles import (
    as_torch_file,
    code_payloads,
    malformed_payloads,
    registered_extensions,
    replace_in_tag,
    write_nested,
)
from safetensors.torch import load_file, save
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from train.engine.checkpoint import LATEST, find_resume, tag_for
from train.engine.state_files import single_process_quiet
from train.engine.tag_reader import read_dcp_metadata
from train.pretrain import main
from train.run.cli import cli

TAG = Path("checkpoints") / tag_for(2)
PAYLOADS = [*code_payloads(Path("marker"), Path("nested")), *malformed_payloads()]
FILES = [("optim/.metadata", "pickle"), ("state.pt", "torch.save archive"), ("state.pt", "pickle"),
         ("rng_rank0.pt", "torch.save archive"), ("rng_rank0.pt", "pickle")]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    """A debug MAE run with complete checkpoints at steps 1 and 2, written by train/pretrain.py."""
    run = tmp_path_factory.mktemp("good") / "run"
    run_pretrain(run, "--run.max_steps", "2", "--run.ckpt_every", "1", "--run.export", "false", "--run.tensorboard",
                 "false")
    return run


def corpus(tmp_path: Path) -> tuple[dict[str, bytes], Path]:
    """Every payload, and the marker file that appears if one runs."""
    marker = tmp_path / "ran"
    write_nested(tmp_path / "nested.pt", marker)
    return {**code_payloads(marker, tmp_path / "nested.pt"), **malformed_payloads()}, marker


def hostile_run(good_run: Path, tmp_path: Path, name: str, data: bytes) -> Path:
    """A copy of the run without its earlier tag, whose newest tag's file `name` holds `data`
    (complete.json rewritten to match)."""
    run = tmp_path / "run"
    shutil.copytree(good_run, run, ignore=shutil.ignore_patterns(tag_for(1)))
    replace_in_tag(run / TAG, name, data)
    return run


def in_form(data: bytes, form: str, like: Path) -> bytes:
    return as_torch_file(data, like) if form == "torch.save archive" else data


def tree(folder: Path) -> dict[str, float]:
    """Every path under `folder`, with its modification time for files."""
    return {str(p.relative_to(folder)): p.stat().st_mtime if p.is_file() else 0 for p in folder.rglob("*")}


def refused(argv: list[str], capsys) -> str:
    """The entry point's one line: exit status 2, no traceback, no process group."""
    capsys.readouterr()
    with registered_extensions(), pytest.raises(SystemExit) as status:
        cli(lambda: main(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--run.progress", "false",
                          *argv]))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert not torch.distributed.is_initialized()
    return lines[0]


def test_every_code_payload_runs_when_read_the_unsafe_way(tmp_path):
    """The corpus is live: a plain unpickler (DCP's read of .metadata) and torch.load(weights_only=False)
    run each payload, bare and inside a torch.save archive."""
    payloads, marker = corpus(tmp_path)
    like = tmp_path / "like.pt"
    torch.save({"t": torch.zeros(1)}, like)
    silent = []
    with registered_extensions():
        for name in code_payloads(marker, tmp_path / "nested.pt"):
            for read in (lambda: pickle.loads(payloads[name]),
                         lambda: torch.load(io.BytesIO(as_torch_file(payloads[name], like)), weights_only=False)):
                marker.unlink(missing_ok=True)
                try:
                    read()
                except Exception:  # most payloads fail after their effect, on what they return
                    pass
                if not marker.exists():
                    silent.append(name)
    assert not silent


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("name, form", FILES, ids=[f"{n} ({f})" for n, f in FILES])
def test_a_hostile_file_is_refused_by_the_resume_check_naming_it_and_never_runs(good_run, tmp_path, name, form,
                                                                                payload):
    payloads, marker = corpus(tmp_path)
    run = hostile_run(good_run, tmp_path, name, in_form(payloads[payload], form, good_run / TAG / name))
    with registered_extensions(), pytest.raises(FileNotFoundError) as e:
        find_resume("auto", run)
    message = str(e.value)
    assert "\n" not in message and f"({tag_for(2)}: {name} " in message and "refused" in message, message
    assert not marker.exists()


ENTRY_CASES = [  # (file, form, payload): names under DCP's own module (which a rule on module prefixes admits), and
    # a sample of each .pt file
    ("optim/.metadata", "pickle", "dotted os.system under DCP's metadata module"),
    ("optim/.metadata", "pickle", "EXT2 dotted os.system under DCP's metadata module"),
    ("optim/.metadata", "pickle", "BUILD __setstate__ on DCP's Metadata"),
    ("state.pt", "torch.save archive", "protocol 2 GLOBAL subprocess.call"),
    ("state.pt", "torch.save archive", "torch._tensor._rebuild_from_type_v2 calling open"),
    ("rng_rank0.pt", "torch.save archive", "NEWOBJ functools.partial"),
    ("rng_rank0.pt", "pickle", "protocol 5 STACK_GLOBAL builtins.open"),
]


@pytest.mark.parametrize("name, form, payload", ENTRY_CASES, ids=[f"{n}: {p}" for n, _, p in ENTRY_CASES])
def test_resume_auto_refuses_it_in_one_line_before_anything_starts(good_run, tmp_path, capsys, name, form, payload):
    payloads, marker = corpus(tmp_path)
    run = hostile_run(good_run, tmp_path, name, in_form(payloads[payload], form, good_run / TAG / name))
    before = tree(run)
    line = refused(["--output_dir", str(run), "--resume", "auto"], capsys)
    assert line.startswith(f"config error: --resume auto: no checkpoint in {run / 'checkpoints'} can be used "
                           f"({tag_for(2)}: {name} "), line
    assert "refused" in line and "--run.overwrite true" in line and "another --output_dir" in line
    assert not marker.exists() and tree(run) == before


def test_a_tag_named_by_resume_or_init_from_is_refused_the_same_way(good_run, tmp_path, capsys):
    payloads, marker = corpus(tmp_path)
    payload = payloads["dotted pickle.loads under DCP's filesystem module"]
    run = hostile_run(good_run, tmp_path, "optim/.metadata", payload)
    before = tree(run)
    line = refused(["--output_dir", str(tmp_path / "out"), "--resume", str(run / TAG)], capsys)
    assert f"--resume '{run / TAG}': {run / TAG}/optim/.metadata would unpickle " \
           f"torch.distributed.checkpoint.filesystem.pickle.loads; refused" in line
    line = refused(["--output_dir", str(tmp_path / "out"), "--model.init_from", str(run)], capsys)
    assert line.startswith(f"config error: model.init_from {run}") and "optim/.metadata would unpickle" in line
    assert not marker.exists() and tree(run) == before and not (tmp_path / "out").exists()


def weights_variants(good: bytes) -> dict[str, bytes]:
    """model.safetensors garbled: its 8-byte length, its JSON header, the entries of its tensors."""
    length = struct.unpack("<Q", good[:8])[0]
    header, data = json.loads(good[8:8 + length]), good[8 + length:]
    first = next(iter(header))

    def with_header(change) -> bytes:
        h = copy.deepcopy(header)
        change(h)
        text = json.dumps(h).encode()
        return struct.pack("<Q", len(text)) + text + data

    def from_zero(h: dict) -> None:  # every tensor's range starts at byte 0
        for name, entry in h.items():
            if name != "__metadata__":
                entry["data_offsets"] = [0, entry["data_offsets"][1] - entry["data_offsets"][0]]

    def raw(text: bytes) -> bytes:
        return struct.pack("<Q", len(text)) + text + data

    return {
        "an empty file": b"",
        "shorter than its length": b"\x07\x00\x00",
        "a header longer than the file": struct.pack("<Q", len(good)) + good[8:],
        "a header length of 2**63": struct.pack("<Q", 2**63) + good[8:],
        "a header that is not JSON": raw(b"{not json" + b" " * 7),
        "a header that is not UTF-8": raw(b"\xff\xfe" * 8),
        "a header nested 100000 deep": raw(b"[" * 100000 + b"]" * 100000),
        "a header that is a list": raw(b"[]"),
        "an unknown dtype": with_header(lambda h: h[first].update(dtype="Q7")),
        "a negative dimension": with_header(lambda h: h[first].update(shape=[-1] + h[first]["shape"][1:])),
        "a shape of strings": with_header(lambda h: h[first].update(shape=["4"] * len(h[first]["shape"]))),
        "a range that does not fit its shape": with_header(lambda h: h[first].update(shape=[1])),
        "ranges that overlap": with_header(from_zero),
        "a tensor described by a number": with_header(lambda h: h.update({first: 3})),
        "bytes past the last tensor": with_header(lambda h: None) + b"\x00" * 8,
    }


@pytest.mark.parametrize("variant", list(weights_variants(save({"w": torch.zeros(2)}))))
def test_a_garbled_weights_file_is_refused_in_one_line(good_run, tmp_path, variant):
    data = weights_variants((good_run / TAG / "model.safetensors").read_bytes())[variant]
    run = hostile_run(good_run, tmp_path, "model.safetensors", data)
    with pytest.raises(FileNotFoundError) as e:
        find_resume("auto", run)
    assert "\n" not in str(e.value) and f"({tag_for(2)}: model.safetensors" in str(e.value), str(e.value)


def with_fields(**fields):
    """complete.json of the tag with `fields` changed."""
    return lambda meta: json.dumps({**meta, **fields}).encode()


COMPLETE_VARIANTS = {
    "not JSON": lambda meta: b"{not json",
    "not UTF-8": lambda meta: b"\xff\xfe{}",
    "nested 100000 deep": lambda meta: b"[" * 100000 + b"]" * 100000,
    "a list": lambda meta: b"[]",
    "17 MiB": with_fields(pad=" " * (17 << 20)),
    "a step that is a string": with_fields(step="2"),
    "world size 0": with_fields(world_size=0),
    "a config that is a list": with_fields(config=[]),
    "files as a list": lambda meta: with_fields(files=list(meta["files"]))(meta),
    "a file outside the tag": lambda meta: with_fields(files={**meta["files"], "../../config.json": 1})(meta),
    "a crc32 of an unlisted file": lambda meta: with_fields(crc32={**meta["crc32"], "x.pt": 1})(meta),
}


@pytest.mark.parametrize("variant", list(COMPLETE_VARIANTS))
def test_a_garbled_complete_json_is_refused_in_one_line(good_run, tmp_path, variant):
    run = hostile_run(good_run, tmp_path, "state.pt", (good_run / TAG / "state.pt").read_bytes())
    meta = json.loads((run / TAG / "complete.json").read_text())
    (run / TAG / "complete.json").write_bytes(COMPLETE_VARIANTS[variant](meta))
    with pytest.raises(FileNotFoundError) as e:
        find_resume("auto", run)
    assert "\n" not in str(e.value) and f"({tag_for(2)}: " in str(e.value) and "complete.json" in str(e.value)


def _outside(md):
    for info in md.storage_data.values():
        info.relative_path = "../../../state.pt"


def _transformed(md):
    for info in md.storage_data.values():
        info.transform_descriptors = ["zstandard"]


def _unstored(md):
    del md.storage_data[next(iter(md.storage_data))]


def _off_size(md):
    entry = next(e for e in md.state_dict_metadata.values() if len(e.size))
    entry.chunks[0].offsets = torch.Size([d + 1 for d in entry.size])


def _renamed(md):
    for fqn in [k for k in md.state_dict_metadata if k.startswith("encoder.cls_token/")]:
        md.state_dict_metadata[fqn.replace("encoder.cls_token", "ghost")] = md.state_dict_metadata.pop(fqn)
    for index in [i for i in md.storage_data if i.fqn.startswith("encoder.cls_token/")]:
        info = md.storage_data.pop(index)
        md.storage_data[type(index)(index.fqn.replace("encoder.cls_token", "ghost"), index.offset)] = info


def _replaced(md):
    return {"state_dict_metadata": md.state_dict_metadata}


def _too_long(md):  # starts inside its tensor, ends past it
    entry = next(e for e in md.state_dict_metadata.values() if len(e.size) and e.size[0] > 1)
    entry.chunks[0].sizes = torch.Size([entry.size[0] + 5, *entry.chunks[0].sizes[1:]])


def _fewer_dims(md):
    entry = next(e for e in md.state_dict_metadata.values() if len(e.size) >= 2)
    entry.chunks[0].sizes = torch.Size(list(entry.chunks[0].sizes)[:1])


def _empty_pieces(md):
    for info in md.storage_data.values():
        info.length = 0


# DCP metadata of only the allowed classes, of the wrong content: (a change that edits the metadata or returns what
# replaces it, what the refusal says)
METADATA_VARIANTS = {
    "not DCP's Metadata": (_replaced, "holds a dict, not DCP's Metadata"),
    "a shard outside its folder": (_outside, "in '../../../state.pt', not a shard file of its folder"),
    "a stream transform": (_transformed, "through transforms ['zstandard']"),
    "a piece with no storage": (_unstored, "stores no bytes for a piece of"),
    "a chunk outside its tensor": (_off_size, "outside its size"),
    "state of a tensor the weights lack": (_renamed, "holds optimizer state of ['ghost']"),
    "a chunk longer than its tensor": (_too_long, "outside its size"),
    "a chunk of fewer dimensions than its tensor": (_fewer_dims, "that is not one of a tensor of size"),
    "pieces of no bytes": (_empty_pieces, " + 0"),
}


@pytest.mark.parametrize("variant", list(METADATA_VARIANTS))
def test_metadata_of_the_allowed_classes_but_the_wrong_content_is_refused(good_run, tmp_path, variant):
    change, says = METADATA_VARIANTS[variant]
    metadata = pickle.loads((good_run / TAG / "optim" / ".metadata").read_bytes())  # this test's own file
    changed = change(metadata)
    run = hostile_run(good_run, tmp_path, "optim/.metadata", pickle.dumps(metadata if changed is None else changed))
    with pytest.raises(FileNotFoundError) as e:
        find_resume("auto", run)
    assert says in str(e.value), str(e.value)


def test_dcp_would_torch_load_a_bytes_entry_with_weights_only_false_and_the_metadata_check_refuses_it(tmp_path):
    """DCP's own loader unpickles an entry its metadata calls bytes (not a tensor) with
    torch.load(weights_only=False): the class that says so is not on the allowlist."""
    _, marker = corpus(tmp_path)
    write_nested(tmp_path / "__0_0.distcp", marker)
    size = (tmp_path / "__0_0.distcp").stat().st_size
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata(
        {"w/exp_avg": BytesStorageMetadata()}, storage_data={MetadataIndex("w/exp_avg"): _StorageInfo("__0_0.distcp", 0,
                                                                                                        size)})))
    with single_process_quiet():
        dcp.load({"w/exp_avg": torch.zeros(2)}, checkpoint_id=tmp_path, no_dist=True)
    assert marker.exists()  # DCP's own reader ran it
    marker.unlink()
    with pytest.raises(ValueError, match="would unpickle torch.distributed.checkpoint.metadata.BytesStorageMetadata"):
        read_dcp_metadata(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("name, data, says", [
    ("state.pt", lambda good: torch_bytes([1, 2]), "is not the engine's state"),
    ("state.pt", lambda good: torch_bytes({**torch.load(io.BytesIO(good)), "client": {"step": 7, "data": [{}]}}),
     "holds a client state of step 7 with 1 data positions; complete.json says step 2 on 1 ranks"),
    ("rng_rank0.pt", lambda good: torch_bytes({"torch": torch.zeros(3)}), "is not a rank's RNG state"),
    ("rng_rank0.pt", lambda good: torch_bytes({**torch.load(io.BytesIO(good), weights_only=True),
                                              "objective": {"held": [torch.zeros(2), 3]}}),
     "holds an objective state that is not lists of tensors by name"),
    ("optim/__0_0.distcp", lambda good: good[:100], "the optimizer state's metadata reads bytes"),
    ("optim/__0_0.distcp", lambda good: b"\x00" * len(good), "holds no tensor at byte 0"),
    ("state.pt", lambda good: torch_bytes({**torch.load(io.BytesIO(good)), "client": {"step": 2, "data": [{}, {}]}}),
     "holds a client state of step 2 with 2 data positions; complete.json says step 2 on 1 ranks"),
    ("state.pt", lambda good: torch_bytes(without_schedule(torch.load(io.BytesIO(good)))),
     "lacks the engine's counters (steps, health, schedule)"),
    ("rng_rank0.pt", lambda good: torch_bytes({**torch.load(io.BytesIO(good), weights_only=True),
                                              "numpy_keys": torch.zeros(3, dtype=torch.int64)}),
     "is not a rank's RNG state"),  # numpy's MT19937 state is 624 words: three fail at set_rng_state, after start
], ids=["state.pt of another shape", "state.pt of another step", "an RNG file of another shape",
        "an RNG file whose objective state is not tensors", "a short shard", "a shard of zeros",
        "a client state of more data positions than ranks", "state.pt without the schedule's counters",
        "an RNG file of a short numpy state"])
def test_well_formed_files_of_the_wrong_content_are_refused(good_run, tmp_path, name, data, says):
    run = hostile_run(good_run, tmp_path, name, data((good_run / TAG / name).read_bytes()))
    with pytest.raises(FileNotFoundError) as e:
        find_resume("auto", run)
    assert says in str(e.value), str(e.value)


def without_schedule(state: dict) -> dict:
    return {**state, "engine": {k: v for k, v in state["engine"].items() if k != "schedule"}}


def test_a_tag_of_two_ranks_lacking_rank_1s_rng_file_is_refused(good_run, tmp_path):
    from train.engine.checkpoint import COMPLETE, tag_problem

    state = torch.load(good_run / TAG / "state.pt", weights_only=True)
    run = hostile_run(good_run, tmp_path, "state.pt",
                      torch_bytes({**state, "client": {**state["client"], "data": state["client"]["data"] * 2}}))
    meta = json.loads((run / TAG / COMPLETE).read_text())
    (run / TAG / COMPLETE).write_text(json.dumps({**meta, "world_size": 2}))  # two ranks, one RNG file
    assert tag_problem(run / TAG).endswith("rng_rank1.pt is missing, or not a regular file")


def test_a_shard_cut_inside_its_last_piece_is_refused(good_run, tmp_path):
    metadata = pickle.loads((good_run / TAG / "optim" / ".metadata").read_bytes())
    last = max(metadata.storage_data.values(), key=lambda info: info.offset)
    good = (good_run / TAG / "optim" / last.relative_path).read_bytes()
    run = hostile_run(good_run, tmp_path, f"optim/{last.relative_path}", good[:last.offset + 8])
    with pytest.raises(FileNotFoundError) as e:
        find_resume("auto", run)
    assert f"the optimizer state's metadata reads bytes {last.offset} to {last.offset + last.length}" in str(e.value)


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("name", ["model.safetensors", "optim/__0_0.distcp"])
def test_garbage_of_the_right_size_fails_the_crc32_and_the_tag_before_is_resumed(good_run, tmp_path, name, caplog):
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    path = run / TAG / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 16] = b"garbage of a disk"[:16]
    path.write_bytes(bytes(data))  # same size: complete.json's sizes still agree
    assert find_resume("auto", run) == run / "checkpoints" / tag_for(1)
    assert f"{path} does not hold the bytes written (its crc32 differs from the one recorded)" in caplog.text
    with pytest.raises(FileNotFoundError, match="its crc32 differs .*; resume from an earlier tag"):
        find_resume(str(run / TAG), run)


def test_when_every_tag_fails_the_refusal_names_each_and_what_to_do(good_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    for tag in (tag_for(1), tag_for(2)):
        (run / "checkpoints" / tag / "rng_rank0.pt").write_bytes(b"x" * (run / "checkpoints" / tag / "rng_rank0.pt")
                                                                 .stat().st_size)
    line = refused(["--output_dir", str(run), "--resume", "auto"], capsys)
    assert f"({tag_for(2)}: rng_rank0.pt does not hold the bytes written" in line
    assert f"; {tag_for(1)}: rng_rank0.pt does not hold the bytes written" in line
    assert line.endswith("resume an intact copy of one by path (--resume PATH), start afresh without --resume and with "
                         "--run.overwrite true (deletes them), or give another --output_dir")
    assert (run / "checkpoints" / LATEST).read_text() == tag_for(2)


def test_a_tag_that_does_not_fit_the_objective_or_its_optimizer_is_refused_before_start(good_run, tmp_path, capsys):
    tensors = load_file(good_run / TAG / "model.safetensors")
    run = hostile_run(good_run, tmp_path, "model.safetensors", save({**tensors, "encoder.extra": torch.zeros(2)}))
    line = refused(["--output_dir", str(run), "--resume", "auto"], capsys)
    assert "model.safetensors does not fit this run's mae objective (missing [], unexpected ['encoder.extra']" in line
    stage0 = tmp_path / "ds0.json"
    stage0.write_text(json.dumps({**json.loads(CPU_DS.read_text()), "zero_optimization": {"stage": 0}}))
    line = refused(["--ds_config", str(stage0), "--output_dir", str(tmp_path / "lars"), "--resume", str(good_run / TAG),
                    "--optim.name", "lars"], capsys)
    assert "holds the optimizer state of optim.name adamw, this run has lars; give --optim.name adamw" in line


@pytest.mark.parametrize("name", ["optim/.metadata", "state.pt", "rng_rank0.pt"])
def test_a_file_swapped_after_the_check_is_refused_by_the_resume_itself_in_one_line(good_run, tmp_path, capsys,
                                                                                  monkeypatch, name):
    """The check before start and the resume read the tag at different times: a file replaced in
    between is read the same safe way again, never runs, and ends the run in one line."""
    from train.engine import checkpoint

    payloads, marker = corpus(tmp_path)
    run = hostile_run(good_run, tmp_path, "state.pt", (good_run / TAG / "state.pt").read_bytes())  # intact
    original = checkpoint.load

    def swap_then_load(engine, tag_dir, *args):
        replace_in_tag(tag_dir, name, payloads["protocol 5 STACK_GLOBAL builtins.open"])
        return original(engine, tag_dir, *args)

    monkeypatch.setattr(checkpoint, "load", swap_then_load)
    capsys.readouterr()
    with registered_extensions(), pytest.raises(SystemExit) as status:  # past the start: the process group is up
        cli(lambda: main(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--run.progress", "false",
                          "--output_dir", str(tmp_path / "out"), "--resume", str(run / TAG)]))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    line = lines[0]
    assert line.startswith(f"config error: --resume: {run / TAG}/{name} "), line
    assert "refused" in line and "a file of it changed since" in line and not marker.exists()
