import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
# The code runs from the repository root and is not installed (pyproject.toml): pytest puts the
# root on sys.path (pythonpath), and every process a test starts (python train/X.py, the deepspeed
# launcher's ranks, python -c) finds it through PYTHONPATH.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
DEBUG_PRESET = REPO / "train" / "configs" / "mae/debug.json"
CPU_DS = REPO / "ds_configs" / "cpu_debug.json"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_pretrain(out_dir: Path, *args: str, ranks: int = 1, ds_config: Path = CPU_DS, check: bool = True,
                 faults: str = ""):
    """Run train/pretrain.py as a real process (1 rank: python; >1: the deepspeed launcher);
    `faults` arms train/fault_injection.py in it."""
    opts = ["--ds_config", str(ds_config), "--config", str(DEBUG_PRESET), "--output_dir", str(out_dir),
            "--run.progress", "false", *args]
    script = str(REPO / "train" / "pretrain.py")
    if ranks == 1:
        cmd = [sys.executable, script, *opts]
    else:
        launcher = str(Path(sys.executable).parent / "deepspeed")
        cmd = [launcher, "--num_gpus", str(ranks), "--master_port", str(_free_port()), script, *opts]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PRETRAIN_FAULTS": faults}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_pretrain_calls(calls: list[list[str]]) -> subprocess.CompletedProcess:
    """Several train/pretrain.py runs (argv lists) in one Python process: the start-up is paid once."""
    code = "import json, sys\nfrom train.pretrain import main\nfor argv in json.loads(sys.argv[1]):\n    main(argv)\n"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(calls)], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png_bytes(value: int, size=(12, 10), mode="L") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full(size[::-1], value, dtype=np.uint8), mode="L").convert(mode).save(buf, format="PNG")
    return buf.getvalue()


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
