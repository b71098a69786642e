"""Which of SDPA's kernels runs dense attention of each shape: the one measured fastest there.

PyTorch's `scaled_dot_product_attention` picks its kernel (flash, cuDNN, memory-efficient, math)
by rules that do not look at speed for the shape at hand. `python -m tools.choose_attention`
times every kernel that takes a shape, forward + backward, on the GPU it runs on and records the
fastest in kernels/attention_choices.json, keyed by compute capability, dtype and the attention's
(heads, tokens, head dim); the batch it was measured at is recorded, not matched. `activate(device)`
(the engine's build calls it) loads the entries of the device's compute capability, and the `sdpa`
backend (kernels/attention.py) then runs each listed shape under `torch.nn.attention.sdpa_kernel`
with its kernel; a shape the table does not list keeps PyTorch's own pick. The choice is one dict
lookup with the shape's ints, so compiled blocks trace it into the graph with no break.

Beside SDPA's kernels, flash-attn-4 (kernels/flash_attn4.py) is timed where it is installed and
the GPU can train with it, and recorded as "flash_attn4" where it is the fastest. An entry naming
it on a machine without it (or on a GPU it does not train on) is set aside at `activate`, with the
reason (`set_aside_warnings`): those shapes keep PyTorch's pick.

TopK attention (MixedAE's homologous blocks) has two GPU paths over one kept set
(kernels/restricted_triton.py): the fused kernels ("fused"), or the threshold kernel writing the
kept set as a mask and SDPA attending under it ("masked_sdpa"). Entries with `"attention": "topk"`
record which was measured faster for a shape; an unlisted shape runs the fused kernels.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.flash_attn4 import NAME as FLASH_ATTN_4
from kernels.flash_attn4 import attention as flash_attn4_attention
from kernels.flash_attn4 import refusal as flash_attn4_refusal
from kernels.flash_attn4 import unavailable as flash_attn4_unavailable

TABLE = Path(__file__).with_name("attention_choices.json")
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH,
           "pytorch": None}  # measured, and none beat PyTorch's own pick by MARGIN: it keeps choosing
PACKAGE_KERNELS = (FLASH_ATTN_4,)  # dense kernels of optional packages, outside SDPA
TOPK_KERNELS = ("fused", "masked_sdpa")  # the first is the default of an unlisted shape
ATTENTIONS = {"dense": (*KERNELS, *PACKAGE_KERNELS), "topk": TOPK_KERNELS}  # each kind of attention call: its kernel names
MARGIN = 0.03  # a kernel replaces the default only when this much faster (timings of one call differ ~1%)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
SHAPE_KEYS = ("heads", "tokens", "head_dim")


@dataclass(frozen=True)
class Choice:
    """One measured shape: on GPUs of `capability` ("9.0"; "cpu" for CPU runs), `attention` ("dense",
    or "topk" for TopK-restricted calls) of `heads` x `tokens` x `head_dim` in `dtype` runs `kernel`."""
    capability: str
    dtype: str
    attention: str
    heads: int
    tokens: int
    head_dim: int
    kernel: str
    measured: dict  # device, torch, commit, batch, milliseconds per kernel (what the choice rests on)

    @property
    def key(self) -> tuple[str, str, str, int, int, int]:
        return self.capability, self.dtype, self.attention, self.heads, self.tokens, self.head_dim


# The active choices: (dtype, heads, tokens, head dim) -> kernel (an SDPA kernel; None: PyTorch's,
# measured; or a PACKAGE_KERNELS name), for the device `activate` was given.
_ACTIVE: dict[tuple[torch.dtype, int, int, int], SDPBackend | str | None] = {}
_SET_ASIDE: dict[tuple[int, int, int], str] = {}  # (heads, tokens, head dim) -> why its entry's kernel cannot run here
_ACTIVE_TOPK: dict[tuple[torch.dtype, int, int, int], str] = {}  # the same key -> a TOPK_KERNELS name


def capability_of(device: torch.device) -> str:
    """The table's key for `device`: its compute capability "major.minor", or "cpu"."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{major}.{minor}"
    return device.type


