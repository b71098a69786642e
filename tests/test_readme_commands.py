"""The README's CPU path for a new user, run as written (issue 22): Fashion-MNIST shards -> each
method's debug preset on them -> export -> the timm snippet -> evaluate. The commands are read
from README.md (tests/readme_commands.py), not copied here, so a README command that stops
working fails this file, naming its README line.

What the tests change, and why: `python` -> this interpreter; the README's `shards/...` and
`runs/...` paths -> tmp folders; `--src` (write_shards' option) points at tiny idx files instead
of the 70k-image Debian package; the pretraining runs get `--output_dir` (the default would write
runs/pretrain in the repository) and `--run.max_steps 2`: a preset's few dozen steps would take a
minute for energy alone (1-3 s a step on 2 cores); the planned schedule is still checked.

"Your own data" (issue 23) too: each command of its three ways in, as written, on tiny inputs, the
README's `/data/pets`, `/data/imagenet`, `shards/...` and `names.txt` mapped to tmp folders:
ImageFolder / ImageNet -> write_shards; shards from webdataset's own ShardWriter (labeled by `cls`
for the brace pattern, img2dataset's unlabeled layout for the folder, a json field + class names)
-> index_shards; and the unlabeled index -> MAE pretraining (again `--output_dir` and
`--run.max_steps 2`, for the reasons above), which also checks that what needs labels
(`--objective linprobe`) refuses that index before start, as the README says.
"""
import json
import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import webdataset as wds
from conftest import WNIDS, fake_fashion_mnist, fake_imagenet
from readme_commands import (
    README,
    REPO,
    Snippet,
    code_block,
    command,
    paragraph,
    quoted,
    run,
)
from safetensors.torch import load_file
from wds_shards import image_bytes, write_img2dataset_shards

from model.objectives import list_objectives
from train.run_dir import read_metrics

TRAIN, TEST = 160, 64  # tiny splits: one shard each
STEPS = 2
# every registered method with a debug preset (finetune and linprobe have none: they need an encoder)
METHODS = [m for m in list_objectives() if (REPO / "train" / "configs" / m / "debug.json").exists()]

# The anchors: where each command lives in README.md.
WRITE_SHARDS = ("python -m data.write_shards fashion-mnist", "Data: webdataset shards")
PRETRAIN = ("python -m train.pretrain --ds_config ds_configs/cpu_debug.json", "The entry point")
EXPORT = ("python -m train.export --checkpoint", "Export to timm")
TIMM_SNIPPET = ("import safetensors.torch, timm", "Export to timm")
EVALUATE = ("python -m train.evaluate", "Evaluation on frozen features")
# "Your own data": each way in follows its bold lead (the section repeats the laion index command)
OWN = "Your own data"
WAY_1, WAY_2, WAY_3 = ("1. An image folder or ImageNet -> shards.", "2. Shards you already have -> an index.",
                       "3. Unlabeled shards -> pretraining.")
