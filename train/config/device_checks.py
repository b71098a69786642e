"""What this machine's GPU and torch build can run, decided before any process group starts.

train/config/ds_config.py `resolve` asks `this_device()` and refuses (ConfigError: exit 2 with the problem
and the fix), beside its other precision checks:

- `check_kernels`: the torch build has no kernels for the GPU. torch.cuda.get_arch_list() names
  what the wheel was compiled for; the CUDA 13 wheels that PyPI serves (torch 2.14: sm_75 ...
  sm_120) have none for a V100 (sm_70), which then fails at its first kernel launch ("no kernel
  image is available for execution on the device"). torch itself only warns, once, at CUDA
  initialisation.
- bf16 on a GPU without bf16 arithmetic (compute capability < 8.0): `CudaDevice.native_bf16`.
  torch.cuda.is_bf16_supported() counts emulation and says True on a V100; we ask it with
  including_emulation=False.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from train.config.errors import ConfigError

# PyTorch's own wheel index for the CUDA 12.6 builds: torch's release table
# (torch.cuda.PYTORCH_RELEASES_CODE_CC in torch 2.14) lists sm_50 ... sm_90 for them on x86_64,
# sm_70 (V100) included; its CUDA 13.x builds start at sm_75.
CU126_INDEX = "https://download.pytorch.org/whl/cu126"


@dataclass(frozen=True)
class CudaDevice:
    name: str  # torch.cuda.get_device_name(), e.g. "Tesla V100-SXM2-32GB"
    capability: tuple[int, int]  # (major, minor), e.g. (7, 0)
    arch_list: tuple[str, ...]  # the torch build's targets, e.g. ("sm_75", "sm_80", ..., "compute_120")
    native_bf16: bool  # bf16 arithmetic in hardware (sm80+), emulation not counted

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


def this_device() -> CudaDevice | None:
    """The current CUDA device as torch sees it (before distributed.init every rank's current
    device is GPU 0 of its node); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return CudaDevice(name=torch.cuda.get_device_name(), capability=(major, minor),
                      arch_list=tuple(torch.cuda.get_arch_list()),
                      native_bf16=torch.cuda.is_bf16_supported(including_emulation=False))


_ARCH = re.compile(r"(sm|compute)_(\d+)(\d)([af]?)")  # sm_90a -> ("sm", "9", "0", "a"); sm_120 -> ("sm", "12", "0", "")


def runs_on(arch: str, capability: tuple[int, int]) -> bool | None:
    """Whether code built for one arch-list entry runs on a GPU of `capability` (None: not a CUDA
    target this function knows, e.g. a ROCm gfx name).

    sm_XY is a cubin (machine code): it runs on GPUs of the same major and minor >= Y (CUDA's
    binary compatibility; sm_80 runs on 8.6 and 8.9, but no cubin crosses a major: sm_75 does not
    run on 7.0). compute_XY is PTX, which the driver JIT-compiles for any GPU of capability >= X.Y,
    newer majors included (slow first start; the driver must be at least as new as the toolkit).
    The suffix `a` (sm_90a: architecture-specific instructions) runs on X.Y only; `f` (sm_100f:
    family-specific) like a plain cubin. Integrated (Jetson) parts such as 7.2 or 8.7 are not
    training targets here and are not special-cased.
    """
    m = _ARCH.fullmatch(arch)
    if m is None:
        return None
    kind, major, minor, suffix = m[1], int(m[2]), int(m[3]), m[4]
    if suffix == "a":
        return capability == (major, minor)
    if kind == "compute":
        return capability >= (major, minor)
    return capability[0] == major and capability[1] >= minor


def kernels_cover(device: CudaDevice) -> bool:
    """True when some entry of the build's arch list runs on the device; also True when the list
    says nothing we can read (empty, or no CUDA targets): then we cannot tell and do not refuse."""
    verdicts = [runs_on(arch, device.capability) for arch in device.arch_list]
    known = [v for v in verdicts if v is not None]
    return not known or any(known)


def install_hint(device: CudaDevice) -> str:
    """How to get a torch build with kernels for this GPU."""
    if device.capability < (7, 5):  # V100 (7.0) and older: only the CUDA 12.x builds still ship kernels
        return (f"install a torch build that ships {device.sm} kernels, a CUDA 12.6 build from PyTorch's own "
                f"wheel index: rm -rf .venv && make install TORCH_INDEX={CU126_INDEX} (or pip install torch "
                f"torchvision --index-url {CU126_INDEX}); docs/GPU.md explains")
    return (f"install a torch build whose arch list covers {device.sm} (https://pytorch.org/get-started/locally/), "
            f"e.g. make install TORCH_INDEX=https://download.pytorch.org/whl/<cuda tag>; docs/GPU.md explains")


def check_kernels(device: CudaDevice) -> None:
    """Refuse a GPU the installed torch build has no kernels for."""
    if torch.version.hip or kernels_cover(device):
        return
    raise ConfigError(
        f"the installed torch {torch.__version__} (CUDA {torch.version.cuda}) has no kernels for this GPU, "
        f"{device.name} (compute capability {device.capability[0]}.{device.capability[1]}, {device.sm}): its arch "
        f"list is {' '.join(device.arch_list)} (an sm_XY cubin runs only on X.Y and later minors of major X, "
        f"compute_XY PTX on X.Y and later). Every kernel launch would fail; {install_hint(device)}")

