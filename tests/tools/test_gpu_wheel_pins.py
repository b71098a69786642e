"""`make gpu-wheels` downloads, for a GPU machine without network access, the packages it lacks at the
versions this venv runs: `make gpu-wheel-pins` writes those pins. Each is the installed version, also
for a package installed from a wheel file (for which `pip freeze` writes `name @ file://...`, which
the pins once missed, dropping torchao and with it run.float8 from the kit)."""
import shutil
import subprocess
from importlib.metadata import version

import pytest
from conftest import REPO

KIT = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "webdataset", "braceexpand", "hjson",
       "torchao"]  # deepspeed is built from its source distribution instead
FLASH_ATTN_4 = ["flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
                "nvidia-cutlass-dsl-libs-cu12", "apache-tvm-ffi", "torch-c-dlpack-ext", "quack-kernels"]


def pins(*variables: str) -> dict[str, str]:
    out = subprocess.run(["make", "-s", "--no-print-directory", "gpu-wheel-pins", *variables], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return dict(line.lower().split("==") for line in out.split())


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_every_kit_package_is_pinned_at_the_installed_version():
    assert pins() == {name: version(name) for name in KIT}
    assert pins("FLASH_ATTN_4=1") == {name: version(name) for name in KIT + FLASH_ATTN_4}
