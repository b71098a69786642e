"""The fused Triton kernels against the PyTorch references on CPU, in Triton's interpreter.

Triton decides interpreted vs compiled when it is first imported, so the checks
(triton_interpreted_checks.py) run with pytest in a fresh process with TRITON_INTERPRET=1 and no
visible GPU. The compiled kernels are checked in test_restricted_triton_gpu.py."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
CHECKS = Path(__file__).with_name("triton_interpreted_checks.py")


def test_triton_kernels_match_references_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CHECKS)],
                          cwd=CHECKS.parents[2], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == 6 and "skipped" not in proc.stdout, proc.stdout[-2000:]
