"""Time every SDPA kernel on the attention shapes of the given runs, on this machine's GPU, and
record the fastest for each shape in the table the `sdpa` backend reads (kernels/attention_choice.py).

    python -m tools.choose_attention [--config PRESET ...] [--model NAME ...] [--micro 128] [--dtype bf16]
                                     [--write | --table FILE] [--iters 20]

The shapes are those the runs' blocks attend over (train/estimate/costs.py, on the meta device: an
encoder's visible tokens, a decoder's full sequence), for every preset x model given (default: MAE
and MAE+ (multi-crop) on ViT-B/16 and ViT-L/16 at 224). Each kernel (flash, cuDNN,
memory-efficient, math) and PyTorch's own pick run forward + backward at the micro-batch; a kernel
is recorded only if it beats PyTorch's pick by 3% (kernels/attention_choice.py MARGIN), else the
entry says PyTorch's pick was measured fastest. Prints a table; `--write` merges the entries into
kernels/attention_choices.json (the committed table; `--table FILE`: another file), replacing
those of the same capability, dtype and shape. On CPU (tests): `--device cpu`.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import json
import platform
import sys
from pathlib import Path

import torch

from data.cli import Parser, refuse, refusing
from data.outputs import written_whole
from kernels import attention_choice
from kernels.bench import commit
from train.config.ds_config import resolve
from train.config.errors import ConfigError
from train.config.options import parse_args
from train.estimate.costs import attention_shapes, profile_config

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = ("defaults", "train/configs/maeplus/vit_b.json")  # "defaults": MAE with the options' defaults
SHAPES_DS = REPO / "ds_configs" / "vit_b_8xh100_bf16_zero1.json"  # shapes depend on the micro-batch alone, given here
DEFAULT_MODELS = ("vit_base_patch16", "vit_large_patch16")


def shapes_of(config: str, model: str | None, micro: int) -> list[tuple[int, int, int]]:
    """(heads, tokens, head dim) of every block call of one micro-batch of the run."""
    argv = ["--ds_config", str(SHAPES_DS), "--data.source", "synthetic", *(["--config", config] if config != "defaults" else []),
            *(["--model.name", model] if model else [])]
    cfg = parse_args(argv)
    ds, _ = resolve(cfg, 1)
    _, prof = profile_config(cfg, ds, micro, fused_kernels=True)
    return attention_shapes(prof)


def main(argv: list[str] | None = None) -> list[attention_choice.Choice]:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", nargs="+", default=list(DEFAULT_CONFIGS), help="presets whose shapes are timed ('defaults': the options' own)")
    p.add_argument("--model", nargs="+", default=list(DEFAULT_MODELS), help="--model.name of each run")
    p.add_argument("--micro", type=int, default=128, help="the micro-batch the kernels are timed at")
    p.add_argument("--dtype", choices=sorted(attention_choice.DTYPES), default="bf16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--iters", type=int, default=20)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--write", action="store_true", help="merge into kernels/attention_choices.json")
    where.add_argument("--table", type=Path, help="merge into this table file instead")
    a = p.parse_args(argv)
    if a.micro < 1 or a.iters < 1:
        refuse(f"--micro and --iters must be >= 1, got {a.micro} and {a.iters}")
    if a.device == "cuda" and not torch.cuda.is_available():
        refuse("tools.choose_attention times a GPU's kernels and this machine has no CUDA device "
               "(--device cpu times the CPU's)")
    device = torch.device(a.device)
    dtype = attention_choice.DTYPES[a.dtype]
    shapes = sorted({s for config in a.config for model in a.model for s in shapes_of(config, model, a.micro)})
    measured = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
                or "cpu", "torch": torch.__version__, "commit": commit(), "batch": a.micro}
    capability = attention_choice.capability_of(device)
    choices = []
    print(f"{'heads x tokens x dim':>22}  " + "  ".join(f"{k:>9}" for k in attention_choice.KERNELS) + "  chosen")
    for heads, tokens, head_dim in shapes:
        ms = attention_choice.time_kernels(a.micro, heads, tokens, head_dim, dtype, device, a.iters)
        kernel = attention_choice.choose(ms)
        choices.append(attention_choice.Choice(capability, a.dtype, heads, tokens, head_dim, kernel,
                                               {**measured, "ms": ms}))
        cells = "  ".join(f"{v:9.3f}" if isinstance(v, float) else f"{'-':>9}" for v in ms.values())
        print(f"{f'{heads}x{tokens}x{head_dim}':>22}  {cells}  {kernel}")
    table = attention_choice.TABLE if a.write else a.table
    if table is not None:
        old = attention_choice.load(table) if table.exists() else []
        with written_whole(table) as tmp:
            tmp.write_text(json.dumps(attention_choice.merged(old, choices), indent=1) + "\n")
        print(f"wrote {len(choices)} entries into {table}")
    return choices


if __name__ == "__main__":
    refusing(lambda: main(sys.argv[1:]), (ConfigError, ValueError))
