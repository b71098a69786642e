"""The commands a new user copies, run as written on CPU. Each is read from the page that gives it
(tests/readme_commands.py), not copied here, so a command that no longer works fails this file naming
its file and line:
- docs/DATA.md: Fashion-MNIST shards, and "Your own data": each command of its three ways in, on tiny
  inputs (ImageFolder / ImageNet -> write_shards; shards from webdataset's own ShardWriter, labeled by
  `cls` for the brace pattern, img2dataset's unlabeled layout for the folder, a json field + class
  names -> index_shards; the unlabeled index -> MAE pretraining, and what needs labels
  (`--objective linprobe`) refusing that index before start, as the page says);
- docs/TRAINING.md: the entry point with each method's debug preset on those shards, with the flags
  the page says to add;
- docs/CHECKPOINTS.md: export and the timm snippet it prints, the export to transformers and the lines
  it prints; docs/EVALUATION.md: evaluate;
- README.md: its commands are the docs pages' (verbatim, so they are tested there), its `make`
  targets exist, its one-node command passes the dry run for 8 A100s, and its Slurm command passes
  `launchers/submit.py --dry`.

What the tests change, and why: `python` -> this interpreter; the pages' `shards/...`, `runs/...`,
`/data/...`, `/scratch/...` paths and `names.txt` -> tmp folders; `--src` (write_shards' option)
points at tiny idx files instead of the 70k-image dataset; the pretraining runs get `--output_dir`
(the default would write runs/pretrain in the repository) and `--run.max_steps 2`: a preset's few
dozen steps would take a minute for energy alone (1-3 s a step on 2 cores); the planned schedule is
still checked. The GPU commands run their checks only: `deepspeed --num_gpus 8` becomes
`--dry-run --world_size 8 --gpu a100`, and the Slurm submit gets `--dry`.
"""
import json
import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest
import torch
import webdataset as wds
from conftest import WNIDS, fake_fashion_mnist, fake_imagenet
from readme_commands import (
    REPO,
    Doc,
    Snippet,
    code_block,
    code_lines,
    command,
    paragraph,
    quoted,
    run,
)
from safetensors.torch import load_file
from wds_shards import image_bytes, write_img2dataset_shards

from model.objectives import list_objectives
from train.run.folder import read_metrics

TRAIN, TEST = 160, 64  # tiny splits: one shard each
STEPS = 2
# every registered method with a debug preset (finetune and linprobe have none: they need an encoder)
METHODS = [m for m in list_objectives() if (REPO / "train" / "configs" / m / "debug.json").exists()]

# The anchors: (page, the start of the command, its section[, the words it follows]).
README, DATA, TRAINING, CHECKPOINTS, EVALUATION = ("README.md", "docs/DATA.md", "docs/TRAINING.md",
                                                   "docs/CHECKPOINTS.md", "docs/EVALUATION.md")
FMNIST = "runs/shards/fashion_mnist"  # where the pages (and make demo) put the Fashion-MNIST shards
WRITE_SHARDS = (DATA, "python -m data.write_shards fashion-mnist", "Writing shards")
PRETRAIN = (TRAINING, "python train/pretrain.py --ds_config ds_configs/cpu_debug.json", "Entry points")
EXPORT = (CHECKPOINTS, "python train/export.py --checkpoint", "Export to timm")
TIMM_SNIPPET = (CHECKPOINTS, "import safetensors.torch, timm", "Export to timm")
EXPORT_HF = (CHECKPOINTS, "python train/export.py --checkpoint runs/mae_vitb --format transformers",
             "Export to transformers")
HF_SNIPPET = (CHECKPOINTS, "from transformers import ViTMAEForPreTraining", "Export to transformers")
EVALUATE = (EVALUATION, "python train/evaluate.py", "Frozen features: kNN and a quick linear probe")
# "Your own data": each way in follows its bold lead (the section repeats the laion index command)
OWN = "Your own data"
WAY_1, WAY_2, WAY_3 = ("1. An image folder or ImageNet -> shards.", "2. Shards you already have -> an index.",
                       "3. Unlabeled shards -> pretraining.")