def load(path: Path | None = None) -> list[Choice]:
    """The table's (default TABLE) entries, each field checked: a file that is not this schema is refused with
    where and what (a JSON file is data: nothing in it runs)."""
    path = TABLE if path is None else path

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: {what}; the file is written by `python -m tools.choose_attention --write` "
                          f"(delete the entry, or the file for PyTorch's own choice everywhere)")

    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise bad(f"cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise bad(f"is not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:  # json's error for arrays/objects nested past the interpreter's recursion limit
        raise bad("is nested too deep to be read as JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise bad('the top level must be an object with an "entries" list')
    out, seen = [], set()
    for i, entry in enumerate(data["entries"]):
        where = f"entry {i}"
        if not isinstance(entry, dict):
            raise bad(f"{where} is {type(entry).__name__}, not an object")
        fields = {"capability", "dtype", "attention", *SHAPE_KEYS, "kernel", "measured"}
        if set(entry) != fields:
            raise bad(f"{where} has fields {sorted(entry)}; it must have exactly {sorted(fields)}")
        cap = entry["capability"]
        if not isinstance(cap, str) or not (cap == "cpu" or re.fullmatch(r"\d{1,2}\.\d", cap)):
            raise bad(f'{where}: capability {cap!r} is neither "major.minor" (e.g. "9.0") nor "cpu"')
        if not isinstance(entry["dtype"], str) or entry["dtype"] not in DTYPES:  # a list or an object is no key
            raise bad(f"{where}: dtype {entry['dtype']!r} is not one of {sorted(DTYPES)}")
        for k in SHAPE_KEYS:
            v = entry[k]
            if type(v) is not int or not 1 <= v <= 1 << 20:
                raise bad(f"{where}: {k} {v!r} is not an integer in [1, 2^20]")
        if not isinstance(entry["attention"], str) or entry["attention"] not in ATTENTIONS:
            raise bad(f"{where}: attention {entry['attention']!r} is not one of {sorted(ATTENTIONS)}")
        kernels = ATTENTIONS[entry["attention"]]
        if not isinstance(entry["kernel"], str) or entry["kernel"] not in kernels:
            raise bad(f"{where}: kernel {entry['kernel']!r} is not one of {sorted(kernels)} "
                      f"(for {entry['attention']} attention)")
        if not isinstance(entry["measured"], dict):
            raise bad(f"{where}: measured must be an object (what the choice rests on)")
        choice = Choice(**entry)
        if choice.key in seen:
            raise bad(f"{where} repeats capability {cap}, dtype {choice.dtype}, {choice.attention} attention, shape "
                      f"{choice.heads}x{choice.tokens}x{choice.head_dim}")
        seen.add(choice.key)
        out.append(choice)
    return out


def activate(device: torch.device, path: Path | None = None) -> int:
    """Make the table's choices for `device`'s compute capability the ones `kernel_for` returns
    (replacing any earlier ones); the number of shapes. No file: PyTorch's pick everywhere."""
    deactivate()
    path = TABLE if path is None else path
    if not path.exists():
        return 0
    cap = capability_of(device)
    gpu = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    for c in load(path):
        if c.capability == cap:
            shape = (DTYPES[c.dtype], c.heads, c.tokens, c.head_dim)
            if c.attention == "topk":
                _ACTIVE_TOPK[shape] = c.kernel
            elif c.kernel in PACKAGE_KERNELS:
                reason = flash_attn4_unavailable(gpu)
                if reason is None:
                    _ACTIVE[shape] = c.kernel
                else:
                    _SET_ASIDE[(c.dtype, c.heads, c.tokens, c.head_dim)] = f"{c.kernel}: {reason}"
            else:
                _ACTIVE[shape] = KERNELS[c.kernel]
    return len(_ACTIVE) + len(_ACTIVE_TOPK)


def set_aside_warnings() -> list[str]:
    """One line for the run's log per shape whose measured kernel cannot run here since the last
    `activate`, with why."""
    return [f"attention {dtype} {h}x{t}x{d}: its measured kernel cannot run here ({why}); PyTorch's pick runs it"
            for (dtype, h, t, d), why in sorted(_SET_ASIDE.items())]


def deactivate() -> None:
    _ACTIVE.clear()
    _ACTIVE_TOPK.clear()
    _SET_ASIDE.clear()


def kernel_for(q: torch.Tensor) -> SDPBackend | str | None:
    """The kernel chosen for q's (B, H, N, d) shape and dtype: an SDPA kernel, a PACKAGE_KERNELS
    name, or None: PyTorch picks."""
    if not _ACTIVE:
        return None
    _, heads, tokens, head_dim = q.shape
    return _ACTIVE.get((q.dtype, heads, tokens, head_dim))


def topk_kernel_for(q: torch.Tensor) -> str:
    """The TopK path chosen for q's (B, H, N, d) shape and dtype (TOPK_KERNELS; unlisted: "fused")."""
    _, heads, tokens, head_dim = q.shape
    return _ACTIVE_TOPK.get((q.dtype, heads, tokens, head_dim), TOPK_KERNELS[0])


def topk_masked_shapes(dtype: torch.dtype, tokens: int, head_dim: int) -> list[int]:
    """The head counts for which the active table runs TopK of this dtype, tokens and head dim
    through SDPA under a mask."""
    return sorted(h for (dt, h, t, d), kernel in _ACTIVE_TOPK.items()
                  if (dt, t, d) == (dtype, tokens, head_dim) and kernel == "masked_sdpa")


def describe(chosen: dict[tuple[int, int, int], str], shapes: list[tuple[int, int, int]]) -> str:
    """"H x N x d kernel" for each shape, from `choices_for`'s answer."""
    def said(shape: tuple[int, int, int]) -> str:
        if shape not in chosen:
            return "PyTorch's pick (not measured)"
        if chosen[shape] in PACKAGE_KERNELS:
            return f"{chosen[shape]} (measured fastest; where it is not installed, PyTorch's pick)"
        return "PyTorch's pick (measured fastest)" if chosen[shape] == "pytorch" else f"{chosen[shape]} (measured fastest)"

    return "; ".join(f"{h}x{t}x{d} {said((h, t, d))}" for h, t, d in shapes)


def choices_for(capability: str, dtype: torch.dtype, path: Path | None = None) -> dict[tuple[int, int, int], str]:
    """{(heads, tokens, head dim): kernel} the table holds for a capability and dtype, read without
    activating (the dry run speaks of a GPU it does not run on)."""
    path = TABLE if path is None else path
    if not path.exists():
        return {}
    name = DTYPE_NAMES.get(dtype)
    return {(c.heads, c.tokens, c.head_dim): c.kernel for c in load(path) if c.capability == capability
            and c.dtype == name and c.attention == "dense"}


def merged(old: list[Choice], new: list[Choice]) -> dict:
    """The table's JSON with `new` replacing the entries of the same key in `old`."""
    by_key = {c.key: c for c in old}
    by_key.update({c.key: c for c in new})
    entries = [vars(c) for c in sorted(by_key.values(), key=lambda c: c.key)]
    return {"entries": entries}


def time_kernels(batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 iters: int = 20, warmup: int = 3) -> dict[str, float | str]:
    """Milliseconds of one forward + backward of dense attention on random (batch, heads, tokens,
    head_dim) inputs: SDPA under PyTorch's pick ("pytorch") and under each of its kernels, and
    flash-attn-4; a kernel that does not take the inputs gets the reason instead of a time."""
    import time
    import warnings

    q, k, v = (torch.randn(batch, heads, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(batch, heads, tokens, head_dim, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def sdpa(kernel: SDPBackend | None):
        def run() -> torch.Tensor:
            if kernel is None:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
            with sdpa_kernel(kernel):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return run

    runs = {name: sdpa(kernel) for name, kernel in KERNELS.items()}
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    out: dict[str, float | str] = {}
    if (reason := flash_attn4_refusal(q, k, v, capability)) is None:
        runs[FLASH_ATTN_4] = lambda: flash_attn4_attention(q, k, v)
    else:
        out[FLASH_ATTN_4] = f"not available: {reason}"

    def timed(run: Callable[[], torch.Tensor]) -> float:
        def once() -> None:
            torch.autograd.grad(run(), (q, k, v), grad)
        with warnings.catch_warnings():  # PyTorch warns why each kernel it was told to use cannot run
            warnings.simplefilter("ignore")
            for _ in range(warmup):  # flash-attn-4 compiles the shape's kernels in the first
                once()
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            once()
        sync()
        return (time.perf_counter() - start) / iters * 1e3

    for name, run in runs.items():
        out[name] = ms_or_reason(lambda run=run: timed(run))
    return {name: out[name] for name in ATTENTIONS["dense"]}


def ms_or_reason(timed: Callable[[], float]) -> float | str:
    """One candidate kernel's milliseconds, or why it did not run: a failing kernel must not lose the
    others' times. PyTorch's refusals are RuntimeErrors ("No available kernel", with the reasons it
    warned about); flash-attn-4's are CUTLASS DSL errors and asserts, named by their type."""
    try:
        return timed()
    except RuntimeError as e:
        return f"not available: {_first_line(e)}"
    except Exception as e:  # noqa: BLE001 - any failure of one kernel; KeyboardInterrupt still stops the tool
        return f"not available: {type(e).__name__}: {_first_line(e)}"


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [""])[0][:160]


def choose(ms: dict[str, float | str], default: str = "pytorch") -> str:
    """The kernel a table entry records for these timings: the fastest, if it beats the default's
    (PyTorch's pick for dense attention, "fused" for TopK) by MARGIN, else the default."""
    timed = {k: v for k, v in ms.items() if isinstance(v, float)}
    if default not in timed:
        raise ValueError(f"the default kernel {default!r} did not run ({ms.get(default)}): nothing to compare against")
    best = min((k for k in timed if k != default), key=timed.__getitem__, default=default)
    return best if timed.get(best, float("inf")) < (1 - MARGIN) * timed[default] else default

