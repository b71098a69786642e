"""Weights that are not weights: an empty, random, truncated or inconsistent .safetensors or .pth, a
FIFO, a folder or a character device given as `--model.init_from` (pretrain, finetune, linprobe),
as `evaluate --encoder` (or its .json), or found as a checkpoint's model.safetensors by `export`
(timm and transformers), is refused promptly in one line naming the file, what is wrong and the
fix: exit 2, no traceback, nothing written. Each case runs under a one-minute watchdog, so a
reader that blocks on a FIFO or reads a device forever fails the tests instead of hanging them."""
from __future__ import annotations

import faulthandler
import importlib
import json
import os
import random
import re
import shutil
import struct
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET, process_group_of_its_own
from PIL import Image
from safetensors.torch import save_file

from data.write_shards import main as write_shards
from model.weights_reader import WeightsFileError, safe_load, weights_shapes
from model.registry import create_model
from train.pretrain import main as pretrain
from train.run.cli import cli

GOOD = {"a": torch.arange(16, dtype=torch.float32).reshape(4, 4), "b": torch.ones(8)}


def _good_safetensors(path: Path) -> bytes:
    save_file(GOOD, str(path))
    return path.read_bytes()


def _header_and_data(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _edited_header(raw: bytes, edit) -> bytes:
    header, data = _header_and_data(raw)
    edit(header)
    return _with_header(header, data)


def _zip_without_data_record(raw_pth: Path, out: Path) -> None:
    """torch.save's archive with its first tensor's data record left out."""
    with zipfile.ZipFile(raw_pth) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith("/data/0"):
                dst.writestr(info, src.read(info.filename))


def make_bad(kind: str, folder: Path) -> Path:
    """The bad weights file of `kind` in `folder` (a path that is not a file for the last kinds)."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = _good_safetensors(folder / "good.safetensors")
    st = folder / "weights.safetensors"
    contents = {
        "empty": b"",
        "random bytes": random.Random(0).randbytes(4096),
        "truncated in its header": raw[:8 + struct.unpack("<Q", raw[:8])[0] // 2],
        "truncated in its data": raw[:-16],
        "header length beyond the file": struct.pack("<Q", 10 * len(raw)) + raw[8:],
        "header not JSON": struct.pack("<Q", 8) + b"{notjson",
        "overlapping offsets": _edited_header(raw, lambda h: h["b"].update(data_offsets=[0, 32])),
        "offsets beyond the data": _edited_header(raw, lambda h: h["b"].update(shape=[1000],
                                                                                data_offsets=[64, 4064])),
        "unknown dtype": _edited_header(raw, lambda h: h["a"].update(dtype="F7")),
        "bytes after the last tensor": raw + bytes(16),
        "a span other than its shape's": _edited_header(raw, lambda h: h["b"].update(shape=[4])),  # 32 bytes for 16
    }
    if kind in contents:
        st.write_bytes(contents[kind])
        return st
    if kind == "pth zip without a data record":
        torch.save(GOOD, folder / "good.pth")
        _zip_without_data_record(folder / "good.pth", folder / "weights.pth")
        return folder / "weights.pth"
    if kind == "pth of random bytes":
        (folder / "weights.pth").write_bytes(random.Random(1).randbytes(4096))
        return folder / "weights.pth"
    if kind == "FIFO":
        os.mkfifo(st)
        return st
    if kind == "folder":
        st.mkdir()
        return st
    return Path(kind)  # /dev/zero, /dev/urandom: character devices


# kind -> what the one line says of the file (the fix follows it)
KINDS = {
    "empty": r"is empty \(0 bytes\)",
    "random bytes": r"is not a safetensors file, or is truncated in its header: its first 8 bytes give a header of "
                    r"\d+ bytes, the file has 4088 after them",
    "truncated in its header": r"is not a safetensors file, or is truncated in its header",
    "truncated in its data": r"is truncated in its data: its tensors end at byte 96 of the data, the file holds 80",
    "header length beyond the file": r"its first 8 bytes give a header of \d+ bytes, the file has \d+ after them",
    "header not JSON": r"is not a safetensors file: its 8-byte header is not JSON",
    "overlapping offsets": r"tensor 'a' starts at byte 0 of the data, where the tensor before it ends at 32 "
                           r"\(tensors overlap or leave a gap\)",
    "offsets beyond the data": r"is truncated in its data: its tensors end at byte 4064 of the data, the file holds 96",
    "unknown dtype": r"tensor 'a' has dtype 'F7', which is none of safetensors' torch dtypes",
    "bytes after the last tensor": r"is not a safetensors file written whole: 16 bytes follow its last tensor",
    "a span other than its shape's": r"tensor 'b' spans 32 bytes by its data_offsets, but its shape \[4\] of F32 "
                                     r"takes 16",
    "pth zip without a data record": r"cannot be read as a torch file, it is damaged or truncated \(RuntimeError: "
                                     r".*data/0",
    "pth of random bytes": r"is not a torch file: neither torch.save's zip archive nor its earlier pickle format",
    "FIFO": r"is a FIFO \(named pipe\), not a regular file",
    "folder": r"is a folder",
    "/dev/zero": r"/dev/zero is a character device, not a regular file",
    "/dev/urandom": r"/dev/urandom is a character device, not a regular file",
}
INIT_FROM_FIX = "give an exported encoder.safetensors, a run folder, an official MAE or a timm checkpoint"
ENCODER_FIX = "give an exported encoder.safetensors (with its .json beside it), an official MAE or a timm checkpoint"
EXPORT_FIX = "export another of the run's checkpoints"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """A labeled RGB shard index of 2 classes x 3 images (and test.json beside it: the same images)."""
    root = tmp_path_factory.mktemp("shards")
    for c in range(2):
        (root / "images" / f"c{c}").mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((16, 16, 3), 80 * c + 20 * i, dtype=np.uint8)).save(root / "images" / f"c{c}" / f"{i}.png")
    for name in ("train", "test"):  # test.json: the same images in shards of their own, what evaluate scores
        write_shards(["imagefolder", str(root / "images"), str(root / "s"), "--workers", "1", "--name", name])
    return root / "s" / "train.json"


def run_promptly(module: str, argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of the entry point's main run through train.run.cli.cli, in this process's
    main thread (the training commands install signal handlers) under a watchdog: a call still
    running after 60 s (blocked on a FIFO, reading a device) ends the test process with every
    thread's traceback, rather than hanging the suite."""
    main = importlib.import_module(module).main
    capsys.readouterr()
    faulthandler.dump_traceback_later(60, exit=True, file=sys.__stderr__)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cli(lambda: main(argv))
        status = 0
    except SystemExit as e:
        status = e.code
    finally:
        faulthandler.cancel_dump_traceback_later()
    return status, capsys.readouterr().err


@pytest.fixture(scope="module")
def real_tag(tmp_path_factory) -> Path:
    """The checkpoint of a one-step MAE run (debug preset)."""
    run = tmp_path_factory.mktemp("real") / "run"
    with process_group_of_its_own():
        cli(lambda: pretrain(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(run),
                          "--run.progress", "false", "--run.max_steps", "1"]))
    return run / "checkpoints" / "step00000001"


