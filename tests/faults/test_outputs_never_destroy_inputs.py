"""Outputs never destroy inputs (data/outputs.py): every command that writes a file refuses an
output that is one of its inputs or lies inside one (symbolic links resolved) even with
--overwrite, replaces an existing file only with --overwrite, and writes under a temporary name
renamed into place, so a write interrupted by an error leaves the final name as it was. After
every refusal the inputs hold the bytes they held."""
from __future__ import annotations

import importlib
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint
from conftest import CPU_DS, DEBUG_PRESET, process_group_of_its_own
from PIL import Image

import train.weights.export
import train.weights.transformers
from data.write_shards import main as write_shards
from train.pretrain import main as pretrain
from train.run.cli import cli


def snapshot(*folders: Path) -> dict[str, bytes | None]:
    """Every path under the folders, with each file's bytes."""
    return {str(p): p.read_bytes() if p.is_file() else None for f in folders for p in sorted(f.rglob("*"))}


def temporaries(folder: Path) -> list[str]:
    """Files or folders a write left under a temporary name (data/outputs.py temporary_name)."""
    return [str(p) for p in folder.rglob(".*.tmp*")]


def run(module: str, argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of a command's main as its __main__ block runs it."""
    main = importlib.import_module(module).main
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if module.startswith("train."):
                cli(lambda: main(argv))
                status = 0
            else:
                status = main(argv)
                status = 0 if isinstance(status, list) else status  # write_shards returns its indexes
        except SystemExit as e:
            status = e.code
    return status, capsys.readouterr().err


def refused(module: str, argv: list[str], message: str, capsys) -> str:
    status, err = run(module, argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, (status, err[-3000:])
    assert re.search(message, lines[0]), lines[0]
    return lines[0]


def stopped_by_full_disk(module: str, argv: list[str], capsys) -> None:
    """A train.* command whose write the disk refused: one line naming it, exit 3 (train/run/cli.py)."""
    status, err = run(module, argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 3 and len(lines) == 1 and "Traceback" not in err, (status, err[-3000:])
    assert lines[0].startswith("stopped: could not write ") and "No space left on device" in lines[0], lines[0]


def half_then_fail(monkeypatch, owner, name: str):
    """Replace `owner.name(data, path, ...)`-style writers: write half the bytes to the path they
    are given, then fail as a full disk would."""
    def writer(*args, **kwargs):
        target = next(a for a in args if isinstance(a, (str, Path)))
        Path(target).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(owner, name, writer)


def text_writes_half(monkeypatch):
    """Path.write_text writes half its text, then fails as a full disk would."""
    original = Path.write_text

    def write_text(self, data, *args, **kwargs):
        original(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", write_text)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("images")
    for c in range(2):
        (root / f"class{c}").mkdir()
        for i in range(3):
            Image.fromarray(np.full((16, 16, 3), 70 * c + 20 * i, dtype=np.uint8)).save(root / f"class{c}" / f"{i}.png")
    return root


@pytest.fixture
def shards(images, tmp_path) -> Path:
    """A labeled shard set written from `images` (train.json + train-000000.tar, 3 samples each)."""
    write_shards(["imagefolder", str(images), str(tmp_path / "shards"), "--workers", "1", "--samples_per_shard", "3"])
    return tmp_path / "shards"


@pytest.fixture
def held_out(images, tmp_path) -> Path:
    """The same images in shards of their own (test.json): what an evaluation scores (it may not
    score the training shards)."""
    write_shards(["imagefolder", str(images), str(tmp_path / "held_out"), "--workers", "1", "--name", "test"])
    return tmp_path / "held_out" / "test.json"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A one-step MAE run of RGB inputs (the debug preset): its checkpoint and its own export."""
    out = tmp_path_factory.mktemp("run") / "run"
    with process_group_of_its_own():
        cli(lambda: pretrain(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(out),
                          "--run.progress", "false", "--run.max_steps", "1", "--model.in_chans", "3"]))
    return out


# --- data.index_shards ---------------------------------------------------------------------------

def test_index_shards_never_writes_over_its_inputs(shards, tmp_path, capsys):
    shard = shards / "train-000000.tar"
    (tmp_path / "names.txt").write_text("a\nb\n")
    (tmp_path / "link.json").symlink_to(shard)
    before = snapshot(shards, tmp_path)
    for out, extra, message in (
            (shard, ["--overwrite"], r"--out .*train-000000.tar is the input .*train-000000.tar: writing it would "
                                     r"destroy the input \(--overwrite never replaces an input\)"),
            (tmp_path / "link.json", ["--overwrite"], r"--out .*link.json is the input .*train-000000.tar"),
            (tmp_path / "names.txt", ["--overwrite", "--classes", str(tmp_path / "names.txt")],
             r"--out .*names.txt is the input .*names.txt"),
            (shards / "new.tar", ["--overwrite"], r"names a .tar file, but the index is JSON .*give INDEX.json"),
            (shards / "train.json", [], r"--out .*train.json exists already: pass --overwrite to replace it")):
        refused("data.index_shards", [str(shards), "--out", str(out), "--workers", "1", *extra], message, capsys)
        assert snapshot(shards, tmp_path) == before
    assert run("data.index_shards", [str(shards), "--out", str(shards / "train.json"), "--workers", "1",
                                     "--overwrite"], capsys)[0] == 0
    assert json.loads((shards / "train.json").read_text())["label_key"] == "cls"  # the indexer's, not the writer's
    (shards / "more").mkdir()
    (shards / "train-000001.tar").rename(shards / "more" / "train-000001.tar")
    assert run("data.index_shards", [str(shards), "--out", str(shards / "train.json"), "--workers", "1"],
               capsys)[0] == 0  # its own index, rewritten by a rerun unasked
    assert json.loads((shards / "train.json").read_text())["num_samples"] == 3
    assert not temporaries(tmp_path) and not temporaries(shards)


def test_an_interrupted_index_leaves_the_earlier_one(shards, capsys, monkeypatch):
    earlier = (shards / "train.json").read_bytes()
    text_writes_half(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        run("data.index_shards", [str(shards), "--out", str(shards / "train.json"), "--workers", "1", "--overwrite"],
            capsys)
    assert (shards / "train.json").read_bytes() == earlier and not temporaries(shards)


# --- data.write_shards ---------------------------------------------------------------------------

def test_write_shards_never_writes_into_or_around_its_input(images, tmp_path, capsys):
    (tmp_path / "holder").mkdir()
    (tmp_path / "holder" / "images").symlink_to(images, target_is_directory=True)
    before = snapshot(images)
    for src, out, message in (
            (tmp_path / "holder" / "images", images,  # the same folder once the link is resolved
             r"output folder .* is the input folder .*holder/images: the shards would be written among the images"),
            (images, images / "class0" / "shards", r"output folder .* lies inside the input folder"),
            (images / "class0", images, r"the input folder .*class0 lies inside the output folder")):
        refused("data.write_shards", ["imagefolder", str(src), str(out), "--workers", "1", "--overwrite"], message,
                capsys)
        assert snapshot(images) == before
    assert sorted(p.name for p in (tmp_path / "holder").iterdir()) == ["images"]


def test_write_shards_replaces_a_shard_set_only_with_overwrite(images, shards, capsys):
    before = snapshot(shards)
    argv = ["imagefolder", str(images), str(shards), "--workers", "1", "--samples_per_shard", "6"]
    refused("data.write_shards", argv, r"output folder .*shards holds train-000000.tar, train-000001.tar, train.json "
                                       r"already: pass --overwrite to replace them, or give another output folder or "
                                       r"--name", capsys)
    assert snapshot(shards) == before
    assert run("data.write_shards", [*argv, "--overwrite"], capsys)[0] == 0
    index = json.loads((shards / "train.json").read_text())
    assert [s["samples"] for s in index["shards"]] == [6]
    assert sorted(p.name for p in shards.iterdir()) == ["train-000000.tar", "train.json"]  # the larger set's gone


def test_an_interrupted_shard_index_leaves_no_half_index(images, shards, capsys, monkeypatch):
    text_writes_half(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        run("data.write_shards", ["imagefolder", str(images), str(shards), "--workers", "1", "--overwrite"], capsys)
    assert not (shards / "train.json").exists()  # the earlier index would not describe the new shards
    assert not temporaries(shards) and not list(shards.glob(".*"))


def test_write_shards_never_replaces_the_index_it_takes_classes_from(tmp_path, capsys):
    root = tmp_path / "in1k"
    for wnid, value in (("n01440764", 30), ("n01443537", 200)):
        (root / "train" / wnid).mkdir(parents=True)
        Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)).save(root / "train" / wnid / "a.JPEG")
    out = tmp_path / "out"
    assert run("data.write_shards", ["imagenet", str(root), str(out), "--split", "train", "--workers", "1"],
               capsys)[0] == 0
    before = snapshot(out)
    refused("data.write_shards", ["imagenet", str(root), str(out), "--split", "train", "--classes_from",
                                  str(out / "train.json"), "--overwrite"],
            r"the index .*out/train.json would replace the input .*out/train.json", capsys)
    assert snapshot(out) == before


# --- train.pretrain's own folder -----------------------------------------------------------------

def pretrain_argv(out: Path, *more: str) -> list[str]:
    return ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(out),
            "--run.progress", "false", "--run.max_steps", "1", "--model.in_chans", "3", *more]


@pytest.mark.parametrize("weights", ["encoder.safetensors", "checkpoints/step00000001"])
def test_overwrite_never_deletes_the_weights_the_run_starts_from(run_dir, tmp_path, capsys, weights):
    """--run.overwrite deletes the old run's outputs; one of them being the run's --model.init_from
    (its export, or one of its checkpoints) is refused, and the folder keeps every byte."""
    import shutil
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    before = snapshot(out)
    name = weights.split("/")[0]
    refused("train.pretrain", pretrain_argv(out, "--model.init_from", str(out / weights), "--run.overwrite", "true"),
            rf"--model.init_from .*{re.escape(weights)} (is|lies inside) .*{name} of output_dir, and --run.overwrite "
            rf"true deletes the old run's outputs: copy it out of .* first, or choose another --output_dir", capsys)
    assert snapshot(out) == before


def test_a_failed_start_s_outputs_are_cleared_but_never_the_run_s_weights(run_dir, tmp_path, capsys):
    """A folder whose start never trained (a config.json, no checkpoint, no metrics) is cleared for
    the new run, unless what would be cleared is its --model.init_from; a start from weights kept
    outside clears it and trains."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "encoder.safetensors").write_bytes((run_dir / "encoder.safetensors").read_bytes())
    (out / "encoder.json").write_bytes((run_dir / "encoder.json").read_bytes())
    before = snapshot(out)
    refused("train.pretrain", pretrain_argv(out, "--model.init_from", str(out / "encoder.safetensors")),
            r"--model.init_from .*encoder.safetensors is .*encoder.safetensors of output_dir, and its outputs, "
            r"left by a start that never trained, are deleted", capsys)
    assert snapshot(out) == before
    status, err = run("train.pretrain", pretrain_argv(out, "--model.init_from", str(run_dir / "encoder.safetensors")),
                      capsys)
    assert status == 0, err[-3000:]
    assert (out / "checkpoints" / "step00000001").is_dir() and json.loads((out / "config.json").read_text())


def test_a_start_never_writes_over_the_weights_it_starts_from(run_dir, tmp_path, capsys):
    """A folder holding only an encoder (no run of its own, nothing to clear) given as output_dir of
    a run starting from that encoder: the run's export at its end would replace it. Refused before
    start, every byte kept."""
    out = tmp_path / "weights"
    out.mkdir()
    for name in ("encoder.safetensors", "encoder.json"):
        (out / name).write_bytes((run_dir / name).read_bytes())
    before = snapshot(out)
    refused("train.pretrain", pretrain_argv(out, "--model.init_from", str(out / "encoder.safetensors")),
            r"--model.init_from .*encoder.safetensors is .*encoder.safetensors of output_dir, and the run writes its "
            r"own there \(its export replaces encoder.safetensors\): copy it out of .* first", capsys)
    assert snapshot(out) == before


def test_a_folder_that_is_no_run_folder_keeps_its_files(tmp_path, capsys):
    """A folder with a config.json that is not a run's (a transformers model's, say) and nothing
    trained in it was taken for a failed start, and its config.json, eval.json and vis/ deleted
    unasked; it is refused, every byte kept, and deleted only with --run.overwrite true."""
    out = tmp_path / "results"
    (out / "vis").mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"model_type": "vit_mae"}))
    (out / "eval.json").write_text(json.dumps({"knn_top1": 80.0}))
    (out / "vis" / "figure.png").write_bytes(b"png")
    (out / "README.txt").write_text("mine")
    before = snapshot(out)
    refused("train.pretrain", pretrain_argv(out), r"output_dir .*results holds a config.json that is not a run's "
            r"config \(keys 'model_type' are no options\), so it is no run folder, .* choose another --output_dir "
            r"\(--run.overwrite true deletes its config.json, eval.json, vis\)", capsys)
    assert snapshot(out) == before
    status, err = run("train.pretrain", pretrain_argv(out, "--run.overwrite", "true"), capsys)
    assert status == 0, err[-3000:]
    assert not (out / "eval.json").exists() and (out / "README.txt").read_text() == "mine"


def test_a_transformers_folder_is_never_the_output_dir_of_a_run_starting_from_it(tmp_path, capsys):
    """--model.init_from a transformers folder with --output_dir the same folder: the run's
    config.json would replace the model's (with --run.overwrite too, which deleted it first)."""
    from hf_folders import vit_mae_folder

    folder, _ = vit_mae_folder(tmp_path / "hf")
    before = snapshot(folder)
    for more in ((), ("--run.overwrite", "true")):
        refused("train.pretrain", pretrain_argv(folder, "--model.init_from", str(folder), "--model.in_chans", "1",
                                                *more),
                r"--model.init_from .*hf is output_dir itself, where the run writes its config.json, checkpoints and "
                r"logs: choose another --output_dir", capsys)
        assert snapshot(folder) == before


def test_an_empty_output_dir_is_refused_not_taken_for_the_current_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    before = snapshot(tmp_path)
    argv = pretrain_argv(tmp_path)
    argv[argv.index("--output_dir") + 1] = ""
    refused("train.pretrain", argv,
            r"--output_dir is empty: give the run folder, e.g. --output_dir runs/pretrain", capsys)
    assert snapshot(tmp_path) == before


# --- train.export (timm) -------------------------------------------------------------------------

def test_export_never_writes_into_the_checkpoint(run_dir, tmp_path, capsys):
    tag = run_dir / "checkpoints" / "step00000001"
    before = snapshot(run_dir)
    for out, message in ((tag / "model.safetensors", r"--out .*model.safetensors lies inside the input "
                                                     r".*step00000001"),
                         (tag / "more" / "enc.safetensors", r"--out .*enc.safetensors lies inside the input "
                                                            r".*step00000001"),
                         (tmp_path / "enc.json", r"--out .*enc.json does not end in .safetensors"),
                         # safetensors bytes under a torch name: every reader would take them for a pickle
                         (tmp_path / "enc.pt", r"--out .*enc.pt does not end in .safetensors, the format written")):
        refused("train.export", ["--checkpoint", str(run_dir), "--out", str(out), "--overwrite"], message, capsys)
        assert snapshot(run_dir) == before
    assert not list(tmp_path.iterdir())


def test_export_replaces_a_file_only_with_overwrite_but_always_its_own(run_dir, tmp_path, capsys):
    out = tmp_path / "enc.safetensors"
    out.write_bytes(b"someone's file")
    refused("train.export", ["--checkpoint", str(run_dir), "--out", str(out)],
            r"--out .*enc.safetensors exists already: pass --overwrite to replace it", capsys)
    (tmp_path / "enc.json").write_text("someone's notes")
    out.unlink()
    refused("train.export", ["--checkpoint", str(run_dir), "--out", str(out)],
            r"the description beside --out .*enc.json exists already: pass --overwrite", capsys)
    assert (tmp_path / "enc.json").read_text() == "someone's notes" and not out.exists()
    assert run("train.export", ["--checkpoint", str(run_dir), "--out", str(out), "--overwrite"], capsys)[0] == 0
    assert json.loads((tmp_path / "enc.json").read_text())["step"] == 1
    own = run_dir / "encoder.safetensors"  # written by the run; the default output, replaced unasked
    assert run("train.export", ["--checkpoint", str(run_dir)], capsys)[0] == 0
    assert own.read_bytes() == out.read_bytes() and not temporaries(run_dir) and not temporaries(tmp_path)


def test_the_default_export_of_a_tag_kept_outside_a_run_folder_replaces_nothing_unasked(run_dir, tmp_path, capsys):
    """Above a tag copied out of its run (keep/tags/<tag>), the default names (keep/encoder_<tag>.*)
    may hold anyone's files: replaced only with --overwrite, as an --out's are."""
    import shutil
    tag = tmp_path / "keep" / "tags" / "step00000001"
    shutil.copytree(run_dir / "checkpoints" / "step00000001", tag)
    theirs = tmp_path / "keep" / "encoder_step00000001.safetensors"
    theirs.write_bytes(b"someone's weights")
    refused("train.export", ["--checkpoint", str(tag)],
            r"--out .*keep/encoder_step00000001.safetensors exists already: pass --overwrite to replace it", capsys)
    assert theirs.read_bytes() == b"someone's weights"
    assert not (tmp_path / "keep" / "encoder_step00000001.json").exists()
    assert run("train.export", ["--checkpoint", str(tag), "--overwrite"], capsys)[0] == 0
    assert theirs.read_bytes() == (run_dir / "encoder.safetensors").read_bytes()


def test_an_interrupted_export_leaves_the_earlier_files(run_dir, tmp_path, capsys, monkeypatch):
    own = {p: p.read_bytes() for p in (run_dir / "encoder.safetensors", run_dir / "encoder.json")}
    half_then_fail(monkeypatch, train.weights.export, "save_file")
    stopped_by_full_disk("train.export", ["--checkpoint", str(run_dir)], capsys)
    stopped_by_full_disk("train.export", ["--checkpoint", str(run_dir), "--out", str(tmp_path / "new.safetensors")], capsys)
    assert {p: p.read_bytes() for p in own} == own
    assert not list(tmp_path.iterdir()) and not temporaries(run_dir)


# --- train.export --format transformers ----------------------------------------------------------

def test_transformers_export_never_writes_over_or_around_the_checkpoint(run_dir, tmp_path, capsys):
    tag = run_dir / "checkpoints" / "step00000001"
    before = snapshot(run_dir)
    for out, message in ((tag, r"--out .*step00000001 is the input .*step00000001"),
                         (tag / "hf", r"--out .*hf lies inside the input .*step00000001"),
                         (run_dir / "checkpoints", r"--out .*checkpoints holds the checkpoint .*step00000001 it "
                                                   r"would be written from")):
        refused("train.export", ["--checkpoint", str(run_dir), "--format", "transformers", "--out", str(out),
                                 "--overwrite"], message, capsys)
        assert snapshot(run_dir) == before


def test_transformers_export_replaces_a_folder_only_with_overwrite(run_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"
    argv = ["--checkpoint", str(run_dir), "--format", "transformers", "--out", str(out)]
    assert run("train.export", argv, capsys)[0] == 0
    before = snapshot(out)
    refused("train.export", argv, r"--out .*hf exists already: pass --overwrite to replace it", capsys)
    assert snapshot(out) == before

    def fails(*args):
        raise ValueError("transformers loads the export with missing keys")

    monkeypatch.setattr(train.weights.transformers, "check_loads", fails)
    refused("train.export", [*argv, "--overwrite"], "transformers loads the export with missing keys", capsys)
    assert snapshot(out) == before and not temporaries(tmp_path)  # the earlier export, whole


# --- train.evaluate --out ------------------------------------------------------------------------

def test_evaluate_never_writes_its_result_over_an_input(run_dir, shards, held_out, tmp_path, capsys):
    index, tag = shards / "train.json", run_dir / "checkpoints" / "step00000001"
    source = ["--train_index", str(index), "--test_index", str(held_out)]
    before = snapshot(shards, run_dir, held_out.parent)
    for encoder, out, message in (
            (["--random_init", "vit_debug_patch4"], index, r"--out .*train.json is the input .*train.json"),
            (["--random_init", "vit_debug_patch4"], shards / "train-000001.tar", r"--out .*train-000001.tar is the "
                                                                                 r"input"),
            # the held-out split's index and shards are inputs too (held_out: test.json + test-000000.tar)
            (["--random_init", "vit_debug_patch4"], held_out, r"--out .*test.json is the input .*test.json"),
            (["--random_init", "vit_debug_patch4"], held_out.parent / "test-000000.tar",
             r"--out .*test-000000.tar is the input"),
            (["--encoder", str(run_dir / "encoder.safetensors")], run_dir / "encoder.json",
             r"--out .*encoder.json is the input .*encoder.json"),
            (["--checkpoint", str(run_dir)], tag / "eval.json", r"--out .*eval.json lies inside the input "
                                                                 r".*step00000001")):
        refused("train.evaluate", [*source, *encoder, "--out", str(out), "--overwrite"], message, capsys)
        assert snapshot(shards, run_dir, held_out.parent) == before


def test_evaluate_replaces_a_result_only_with_overwrite(shards, held_out, tmp_path, capsys, monkeypatch):
    out = tmp_path / "eval.json"
    out.write_text("an earlier result")
    argv = ["--train_index", str(shards / "train.json"), "--test_index", str(held_out),
            "--random_init", "vit_debug_patch4", "--out", str(out)]
    refused("train.evaluate", argv, r"--out .*eval.json exists already: pass --overwrite", capsys)
    assert out.read_text() == "an earlier result"
    text_writes_half(monkeypatch)
    stopped_by_full_disk("train.evaluate", [*argv, "--overwrite"], capsys)
    assert out.read_text() == "an earlier result" and not temporaries(tmp_path)
    monkeypatch.undo()
    assert run("train.evaluate", [*argv, "--overwrite"], capsys)[0] == 0
    assert json.loads(out.read_text())["train_samples"] == 6


# --- train.convert_checkpoint --------------------------------------------------------------------

def legacy_tag(tag: Path) -> Path:
    """A tag of the earlier layout: model.pt (weights, counters, client state) + optim_rank*.pt."""
    tag.mkdir(parents=True)
    weight = torch.arange(4.0)
    torch.save({"module": {"w": weight}, "engine": {"steps": 1, "health": {}}, "schedule": {"last": 1},
                "client": {"step": 1}}, tag / "model.pt")
    torch.save({"layout": [["w", 0, 4]], "optimizer": "AdamW",
                "pieces": [{"start": 0, "end": 4, "state": {"step": torch.tensor(1.0), "exp_avg": weight / 2}}]},
               tag / "optim_rank00000.pt")
    files = {p.name: p.stat().st_size for p in tag.iterdir()}
    (tag / "complete.json").write_text(json.dumps({"step": 1, "world_size": 1, "files": files}))
    return tag


def test_an_interrupted_conversion_leaves_the_tag_as_it_was(tmp_path, capsys, monkeypatch):
    tag = legacy_tag(tmp_path / "run" / "checkpoints" / "step00000001")
    before = snapshot(tag)
    def optimizer_state_fails(state, checkpoint_id, **kwargs):  # after the weights were written
        Path(checkpoint_id).mkdir()
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.distributed.checkpoint, "save", optimizer_state_fails)
    stopped_by_full_disk("train.convert_checkpoint", [str(tag)], capsys)
    assert snapshot(tag) == before and not temporaries(tag)
    monkeypatch.undo()
    assert run("train.convert_checkpoint", [str(tag)], capsys)[0] == 0
    assert sorted(p.name for p in tag.iterdir()) == ["complete.json", "model.safetensors", "optim", "state.pt"]


def test_a_tag_holding_both_layouts_is_not_converted_over(tmp_path, capsys):
    tag = legacy_tag(tmp_path / "step00000001")
    (tag / "model.safetensors").write_bytes(b"the engine's weights")
    before = snapshot(tag)
    refused("train.convert_checkpoint", [str(tag)], r"holds model.safetensors beside model.pt: it is of the engine's "
                                                    r"layout already", capsys)
    assert snapshot(tag) == before