WRITE_FOLDER = (DATA, "python -m data.write_shards imagefolder", OWN, WAY_1)
WRITE_IMAGENET = (DATA, "python -m data.write_shards imagenet", OWN, WAY_1)
INDEX_PATTERN = (DATA, "python -m data.index_shards 'shards/in1k-wds/", OWN, WAY_2)
INDEX_FOLDER = (DATA, "python -m data.index_shards shards/laion/", OWN, WAY_2)
INDEX_JSON_LABEL = (DATA, "python -m data.index_shards shards/mine/", OWN, WAY_2)
INDEX_UNLABELED = (DATA, "python -m data.index_shards", OWN, WAY_3)
PRETRAIN_UNLABELED = (DATA, "python train/pretrain.py", OWN, WAY_3)
NEEDS_LABELS = "What needs labels refuses an unlabeled index before start"
# README.md: the GPU commands, run as their checks
ONE_NODE = (README, "deepspeed --num_gpus 8 train/pretrain.py", "In brief")
SLURM = (README, "python -m launchers.submit", "In brief")


@cache
def page(name: str) -> Doc:
    return Doc.read(name)


def find(anchor: tuple) -> Snippet:
    """The command an anchor names, read from its page."""
    name, *rest = anchor
    return command(page(name), *rest)


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user's folders: the pages' runs/shards/fashion_mnist and runs/, and the idx files the shards come from."""
    root = tmp_path_factory.mktemp("user")
    return {"fmnist": root / "runs" / "shards" / "fashion_mnist", "runs": root / "runs",
            "idx": fake_fashion_mnist(root / "idx", TRAIN, TEST)}


@pytest.fixture(scope="module")
def shards(user):
    """docs/DATA.md: `python -m data.write_shards fashion-mnist runs/shards/fashion_mnist`, plus --src (the tiny idx files)."""
    cmd = find(WRITE_SHARDS)
    proc = run(cmd, cmd.argv({FMNIST: user["fmnist"]}) + ["--src", str(user["idx"])])
    return proc, user["fmnist"]


@pytest.fixture(scope="module")
def pretrain(shards, user, request):
    """method -> its run folder: docs/TRAINING.md's entry-point command with the preset and the flags
    the page says to add to run a debug preset on shards. The selected methods (and MAE, which the
    export and evaluation use) start when the fixture is made, two at a time: each run is mostly
    its single-threaded start-up, so 2 cores finish two at once."""
    training = page(TRAINING)
    entry = find(PRETRAIN)
    preset = quoted(training, "Each", PRETRAIN[2], after="is complete on its own")
    on_shards = quoted(training, "To run one on shards add", PRETRAIN[2])
    where = Snippet(entry.line, f"{entry.text} (+ {on_shards.where} `{on_shards.text}`)", entry.file)

    def start(method: str) -> Path:
        out = user["runs"] / method
        run(where, [*entry.argv({}), "--config", preset.text.replace("<method>", method),
                    *on_shards.argv({FMNIST: user["fmnist"]}),
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
def exported(pretrain):
    """docs/CHECKPOINTS.md: `python train/export.py --checkpoint runs/mae_vitb` on the MAE run (its
    own export at the end of the run is deleted first, so the file is the command's)."""
    run_dir = pretrain("mae")
    for name in ("encoder.safetensors", "encoder.json"):
        (run_dir / name).unlink()
    cmd = find(EXPORT)
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
    # the page's promise: still a few dozen steps on shards (not epochs of the whole index)
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


def test_the_timm_snippet_on_the_page_is_what_export_writes_for_vit_b():
    """docs/CHECKPOINTS.md's example snippet (a ViT-B/16 export) is the text train.export writes for one."""
    from model import create_model
    from train.weights.export import timm_loading

    name, *rest = TIMM_SNIPPET
    block = code_block(page(name), *rest)
    with torch.device("meta"):
        encoder = create_model("vit_base_patch16")
    info = timm_loading(encoder.timm_kwargs(), "vit_base_patch16", encoder.state_dict(),
                        "runs/mae_vitb/encoder.safetensors")
    assert block.text == info["timm_snippet"], f"{block.where} differs from train.export's snippet"


def test_export_to_transformers(pretrain):
    """docs/CHECKPOINTS.md: `python train/export.py --checkpoint runs/mae_vitb --format transformers`
    on the MAE run: a folder ViTMAEForPreTraining.from_pretrained loads with nothing missing or
    unexpected, and the command prints the lines that load it."""
    transformers = pytest.importorskip("transformers")
    run_dir = pretrain("mae")
    cmd = find(EXPORT_HF)
    proc = run(cmd, cmd.argv({"runs/mae_vitb": run_dir}))
    out = run_dir / "transformers"
    _, info = transformers.ViTMAEForPreTraining.from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    assert f"model = ViTMAEForPreTraining.from_pretrained({str(out)!r})" in proc.stdout


def test_the_transformers_lines_on_the_page_are_what_export_prints():
    from train.weights.transformers import loading_lines

    name, *rest = HF_SNIPPET
    block = code_block(page(name), *rest)
    assert block.text == loading_lines("ViTMAEForPreTraining", Path("runs/mae_vitb/transformers")), block.where


def test_evaluate(shards, exported):
    _, shard_dir = shards
    _, encoder = exported
    cmd = find(EVALUATE)
    proc = run(cmd, cmd.argv({FMNIST: shard_dir, "runs/x": encoder.parent}))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 <= result["knn_top1"] <= 100 and 0 <= result["linear_probe_top1"] <= 100
    assert (result["train_samples"], result["test_samples"]) == (TRAIN, TEST)


# The parser: an anchor that is gone or a path the test does not map fails with the page's file and line.

def test_commands_are_read_from_the_pages_text():
    evaluate = find(EVALUATE)
    assert evaluate.file == EVALUATION
    assert page(EVALUATION).text.splitlines()[evaluate.line - 1].startswith("    python train/evaluate.py")
    argv = evaluate.argv({FMNIST: REPO / "x", "runs/x": REPO / "y"})
    assert argv[:2] == [sys.executable, "train/evaluate.py"] and str(REPO / "x" / "train.json") in argv
    assert argv[-2:] == ["--encoder", str(REPO / "y" / "encoder.safetensors")]  # continuation joined, comment dropped
    flags = quoted(page(TRAINING), "To run one on shards add", PRETRAIN[2])
    assert flags.file == TRAINING and "--data.source" in flags.text and "\n" not in flags.text


def test_a_command_gone_from_its_page_fails_naming_the_page_and_section():
    data = page(DATA)
    cmd = find(WRITE_SHARDS)
    broken = data.replace(cmd.text.split("#")[0].strip(), f"python -m data.write_shards fmnist {FMNIST}")
    with pytest.raises(LookupError, match=r"docs/DATA.md has no .* in section 'Writing shards' \(docs/DATA.md:\d+\)"):
        command(broken, *WRITE_SHARDS[1:])
    training = page(TRAINING)
    with pytest.raises(LookupError, match="docs/TRAINING.md has no `...` after 'To run one on shards add'"):
        quoted(training.sub(r"run\s+one\s+on\s+shards", "use shards"), "To run one on shards add", PRETRAIN[2])


def test_a_path_the_test_does_not_map_is_refused_naming_the_page_and_line():
    cmd = find(WRITE_SHARDS)
    with pytest.raises(ValueError, match=rf"docs/DATA.md:{cmd.line}: the test maps no folder for \['{FMNIST}'\]"):
        cmd.argv({"runs/x": REPO / "y"})


def test_bare_text_is_read_as_the_readme():
    snippet = command("intro\n\n    python train/export.py --checkpoint runs/x\n", "python train/export.py", "Export")
    assert snippet.where == "README.md:3"


# README.md: a front door whose commands are tested where the docs give them, or here as their checks.

def readme_commands() -> list[Snippet]:
    return [s for s in code_lines(page(README)) if s.text.startswith(("python ", "deepspeed ", ".venv/bin/python "))]


def test_every_readme_command_is_a_docs_command():
    """The README's commands are copies of the docs pages' (where the tests above run them, or the
    GPU checks below): a README command that drifts from its page fails here, naming its line."""
    docs = {s.text for name in sorted(REPO.glob("docs/**/*.md")) for s in code_lines(page(str(name.relative_to(REPO))))}
    commands = readme_commands()
    assert len(commands) >= 5, [c.text for c in commands]
    drifted = [f"{c.where}: {c.text}" for c in commands if c.text not in docs]
    assert not drifted, "README commands that no docs page gives:\n" + "\n".join(drifted)


def test_the_readme_make_commands_are_makefile_targets():
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))
    variables = set(re.findall(r"^([A-Z_]+) *\?=", (REPO / "Makefile").read_text(), re.MULTILINE))
    used = [s for s in code_lines(page(README)) if "make " in s.text]
    assert {"demo", "test", "install"} <= {t for s in used for t in re.findall(r"\bmake (\w[\w-]*)", s.text)}
    for s in used:
        for target in re.findall(r"\bmake ([a-z][\w-]*)", s.text):
            assert target in targets, f"{s.where}: no Makefile target {target!r}"
        for var in re.findall(r"\b([A-Z_]+)=", s.text):
            assert var in variables, f"{s.where}: the Makefile has no variable {var}"