def copied_tag(real_tag: Path, root: Path, weights: Path) -> Path:
    """A copy of `real_tag` whose model.safetensors is `weights` (moved there, or a link to a
    device), its complete.json as tags written before file sizes and crc32s were recorded: nothing
    but the export's own reading judges the weights (a current tag's list catches a changed file
    when the checkpoint is found)."""
    tag = root / "run" / "checkpoints" / real_tag.name
    shutil.copytree(real_tag, tag)
    (tag / "model.safetensors").unlink()
    if str(weights).startswith("/dev/"):
        (tag / "model.safetensors").symlink_to(weights)
    else:
        weights.rename(tag / "model.safetensors")
    meta = json.loads((tag / "complete.json").read_text())
    (tag / "complete.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("files", "crc32")}))
    return tag


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with a regular file's bytes (a FIFO is listed, never read)."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() and not p.is_symlink() else None
            for p in folder.rglob("*")}


def assert_refused(status: int, err: str, message: str, fix: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, (status, err[-2000:])
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("config error: ") and re.search(message, lines[0]), lines[0]
    assert fix in lines[0], lines[0]
    return lines[0]


ENTRIES = {  # entry point -> (module, argv for the weights path W, the output R it would write)
    "pretrain": ("train.run.command", lambda w, r, s: ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET),
                                                   "--model.init_from", str(w), "--output_dir", str(r)]),
    "finetune": ("train.finetune", lambda w, r, s: ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET),
                                                    "--model.init_from", str(w), "--finetune.num_classes", "10",
                                                    "--output_dir", str(r)]),
    "linprobe": ("train.linprobe", lambda w, r, s: ["--ds_config", "ds_configs/cpu_linprobe.json", "--model.name",
                                                    "vit_debug_patch4", "--model.init_from", str(w),
                                                    "--linprobe.num_classes", "2", "--data.train_index", str(s),
                                                    "--output_dir", str(r)]),
    "evaluate": ("train.evaluate", lambda w, r, s: ["--train_index", str(s), "--test_index", str(s.with_name("test.json")), "--encoder",
                                                    str(w), "--out", str(r)]),
}


