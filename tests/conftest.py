import gzip
import io
import json
import os
import struct
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from ports import free_port
import report_text

REPO = Path(__file__).resolve().parent.parent
# The code runs from the repository root and is not installed (pyproject.toml): pytest puts the
# root on sys.path (pythonpath), and every process a test starts (python train/X.py, the deepspeed
# launcher's ranks, python -c) finds it through PYTHONPATH.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
DEBUG_PRESET = REPO / "train" / "configs" / "mae/debug.json"
CPU_DS = REPO / "ds_configs" / "cpu_debug.json"


PROCESS_GROUP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def process_group_of_its_own():
    """A training command run in this process starts a process group of one and writes who it is
    into the environment (train/engine/distributed.py init): both end here, so a later child process
    neither inherits the rank nor the port of a store this process may still hold."""
    saved = {k: os.environ.get(k) for k in PROCESS_GROUP_ENV}
    try:
        yield
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """Every test: what its in-process runs started ends with it (module-scoped fixtures that run
    a command in this process use process_group_of_its_own themselves)."""
    with process_group_of_its_own():
        yield


# The files that take longest (minutes: real processes, ranks, Slurm jobs), longest first. `make test`
# hands whole files to its workers in collection order (--no-loadscope-reorder), and files started
# last set the suite's end: these go first, the many short files fill in after them.
LONGEST_FILES = [
    "launchers/test_real_slurm.py", "distributed/test_engines.py", "distributed/test_world_size_change.py",
    "tools/test_gpu_check.py", "faults/test_interrupt.py", "faults/test_nonfinite.py", "train/test_pretrain.py",
    "train/engine/test_compile.py", "train/run/test_run_lock.py", "test_readme_commands.py",
    "train/run/test_resume_changes.py", "faults/test_misconfiguration.py", "model/objectives/test_energy.py",
    "train/test_linprobe_cpu_recipe.py", "faults/test_rank_crash_resume.py", "launchers/test_slurm.py",
]


pytest_runtest_makereport = report_text.pytest_runtest_makereport  # a hook: reports that xdist can send


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(Path(item.path).relative_to(REPO / "tests").as_posix(), len(rank)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_pretrain(out_dir: Path, *args: str, ranks: int = 1, ds_config: Path = CPU_DS, check: bool = True,
                 faults: str = ""):
    """Run train/pretrain.py as a real process (1 rank: python; >1: the deepspeed launcher);
    `faults` arms train/engine/fault_injection.py in it."""
    opts = ["--ds_config", str(ds_config), "--config", str(DEBUG_PRESET), "--output_dir", str(out_dir),
            "--run.progress", "false", *args]
    script = str(REPO / "train" / "pretrain.py")
    if ranks == 1:
        cmd = [sys.executable, script, *opts]
    else:
        launcher = str(Path(sys.executable).parent / "deepspeed")
        cmd = [launcher, "--num_gpus", str(ranks), "--master_port", str(free_port()), script, *opts]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PRETRAIN_FAULTS": faults}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


# The end of a child process that ran training commands in turn (their process groups left alive by
# main()): the group ends, then the process leaves as the scripts do (train/run/cli.py), without the
# interpreter's teardown, where what gloo leaves behind has been seen to abort it (SIGABRT)
CHILD_EXIT = ("from train.run.cli import end_process_group, leave_before_teardown\n"
              "end_process_group()\nleave_before_teardown(0)\n")


def run_pretrain_calls(calls: list[list[str]]) -> subprocess.CompletedProcess:
    """Several train/pretrain.py runs (argv lists) in one Python process: the start-up is paid once."""
    code = "import json, sys\nfrom train.pretrain import main\nfor argv in json.loads(sys.argv[1]):\n    main(argv)\n" + CHILD_EXIT
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(calls)], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def save_module_state(tag: Path, state: dict) -> None:
    """A checkpoint tag's module files (train/engine/state_files.py) holding `state` (an objective's
    state_dict): its tensors in model.safetensors, its non-tensor extra states in state.pt."""
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)},
              tag / "model.safetensors")
    torch.save({"extra": {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}}, tag / "state.pt")