def test_the_readme_one_node_command_passes_the_dry_run_for_8_a100s(tmp_path):
    """README.md's `deepspeed --num_gpus 8 train/pretrain.py ...`, checked as the page says to check it:
    the same options with `--dry-run --world_size 8 --gpu a100` (the index is not on this machine:
    the dry run says so and checks the rest)."""
    cmd = find(ONE_NODE)
    argv = cmd.argv({"shards": tmp_path / "shards", "runs": tmp_path / "runs"})
    assert argv[:3] == ["deepspeed", "--num_gpus", "8"], argv
    proc = run(cmd, [sys.executable, *argv[3:], "--dry-run", "--world_size", "8", "--gpu", "a100"])
    assert "8 x A100" in proc.stdout and "OK: nothing would stop this run before it starts" in proc.stdout, proc.stdout
    assert not (tmp_path / "runs").exists()


def test_the_readme_slurm_command_passes_submit_dry(tmp_path):
    """README.md's `python -m launchers.submit ...` with `--dry`: the dry run for its nodes x GPUs,
    then the sbatch command, nothing written or submitted."""
    cmd = find(SLURM)
    argv = cmd.argv({"shards": tmp_path / "shards", "/scratch": tmp_path / "scratch"})
    split = argv.index("--")
    proc = run(cmd, [*argv[:split], "--dry", *argv[split:]])
    assert "16 x A100" in proc.stdout and "\nsbatch " in proc.stdout, proc.stdout
    assert not (tmp_path / "scratch").exists()