LINPROBE_KINDS = ("random bytes", "pth zip without a data record", "FIFO", "/dev/zero")  # its check is finetune's
CASES = [(entry, kind) for entry in ENTRIES for kind in KINDS if entry != "linprobe" or kind in LINPROBE_KINDS]


@pytest.mark.parametrize("entry, kind", CASES, ids=[f"{e}-{k}" for e, k in CASES])
def test_weights_that_are_not_weights_are_refused_in_one_line(entry, kind, shards, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    weights = make_bad(kind, tmp_path / "in")
    before = tree(tmp_path / "in")
    module, argv = ENTRIES[entry]
    out = tmp_path / ("eval.json" if entry == "evaluate" else "run")
    status, err = run_promptly(module, argv(weights, out, shards), capsys)
    if entry == "evaluate":
        message, fix = KINDS[kind], ENCODER_FIX
    elif kind == "folder":  # a folder is read as a run folder of ours
        message, fix = r"not an encoder this code reads \(no complete checkpoint there", INIT_FROM_FIX
    else:
        message, fix = KINDS[kind], INIT_FROM_FIX
    line = assert_refused(status, err, message, fix)
    assert str(weights) in line
    assert not out.exists() and tree(tmp_path / "in") == before


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", ["timm", "transformers"])
def test_a_checkpoint_whose_weights_are_not_weights_is_not_exported(fmt, kind, real_tag, tmp_path, capsys):
    tag = copied_tag(real_tag, tmp_path, make_bad(kind, tmp_path / "in"))
    before = tree(tmp_path / "run")
    out = tmp_path / ("exported" if fmt == "transformers" else "exported.safetensors")
    status, err = run_promptly("train.export", ["--checkpoint", str(tag.parent.parent), "--format", fmt,
                                                "--out", str(out)], capsys)
    message = {"folder": r"is a folder, not a weights file", "/dev/zero": r"is a character device, not a regular file",
               "/dev/urandom": r"is a character device, not a regular file",  # reached through a link
               "pth zip without a data record": r"is not a safetensors file",  # read by the name it was given
               "pth of random bytes": r"is not a safetensors file"}.get(kind, KINDS[kind])
    line = assert_refused(status, err, message, EXPORT_FIX)
    assert f"{tag}/model.safetensors" in line
    assert tree(tmp_path / "run") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "run"]  # no output, no temporary file