WRITE_FOLDER = ("python -m data.write_shards imagefolder", OWN, WAY_1)
WRITE_IMAGENET = ("python -m data.write_shards imagenet", OWN, WAY_1)
INDEX_PATTERN = ("python -m data.index_shards 'shards/in1k-wds/", OWN, WAY_2)
INDEX_FOLDER = ("python -m data.index_shards shards/laion/", OWN, WAY_2)
INDEX_JSON_LABEL = ("python -m data.index_shards shards/mine/", OWN, WAY_2)
INDEX_UNLABELED = ("python -m data.index_shards", OWN, WAY_3)
PRETRAIN_UNLABELED = ("python -m train.pretrain", OWN, WAY_3)
NEEDS_LABELS = "What needs labels refuses an unlabeled index before start"


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text()


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user's folders: the README's `shards/fmnist` and `runs/`, and the idx files the shards come from."""
    root = tmp_path_factory.mktemp("user")
    return {"fmnist": root / "shards" / "fmnist", "runs": root / "runs",
            "idx": fake_fashion_mnist(root / "idx", TRAIN, TEST)}


@pytest.fixture(scope="module")
def shards(readme, user):
    """README: `python -m data.write_shards fashion-mnist shards/fmnist`, plus --src (the tiny idx files)."""
    cmd = command(readme, *WRITE_SHARDS)
    proc = run(cmd, cmd.argv({"shards/fmnist": user["fmnist"]}) + ["--src", str(user["idx"])])
    return proc, user["fmnist"]


@pytest.fixture(scope="module")
def pretrain(readme, shards, user, request):
    """method -> its run folder: the README's entry-point command with the preset and the flags the
    README says to add to run a debug preset on shards. The selected methods (and MAE, which the
    export and evaluation use) start when the fixture is made, two at a time: each run is mostly
    its single-threaded start-up, so 2 cores finish two at once."""
    entry = command(readme, *PRETRAIN)
    preset = quoted(readme, "Each", PRETRAIN[1], after="is complete on its own")
    on_shards = quoted(readme, "To run one on shards add", PRETRAIN[1])
    where = Snippet(entry.line, f"{entry.text} (+ README.md:{on_shards.line} `{on_shards.text}`)")

    def start(method: str) -> Path:
        out = user["runs"] / method
        run(where, [*entry.argv({}), "--config", preset.text.replace("<method>", method),
                    *on_shards.argv({"shards/fmnist": user["fmnist"]}),
                    "--output_dir", str(out), "--run.max_steps", str(STEPS)])
        return out

    with ThreadPoolExecutor(max_workers=2) as pool:
        selected = {item.callspec.params.get("method") for item in request.session.items
                    if item.module is request.module and hasattr(item, "callspec")}
        runs = {m: pool.submit(start, m) for m in sorted(METHODS, key=lambda m: m != "mae")
                if m in selected or m == "mae"}
        yield lambda method: runs[method].result()
        pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="module")
def exported(readme, pretrain):
    """README: `python -m train.export --checkpoint runs/mae_vitb` on the MAE run (its own export
    at the end of the run is deleted first, so the file is the command's)."""
    run_dir = pretrain("mae")
    for name in ("encoder.safetensors", "encoder.json"):
        (run_dir / name).unlink()
    cmd = command(readme, *EXPORT)
    proc = run(cmd, cmd.argv({"runs/mae_vitb": run_dir}))
    return proc, run_dir / "encoder.safetensors"


def test_write_shards_fashion_mnist(shards):
    proc, out = shards
    for split, n in (("train", TRAIN), ("test", TEST)):
        index = json.loads((out / f"{split}.json").read_text())
        assert index["num_samples"] == n and sum(s["samples"] for s in index["shards"]) == n
        assert all((out / s["file"]).stat().st_size > 0 for s in index["shards"])
        assert f"{split}: {n} samples" in proc.stdout


@pytest.mark.parametrize("method", METHODS)
def test_debug_preset_on_the_shards(method, pretrain):
    run_dir = pretrain(method)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["objective"] == method and config["data"]["source"] == "shards" and config["model"]["in_chans"] == 3
    # the README's promise: still a few dozen steps on shards (not epochs of the whole index)
    assert json.loads((run_dir / "meta.json").read_text())["total_steps"] <= 64
    rows = read_metrics(run_dir)
    assert rows[-1]["step"] == STEPS and math.isfinite(rows[-1]["loss"])
    assert rows[-1]["data_skipped_undecodable_image"] == 0  # read from the shards
    weights = load_file(str(run_dir / "encoder.safetensors"))
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    assert json.loads((run_dir / "encoder.json").read_text())["step"] == STEPS


def test_export(exported):
    proc, path = exported
    info = json.loads(path.with_suffix(".json").read_text())
    assert info["objective"] == "mae" and info["step"] == STEPS
    kw = info["timm_kwargs"]
    assert load_file(str(path))["pos_embed"].shape == (1, 1 + (kw["img_size"] // kw["patch_size"]) ** 2, kw["embed_dim"])
    assert f"load it in timm (strict):\n{info['timm_snippet']}" in proc.stdout  # what the command prints


def test_timm_snippet_loads_strictly(exported):
    """The lines encoder.json (and the export command) give, run as they are: a strict load."""
    _, path = exported
    info = json.loads(path.with_suffix(".json").read_text())
    scope: dict = {}
    exec(info["timm_snippet"], scope)  # noqa: S102 (text the export wrote); load_state_dict is strict
    model, kw = scope["model"].eval(), info["timm_kwargs"]
    x = torch.randn(2, kw["in_chans"], kw["img_size"], kw["img_size"])
    with torch.no_grad():
        assert model(x).shape == (2, kw["embed_dim"])  # num_classes=0: the pooled feature, no head
        assert model.forward_features(x).shape == (2, 1 + (kw["img_size"] // kw["patch_size"]) ** 2, kw["embed_dim"])


def test_readme_timm_snippet_is_what_export_writes_for_vit_b(readme):
    """The README's example snippet (a ViT-B/16 export) is the text train.export writes for one."""
    from model import create_model
    from train.export import timm_loading

    block = code_block(readme, *TIMM_SNIPPET)
    with torch.device("meta"):
        encoder = create_model("vit_base_patch16")
    info = timm_loading(encoder.timm_kwargs(), "vit_base_patch16", encoder.state_dict(),
                        "runs/mae_vitb/encoder.safetensors")
    assert block.text == info["timm_snippet"], f"{block.where} differs from train.export's snippet"


def test_evaluate(readme, shards, exported):
    _, shard_dir = shards
    _, encoder = exported
    cmd = command(readme, *EVALUATE)
    proc = run(cmd, cmd.argv({"shards/fmnist": shard_dir, "runs/x": encoder.parent}))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 <= result["knn_top1"] <= 100 and 0 <= result["linear_probe_top1"] <= 100
    assert (result["train_samples"], result["test_samples"]) == (TRAIN, TEST)


# The parser: an anchor that is gone or a path the test does not map fails with the README line.

def test_commands_are_read_from_the_readme_text(readme):
    evaluate = command(readme, *EVALUATE)
    assert readme.splitlines()[evaluate.line - 1].startswith("    python -m train.evaluate")
    argv = evaluate.argv({"shards/fmnist": REPO / "x", "runs/x": REPO / "y"})
    assert argv[:3] == [sys.executable, "-m", "train.evaluate"] and str(REPO / "x" / "train.json") in argv
    assert argv[-2:] == ["--encoder", str(REPO / "y" / "encoder.safetensors")]  # continuation joined, comment dropped
    flags = quoted(readme, "To run one on shards add", PRETRAIN[1])
    assert "--data.source" in flags.text and "\n" not in flags.text


def test_a_command_gone_from_the_readme_fails_naming_its_section(readme):
    cmd = command(readme, *WRITE_SHARDS)
    broken = readme.replace(cmd.text.split("#")[0].strip(), "python -m data.write_shards fmnist shards/fmnist")
    with pytest.raises(LookupError, match=r"'Data: webdataset shards' \(README.md:\d+\)"):
        command(broken, *WRITE_SHARDS)
    with pytest.raises(LookupError, match="To run one on shards add"):
        quoted(re.sub(r"run\s+one\s+on\s+shards", "use shards", readme), "To run one on shards add", PRETRAIN[1])


def test_a_readme_path_the_test_does_not_map_is_refused(readme):
    cmd = command(readme, *WRITE_SHARDS)
    with pytest.raises(ValueError, match=rf"README.md:{cmd.line}: the test maps no folder for \['shards/fmnist'\]"):
        cmd.argv({"runs/x": REPO / "y"})


# "Your own data": the three ways in, each command as written on tiny inputs.

def _index(path: Path) -> dict:
    return json.loads(path.read_text())


def _write_labeled_shards(folder: Path, count: int) -> None:
    """ImageNet in webdataset form as webdataset's ShardWriter writes it: `count` shards of one tiny
    sample each (jpg + cls, label k % 3), so that the README's brace pattern names real files."""
    folder.mkdir(parents=True)
    image = image_bytes(0, size=8)
    with wds.ShardWriter(str(folder / "train-%06d.tar"), maxcount=1, verbose=0) as sink:
        for k in range(count):
            sink.write({"__key__": f"sample{k:06d}", "jpg": image, "cls": k % 3})


@pytest.fixture(scope="module")
def own(readme, tmp_path_factory):
    """The user's folders (the README's shards/..., /data/imagenet, names.txt under one tmp root) and
    the README's commands of "Your own data" run on them, two at a time (each is mostly its
    single-threaded start-up: importing webdataset imports torch): name -> a future of the
    finished process. Way 3 is one chain: index, pretrain (with --output_dir and --run.max_steps 2,
    as above), and the same pretraining command with `--objective linprobe` (check=False: it must
    be refused)."""
    root = tmp_path_factory.mktemp("own")
    shards = root / "shards"
    _write_labeled_shards(shards / "in1k-wds", 1282)
    write_img2dataset_shards(shards / "laion")  # ShardWriter: 2 x 8 samples, jpg / webp + txt + json, no label
    write_img2dataset_shards(shards / "mine", label_field="label")  # the json's label: k % 3
    (root / "names.txt").write_text("cat\ndog\neel\n")
    paths = {"/data/imagenet": fake_imagenet(root / "imagenet"), "names.txt": root / "names.txt",
             "runs": root / "runs", **{f"shards/{name}": shards / name
                                       for name in ("in1k", "in1k-wds", "laion", "laion.json", "mine", "mine.json")}}

    def readme_command(anchor, *extra: str, check: bool = True):
        cmd = command(readme, *anchor)
        return run(cmd, [*cmd.argv(paths), *extra], check=check)

    def way_3():
        index = readme_command(INDEX_UNLABELED)
        train = readme_command(PRETRAIN_UNLABELED, "--output_dir", str(root / "runs" / "mae"),
                               "--run.max_steps", str(STEPS))
        refused = readme_command(PRETRAIN_UNLABELED, "--objective", "linprobe", "--output_dir",
                                 str(root / "runs" / "linprobe"), check=False)
        return index, train, refused

    jobs = {"unlabeled": way_3,  # the longest first
            "imagenet": lambda: readme_command(WRITE_IMAGENET),
            "pattern": lambda: readme_command(INDEX_PATTERN),
            "folder": lambda: readme_command(INDEX_FOLDER),
            "json_label": lambda: readme_command(INDEX_JSON_LABEL)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield root, {name: pool.submit(job) for name, job in jobs.items()}
        pool.shutdown(cancel_futures=True)


def test_own_data_write_an_image_folder(readme, image_folder, tmp_path):
    """README: `python -m data.write_shards imagefolder /data/pets shards/pets --name train`, /data/pets
    the conftest's folder (cat/ dog/ eel/, 8 jpg or png each)."""
    cmd = command(readme, *WRITE_FOLDER)
    proc = run(cmd, cmd.argv({"/data/pets": image_folder, "shards/pets": tmp_path / "pets"}))
    index = _index(tmp_path / "pets" / "train.json")  # --name train
    assert (index["num_samples"], index["classes"]) == (24, ["cat", "dog", "eel"])
    assert "train: 24 samples" in proc.stdout


def test_own_data_write_imagenet(own):
    """README: `python -m data.write_shards imagenet /data/imagenet shards/in1k --samples_per_shard 1250`
    on a fake ImageNet (3 wnids, train/<wnid>/ and val/<wnid>/ folders)."""
    root, runs = own
    runs["imagenet"].result()
    train, val = (_index(root / "shards" / "in1k" / f"{split}.json") for split in ("train", "val"))
    assert (train["num_samples"], val["num_samples"]) == (9, 6)
    assert len(train["shards"]) == len(val["shards"]) == 1  # 1250 samples a shard
    assert train["classes"] == val["classes"] == sorted(WNIDS)  # timm / torchvision's class order


def test_own_data_index_a_brace_pattern_of_shardwriter_shards(own):
    """README: `python -m data.index_shards 'shards/in1k-wds/train-{000000..001281}.tar' --out ...`
    on 1282 one-sample ShardWriter shards labeled by `cls`."""
    root, runs = own
    runs["pattern"].result()
    index = _index(root / "shards" / "in1k-wds" / "train.json")
    assert (index["num_samples"], len(index["shards"]), index["labeled"]) == (1282, 1282, True)
    assert index["classes"] == ["0", "1", "2"] and index["label_key"] == "cls"
    assert [s["file"] for s in index["shards"][:2]] == ["train-000000.tar", "train-000001.tar"]


def test_own_data_index_a_folder_of_img2dataset_shards(own):
    """README: `python -m data.index_shards shards/laion/ --out shards/laion.json --workers 32`
    (more workers than shards: as many as there are shards)."""
    root, runs = own
    runs["folder"].result()
    index = _index(root / "shards" / "laion.json")
    assert (index["num_samples"], len(index["shards"]), index["labeled"], index["classes"]) == (16, 2, False, [])
    assert index["members"]["webp"] == 2 and index["unlabeled"]["count"] == 16


def test_own_data_index_labels_from_a_json_field_with_class_names(own):
    """README: `python -m data.index_shards shards/mine/ --out shards/mine.json --label_key json:label
    --classes names.txt`, names.txt (read from where the command runs) mapped to a tmp file."""
    root, runs = own
    runs["json_label"].result()
    index = _index(root / "shards" / "mine.json")
    assert (index["num_samples"], index["labeled"], index["label_key"]) == (16, True, "json:label")
    assert index["classes"] == ["cat", "dog", "eel"]


def test_own_data_unlabeled_shardwriter_shards_pretrain_mae(own):
    """Way 3 (issue 23's "done when"): ShardWriter shards with no labels, indexed and pretrained with
    the README's two commands: no sample skipped, a finite loss, the encoder exported."""
    root, runs = own
    runs["unlabeled"].result()
    index = _index(root / "shards" / "laion.json")
    assert (index["num_samples"], index["labeled"]) == (16, False)
    run_dir = root / "runs" / "mae"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["objective"] == "mae" and config["data"]["train_index"] == str(root / "shards" / "laion.json")
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and all(math.isfinite(r["loss"]) for r in rows)
    skipped = {k: v for row in rows for k, v in row.items() if k.startswith("data_skipped_")}
    assert "data_skipped_missing_cls" in skipped and not any(skipped.values()), skipped  # none for a missing label
    weights = load_file(str(run_dir / "encoder.safetensors"))
    assert weights and all(torch.isfinite(w).all() for w in weights.values())


def test_own_data_what_needs_labels_refuses_the_unlabeled_index(readme, own):
    """The README's claim, for `linprobe` (which it lists), on the index way 3 wrote: its pretraining
    command with `--objective linprobe` exits 2 before start, naming the index and the fix."""
    claim = paragraph(readme, NEEDS_LABELS, OWN).text
    assert claim.startswith(f"{NEEDS_LABELS} (exit 2, naming the index and the fix):") and "`linprobe`" in claim
    root, runs = own
    _, _, proc = runs["unlabeled"].result()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"the shard index {root / 'shards' / 'laion.json'} is unlabeled" in proc.stderr
    assert "python -m data.index_shards SHARDS... --out INDEX.json --label_key KEY" in proc.stderr  # the fix
    assert not (root / "runs" / "linprobe").exists()  # before start


def test_own_data_commands_are_told_apart_by_their_way_in(readme):
    """Way 3 repeats way 2's laion index command without --workers: each is read from its own way in,
    and a command gone from way 3 fails naming the section even though way 2 still has its twin."""
    assert command(readme, *INDEX_FOLDER).text.endswith("--workers 32")
    way_3, train = command(readme, *INDEX_UNLABELED), command(readme, *PRETRAIN_UNLABELED)
    assert way_3.line > command(readme, *INDEX_JSON_LABEL).line and "--workers" not in way_3.text
    assert train.line == way_3.line + 1 and train.line != command(readme, *PRETRAIN).line
    gone = readme.replace(f"    {way_3.text}\n", "").replace(f"    {train.text}\n", "")
    with pytest.raises(LookupError, match=r"'python -m data.index_shards' after .*'Your own data' \(README.md:\d+\)"):
        command(gone, *INDEX_UNLABELED)
    with pytest.raises(LookupError, match="words '3. Unlabeled shards -> pretraining.'"):
        command(readme.replace("**3. Unlabeled shards", "**3. Shards without labels"), *INDEX_UNLABELED)


def test_own_data_paths_the_test_does_not_map_are_refused(readme):
    cmd = command(readme, *WRITE_FOLDER)
    with pytest.raises(ValueError, match=rf"README.md:{cmd.line}: the test maps no folder for \['/data/pets'\]"):
        cmd.argv({"shards/pets": REPO / "x"})