# "Your own data": the three ways in, each command as written on tiny inputs.

def _index(path: Path) -> dict:
    return json.loads(path.read_text())


def _write_labeled_shards(folder: Path, count: int) -> None:
    """ImageNet in webdataset form as webdataset's ShardWriter writes it: `count` shards of one tiny
    sample each (jpg + cls, label k % 3), so that the page's brace pattern names real files."""
    folder.mkdir(parents=True)
    image = image_bytes(0, size=8)
    with wds.ShardWriter(str(folder / "train-%06d.tar"), maxcount=1, verbose=0) as sink:
        for k in range(count):
            sink.write({"__key__": f"sample{k:06d}", "jpg": image, "cls": k % 3})


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """The user's folders (docs/DATA.md's shards/..., /data/imagenet, names.txt under one tmp root) and
    the page's commands of "Your own data" run on them, two at a time (each is mostly its
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

    def page_command(anchor, *extra: str, check: bool = True):
        cmd = find(anchor)
        return run(cmd, [*cmd.argv(paths), *extra], check=check)

    def way_3():
        index = page_command(INDEX_UNLABELED)
        train = page_command(PRETRAIN_UNLABELED, "--output_dir", str(root / "runs" / "mae"),
                               "--run.max_steps", str(STEPS))
        refused = page_command(PRETRAIN_UNLABELED, "--objective", "linprobe", "--output_dir",
                                 str(root / "runs" / "linprobe"), check=False)
        return index, train, refused

    jobs = {"unlabeled": way_3,  # the longest first
            "imagenet": lambda: page_command(WRITE_IMAGENET),
            "pattern": lambda: page_command(INDEX_PATTERN),
            "folder": lambda: page_command(INDEX_FOLDER),
            "json_label": lambda: page_command(INDEX_JSON_LABEL)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield root, {name: pool.submit(job) for name, job in jobs.items()}
        pool.shutdown(cancel_futures=True)


def test_own_data_write_an_image_folder(image_folder, tmp_path):
    """docs/DATA.md: `python -m data.write_shards imagefolder /data/pets shards/pets --name train`, /data/pets
    the conftest's folder (cat/ dog/ eel/, 8 jpg or png each)."""
    cmd = find(WRITE_FOLDER)
    proc = run(cmd, cmd.argv({"/data/pets": image_folder, "shards/pets": tmp_path / "pets"}))
    index = _index(tmp_path / "pets" / "train.json")  # --name train
    assert (index["num_samples"], index["classes"]) == (24, ["cat", "dog", "eel"])
    assert "train: 24 samples" in proc.stdout


def test_own_data_write_imagenet(own):
    """docs/DATA.md: `python -m data.write_shards imagenet /data/imagenet shards/in1k --samples_per_shard 1250`
    on a fake ImageNet (3 wnids, train/<wnid>/ and val/<wnid>/ folders)."""
    root, runs = own
    runs["imagenet"].result()
    train, val = (_index(root / "shards" / "in1k" / f"{split}.json") for split in ("train", "val"))
    assert (train["num_samples"], val["num_samples"]) == (9, 6)
    assert len(train["shards"]) == len(val["shards"]) == 1  # 1250 samples a shard
    assert train["classes"] == val["classes"] == sorted(WNIDS)  # timm / torchvision's class order