def test_an_exported_encoder_whose_weights_are_damaged_or_whose_description_is_a_fifo(shards, tmp_path, capsys):
    """With its .json beside it (an export of ours): the weights are judged the same way; a FIFO as
    the .json is refused without being opened."""
    encoder = create_model("vit_debug_patch4")
    path = tmp_path / "encoder.safetensors"
    save_file({k: v.contiguous() for k, v in encoder.state_dict().items()}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    (tmp_path / "encoder.json").write_text(json.dumps({"timm_kwargs": encoder.timm_kwargs()}))
    argv = ["--train_index", str(shards), "--test_index", str(shards.with_name("test.json")), "--encoder", str(path)]
    status, err = run_promptly("train.evaluate", argv, capsys)
    assert_refused(status, err, r"encoder.safetensors is truncated in its data", ENCODER_FIX)

    (tmp_path / "encoder.json").unlink()
    os.mkfifo(tmp_path / "encoder.json")
    status, err = run_promptly("train.evaluate", argv, capsys)
    assert_refused(status, err, r"the encoder's description .*encoder.json is a FIFO \(named pipe\), not a regular "
                                r"file", "give the JSON file itself")


def test_a_file_without_encoder_tensors_is_refused_before_start(tmp_path, capsys):
    """Sound weights of something else (no name of the model's encoder) are no encoder."""
    save_file({"classifier.weight": torch.zeros(2, 2)}, str(tmp_path / "other.safetensors"))
    argv = ENTRIES["pretrain"][1](tmp_path / "other.safetensors", tmp_path / "run", None)
    status, err = run_promptly("train.run.command", argv, capsys)
    assert_refused(status, err, r"holds no encoder tensors: none of its 1 tensor names is one of the model's "
                                r"\(e.g. \['classifier.weight'\]", INIT_FROM_FIX)
    assert not (tmp_path / "run").exists()


def test_readers_share_one_judgement(tmp_path):
    """The loader (model/interop.py safe_load) and the shape reader (weights_shapes) refuse the same
    files with the same words, and read a sound file alike."""
    for kind in KINDS:
        path = make_bad(kind, tmp_path / kind.replace("/", "_"))
        messages = []
        for read in (safe_load, weights_shapes):
            with pytest.raises(WeightsFileError) as e:
                read(path)
            messages.append(str(e.value))
        assert messages[0] == messages[1] and str(path) in messages[0], messages
    torch.save({"model": GOOD}, tmp_path / "good.pth")
    for path in (tmp_path / "empty" / "good.safetensors", tmp_path / "good.pth"):
        state = safe_load(path)
        state = state.get("model", state)
        assert weights_shapes(path) == {k: tuple(v.shape) for k, v in state.items()}
        assert all(torch.equal(state[k], v) for k, v in GOOD.items())


@pytest.mark.parametrize("name", ["diverged.safetensors", "diverged.pth"])  # .pth: official MAE's {"model": state}
def test_weights_that_are_not_finite_are_refused_in_one_line(name, shards, tmp_path, capsys, monkeypatch):
    """A diverged run's weights loaded without a word: pretraining from them skipped every step
    (NaN losses) and exported NaN weights with exit 0; evaluate ended in L-BFGS's traceback."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    state = {k: v.clone().contiguous() for k, v in create_model("vit_debug_patch4", in_chans=1).state_dict().items()}
    state["blocks.1.mlp.fc2.weight"][3, :2] = torch.tensor([float("nan"), float("inf")])
    if name.endswith(".pth"):
        torch.save({"model": state}, tmp_path / name)
    else:
        save_file(state, str(tmp_path / name))
    said = rf"{re.escape(name)}: weight blocks.1.mlp.fc2.weight holds 2 NaN or infinite value\(s\) of 4096"
    with pytest.raises(WeightsFileError, match=said):  # the reader itself, before any entry point
        safe_load(tmp_path / name)
    for entry in ("pretrain", "evaluate"):
        module, argv = ENTRIES[entry]
        out = tmp_path / f"{entry}_out"
        status, err = run_promptly(module, argv(tmp_path / name, out, shards), capsys)
        assert_refused(status, err, said, "give weights saved before the divergence")
        assert not out.exists()


def test_a_pickle_that_names_a_function_is_called_unsafe_not_damaged(tmp_path):
    """torch 2.14 words weights_only's refusal "Unsupported global"; the file was called damaged
    or truncated, which a user cannot tell from a bad download."""
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.getcwd, ())

    path = tmp_path / "hostile.pth"
    torch.save({"model": {"w": torch.ones(2)}, "x": Payload()}, path, pickle_module=pickle)
    with pytest.raises(WeightsFileError, match=r"holds objects other than tensors and plain containers, which are "
                                               r"not unpickled for safety"):
        safe_load(path)


def test_tensors_named_by_numbers_or_a_flat_position_table_are_refused_in_one_line(shards, tmp_path, capsys,
                                                                                  monkeypatch):
    """A list of tensors saved as a dict ({0: tensor, ...}) ended in "'int' object has no attribute
    'startswith'", and a pos_embed saved flat in an IndexError, from every entry point."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    state = create_model("vit_debug_patch4", in_chans=1).state_dict()
    torch.save({**state, 0: torch.zeros(3)}, tmp_path / "numbered.pth")
    torch.save({**state, "pos_embed": state["pos_embed"].flatten()}, tmp_path / "flat.pth")
    for name, said, fix in (
            ("numbered.pth", r"numbered.pth names a tensor by the int 0, not by a parameter name", "give a state_dict"),
            ("flat.pth", r"flat.pth.*pos_embed of shape \(\d+,\),? (is )?not a (ViT's )?\(1, 1 \+ grid, width\)", "give")):
        for entry in ("pretrain", "evaluate"):
            module, argv = ENTRIES[entry]
            out = tmp_path / f"{entry}_out"
            status, err = run_promptly(module, argv(tmp_path / name, out, shards), capsys)
            assert_refused(status, err, said, fix)
            assert not out.exists()


def test_a_position_table_of_another_layout_is_refused_not_indexed():
    from model.interop import resize_pos_embed

    for table in (torch.zeros(17 * 8), torch.zeros(17, 8), torch.zeros(2, 17, 8)):
        with pytest.raises(ValueError, match=r"pos_embed of shape .* is not a \(1, 1 \+ grid, width\) position table"):
            resize_pos_embed(table, (4, 4))