def run_ranks(ranks: int, script: Path, *args: str, timeout: int = 600) -> None:
    """`python script args` as `ranks` processes of one gloo process group (the environment
    torchrun and the deepspeed launcher set: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR / PORT),
    without a launcher's start-up; every rank must exit 0. The first rank that fails ends the
    others (they would wait for it until the store's timeout), and a failure or a timeout shows
    every rank's output."""
    port = str(free_port())
    procs, logs = [], []
    try:
        for rank in range(ranks):
            env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "RANK": str(rank),
                   "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            logs.append(tempfile.TemporaryFile("w+"))
            procs.append(subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, env=env, text=True,
                                          stdout=logs[-1], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if None not in codes or any(codes):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    state = [f"rank {r}: " + ("killed" if p.returncode == -signal.SIGKILL else f"exit {p.returncode}")
             for r, p in enumerate(procs)]
    assert all(p.returncode == 0 for p in procs), (f"{'; '.join(state)} (timeout {timeout} s, port {port}):\n"
                                                   + "\n".join(f"--- rank {r}\n{o[-4000:]}" for r, o in enumerate(outputs)))


def png_bytes(value: int, size=(12, 10), mode="L") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full(size[::-1], value, dtype=np.uint8), mode="L").convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def write_idx(path: Path, array: np.ndarray) -> None:
    """An MNIST-style idx file of unsigned bytes, gzipped as the Debian package ships them."""
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def fake_fashion_mnist(src: Path, train: int, test: int) -> Path:
    """The four Fashion-MNIST idx files with `train` / `test` random 28x28 images (labels i % 10),
    for `data.write_shards fashion-mnist --src src` without the 70k-image Debian package."""
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", train), ("t10k", test)):
        write_idx(src / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(src / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    return src


@pytest.fixture
def image_folder(tmp_path):
    """3 classes x 8 images; pixel value encodes (class, index) so samples can be identified."""
    root = tmp_path / "folder"
    for c, name in enumerate(["cat", "dog", "eel"]):
        (root / name).mkdir(parents=True)
        for i in range(8):
            value = c * 50 + i * 5
            if i % 2:
                (root / name / f"{i}.png").write_bytes(png_bytes(value))
            else:
                Image.fromarray(np.full((10, 12, 3), value, dtype=np.uint8)).save(root / name / f"{i}.jpg", quality=100)
    return root


@pytest.fixture
def rgb_shards(tmp_path, image_folder):
    """image_folder written as 6 RGB shards of 4 samples; the index's path."""
    from data.write_shards import main as write_shards

    [index] = write_shards(["imagefolder", str(image_folder), str(tmp_path / "shards"), "--samples_per_shard", "4"])
    return tmp_path / "shards" / f"{index['name']}.json"


@pytest.fixture
def rgb_test_shards(tmp_path, image_folder):
    """image_folder's images again, in shards of their own beside rgb_shards': a held-out index (an
    evaluation may not score the training shards, data/shard_index.py check_held_out)."""
    from data.write_shards import main as write_shards

    [index] = write_shards(["imagefolder", str(image_folder), str(tmp_path / "shards"), "--samples_per_shard", "4",
                            "--name", "test"])
    return tmp_path / "shards" / f"{index['name']}.json"


# A fake ImageNet (tests/data/test_write_shards.py, tests/test_readme_commands.py): wnids created out of
# order, so that sorting them (timm / torchvision's class order) matters
WNIDS = ["n02102040", "n01440764", "n01443537"]


def write_jpeg(path: Path, value: int) -> None:
    """A 16x16 RGB JPEG of one pixel value."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((16, 16, 3), value, dtype=np.uint8)).save(path, quality=100)


def wnid_value(wnid: str) -> int:
    """The pixel value of a wnid's images: identifies the class after a round trip."""
    return 40 + 60 * WNIDS.index(wnid)


def fake_imagenet(root, val="folders", per_class=3, val_per_class=2):
    """ROOT/train/<wnid>/<wnid>_<i>.JPEG, and val/<wnid>/ folders or a flat val/ with the Kaggle
    release's LOC_val_solution.csv three folders above ROOT (root = ILSVRC/Data/CLS-LOC)."""
    for w in WNIDS:
        for i in range(per_class):
            write_jpeg(root / "train" / w / f"{w}_{i}.JPEG", wnid_value(w))
    rows, k = ["ImageId,PredictionString"], 0
    for w in WNIDS:
        for _ in range(val_per_class):
            k += 1
            image_id = f"ILSVRC2012_val_{k:08d}"
            if val == "folders":
                write_jpeg(root / "val" / w / f"{image_id}.JPEG", wnid_value(w))
            else:
                write_jpeg(root / "val" / f"{image_id}.JPEG", wnid_value(w))
                rows.append(f"{image_id},{w} 1 2 10 12 {w} 0 0 5 5")
    rows.append(f"ILSVRC2012_val_{k + 1:08d},{WNIDS[0]} 1 2 3 4")  # listed, image absent: a partial copy
    if val == "flat":
        (root.parents[2] / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    return root