def test_own_data_index_a_brace_pattern_of_shardwriter_shards(own):
    """docs/DATA.md: `python -m data.index_shards 'shards/in1k-wds/train-{000000..001281}.tar' --out ...`
    on 1282 one-sample ShardWriter shards labeled by `cls`."""
    root, runs = own
    runs["pattern"].result()
    index = _index(root / "shards" / "in1k-wds" / "train.json")
    assert (index["num_samples"], len(index["shards"]), index["labeled"]) == (1282, 1282, True)
    assert index["classes"] == ["0", "1", "2"] and index["label_key"] == "cls"
    assert [s["file"] for s in index["shards"][:2]] == ["train-000000.tar", "train-000001.tar"]


def test_own_data_index_a_folder_of_img2dataset_shards(own):
    """docs/DATA.md: `python -m data.index_shards shards/laion/ --out shards/laion.json --workers 32`
    (more workers than shards: as many as there are shards)."""
    root, runs = own
    runs["folder"].result()
    index = _index(root / "shards" / "laion.json")
    assert (index["num_samples"], len(index["shards"]), index["labeled"], index["classes"]) == (16, 2, False, [])
    assert index["members"]["webp"] == 2 and index["unlabeled"]["count"] == 16


def test_own_data_index_labels_from_a_json_field_with_class_names(own):
    """docs/DATA.md: `python -m data.index_shards shards/mine/ --out shards/mine.json --label_key json:label
    --classes names.txt`, names.txt (read from where the command runs) mapped to a tmp file."""
    root, runs = own
    runs["json_label"].result()
    index = _index(root / "shards" / "mine.json")
    assert (index["num_samples"], index["labeled"], index["label_key"]) == (16, True, "json:label")
    assert index["classes"] == ["cat", "dog", "eel"]


def test_own_data_unlabeled_shardwriter_shards_pretrain_mae(own):
    """Way 3: ShardWriter shards with no labels, indexed and pretrained with docs/DATA.md's two
    commands: no sample skipped, a finite loss, the encoder exported."""
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


def test_own_data_what_needs_labels_refuses_the_unlabeled_index(own):
    """docs/DATA.md's claim, for `linprobe` (which it lists), on the index way 3 wrote: its pretraining
    command with `--objective linprobe` exits 2 before start, naming the index and the fix."""
    claim = paragraph(page(DATA), NEEDS_LABELS, OWN).text
    assert claim.startswith(f"{NEEDS_LABELS} (exit 2, naming the index and the fix):") and "`linprobe`" in claim
    root, runs = own
    _, _, proc = runs["unlabeled"].result()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"the shard index {root / 'shards' / 'laion.json'} is unlabeled" in proc.stderr
    assert "python -m data.index_shards SHARDS... --out INDEX.json --label_key KEY" in proc.stderr  # the fix
    assert not (root / "runs" / "linprobe").exists()  # before start


def test_own_data_commands_are_told_apart_by_their_way_in():
    """Way 3 repeats way 2's laion index command without --workers: each is read from its own way in,
    and a command gone from way 3 fails naming the section even though way 2 still has its twin."""
    data = page(DATA)
    assert find(INDEX_FOLDER).text.endswith("--workers 32")
    way_3, train = find(INDEX_UNLABELED), find(PRETRAIN_UNLABELED)
    assert way_3.line > find(INDEX_JSON_LABEL).line and "--workers" not in way_3.text
    assert train.line == way_3.line + 1 and train.text != find(PRETRAIN).text
    gone = data.replace(f"    {way_3.text}\n", "").replace(f"    {train.text}\n", "")
    with pytest.raises(LookupError, match=r"'python -m data.index_shards' after .*'Your own data' \(docs/DATA.md:\d+\)"):
        command(gone, *INDEX_UNLABELED[1:])
    with pytest.raises(LookupError, match="words '3. Unlabeled shards -> pretraining.'"):
        command(data.replace("**3. Unlabeled shards", "**3. Shards without labels"), *INDEX_UNLABELED[1:])


def test_own_data_paths_the_test_does_not_map_are_refused():
    cmd = find(WRITE_FOLDER)
    with pytest.raises(ValueError, match=rf"docs/DATA.md:{cmd.line}: the test maps no folder for \['/data/pets'\]"):
        cmd.argv({"shards/pets": REPO / "x"})
