"""Time every attention kernel on the attention shapes of the given runs, on this machine's GPU, and
record the fastest for each shape in the table the `sdpa` backend reads (kernels/attention_choice.py).

    python -m tools.choose_attention [--config PRESET ...] [--model NAME ...] [--micro 128] [--dtype bf16]
                                     [--write | --table FILE] [--iters 20]

The shapes are those the runs' blocks attend over (train/estimate/costs.py, on the meta device: an
encoder's visible tokens, a decoder's full sequence), for every preset x model given (default: MAE
and MAE+ (multi-crop) on ViT-B/16 and ViT-L/16 at 224). Each kernel (SDPA's flash, cuDNN,
memory-efficient and math; flash-attn-4 where it is installed and trains on this GPU) and
PyTorch's own pick run forward + backward at the micro-batch; a kernel is recorded only if it
beats PyTorch's pick by 3% (kernels/attention_choice.py MARGIN), else the
entry says PyTorch's pick was measured fastest. Then TopK attention at the shapes of the
`--topk_config` presets (default MixedAE's ViT-B preset, on every --model): the fused kernels
against the threshold kernel + SDPA under the kept set as a mask, at the encoder's batch of mixed
images (micro-batch / g) and the preset's K, each recorded as an entry with "attention": "topk"
(the fused kernels unless the other path is 3% faster; a GPU with Triton only). Prints a table;
`--write` merges the entries into kernels/attention_choices.json (the committed table; `--table
FILE`: another file), replacing those of the same capability, dtype and shape. On CPU (tests):
`--device cpu`.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import json
import platform
import sys
import time
from pathlib import Path

import torch

from data.cli import Parser, refuse, refusing
from data.outputs import written_whole
from kernels import attention_choice
from kernels.attention import _fused_reason
from kernels.bench import commit
from train.config.ds_config import resolve
from train.config.errors import ConfigError
from train.config.parsing import parse_args
from train.estimate.costs import attention_shapes, profile_config

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = ("defaults", "train/configs/maeplus/vit_b.json")  # "defaults": MAE with the options' defaults
SHAPES_DS = REPO / "ds_configs" / "vit_b_8xh100_bf16_zero1.json"  # shapes depend on the micro-batch alone, given here
DEFAULT_MODELS = ("vit_base_patch16", "vit_large_patch16")
DEFAULT_TOPK_CONFIGS = ("train/configs/mixedae/vit_b.json",)


def shapes_of(config: str, model: str | None, micro: int) -> list[tuple[int, int, int]]:
    """(heads, tokens, head dim) of every block call of one micro-batch of the run."""
    argv = ["--ds_config", str(SHAPES_DS), "--data.source", "synthetic", *(["--config", config] if config != "defaults" else []),
            *(["--model.name", model] if model else [])]
    cfg = parse_args(argv)
    ds, _ = resolve(cfg, 1)
    _, prof = profile_config(cfg, ds, micro, fused_kernels=True)
    return attention_shapes(prof)


def time_topk(batch: int, heads: int, tokens: int, head_dim: int, k: int, dtype: torch.dtype,
              device: torch.device, iters: int = 20, warmup: int = 3) -> dict[str, float | str]:
    """Milliseconds of one forward + backward of TopK attention (K keys per query, the cls row
    global, segments given as MixedAE gives them) on each path of attention_choice.TOPK_KERNELS,
    on a GPU the fused kernels run on; elsewhere each path gets the reason instead of a time."""
    probe = torch.empty(batch, heads, tokens, head_dim, dtype=dtype, device=device)
    reason = _fused_reason(probe)
    if reason is not None:
        return dict.fromkeys(attention_choice.TOPK_KERNELS, f"not available: {reason}")
    from kernels.restricted_triton import topk_attention, topk_attention_masked_sdpa

    q, k_, v = (torch.randn(batch, heads, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
                for _ in range(3))
    grad = torch.randn(batch, heads, tokens, head_dim, device=device, dtype=dtype)
    k_rows = torch.full((batch, tokens), k, device=device)
    segments = torch.randint(0, 4, (batch, tokens), device=device)
    segments[:, 0] = -1
    paths = {"fused": topk_attention, "masked_sdpa": topk_attention_masked_sdpa}
    out: dict[str, float | str] = {}
    for name in attention_choice.TOPK_KERNELS:
        def once(fn=paths[name]) -> None:
            o, _ = fn(q, k_, v, k_rows, 1, segments)
            torch.autograd.grad(o, (q, k_, v), grad)

        def timed(once=once) -> float:
            for _ in range(warmup):
                once()
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(iters):
                once()
            torch.cuda.synchronize(device)
            return (time.perf_counter() - start) / iters * 1e3

        out[name] = attention_choice.ms_or_reason(timed)  # a failing path keeps the other's time
    return out


def topk_shape_of(config: str, model: str | None, micro: int) -> tuple[int, int, int, int, int]:
    """(batch, heads, tokens, head dim, K) of the TopK blocks of one MixedAE micro-batch, read off the
    objective built on the meta device: its encoder sees micro / g mixed images of every patch and
    the cls token, and keeps its `topk` keys per query."""
    from model.objectives import build_objective
    from train.config.options import section
    from train.config.plan import build_encoder

    argv = ["--ds_config", str(SHAPES_DS), "--data.source", "synthetic", "--config", config,
            *(["--model.name", model] if model else [])]
    cfg = parse_args(argv)
    if cfg.objective != "mixedae":
        raise ConfigError(f"--topk_config {config} is a {cfg.objective} preset; TopK attention is MixedAE's")
    with torch.device("meta"):
        objective = build_objective(cfg.objective, build_encoder(cfg), section(cfg))
    encoder = objective.encoder
    heads = encoder.blocks[0].attn.num_heads
    return (max(1, micro // objective.g), heads, encoder.num_patches + 1, encoder.embed_dim // heads, objective.topk)


def main(argv: list[str] | None = None) -> list[attention_choice.Choice]:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", nargs="+", default=list(DEFAULT_CONFIGS), help="presets whose shapes are timed ('defaults': the options' own)")
    p.add_argument("--model", nargs="+", default=list(DEFAULT_MODELS), help="--model.name of each run")
    p.add_argument("--topk_config", nargs="*", default=list(DEFAULT_TOPK_CONFIGS),
                   help="MixedAE presets whose TopK attention is timed (none: skip TopK)")
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
    print(f"{'heads x tokens x dim':>22}  " + "  ".join(f"{k:>11}" for k in attention_choice.ATTENTIONS["dense"]) + "  chosen")
    for heads, tokens, head_dim in shapes:
        ms = attention_choice.time_kernels(a.micro, heads, tokens, head_dim, dtype, device, a.iters)
        kernel = attention_choice.choose(ms)
        choices.append(attention_choice.Choice(capability, a.dtype, "dense", heads, tokens, head_dim, kernel,
                                               {**measured, "ms": ms}))
        cells = "  ".join(f"{v:11.3f}" if isinstance(v, float) else f"{'-':>11}" for v in ms.values())
        print(f"{f'{heads}x{tokens}x{head_dim}':>22}  {cells}  {kernel}")
    topk_shapes = sorted({topk_shape_of(config, model, a.micro) for config in a.topk_config for model in a.model})
    for batch, heads, tokens, head_dim, k in topk_shapes:
        ms = time_topk(batch, heads, tokens, head_dim, k, dtype, device, a.iters)
        ran = [name for name, v in ms.items() if isinstance(v, float)]
        if not ran:
            print(f"TopK {heads}x{tokens}x{head_dim}: {next(iter(ms.values()))}")
            continue
        # the fused kernel is the default; where it failed, the path that ran is all a run there can take
        default = attention_choice.TOPK_KERNELS[0] if attention_choice.TOPK_KERNELS[0] in ran else ran[0]
        kernel = attention_choice.choose(ms, default=default)
        choices.append(attention_choice.Choice(capability, a.dtype, "topk", heads, tokens, head_dim, kernel,
                                               {**measured, "batch": batch, "k": k, "ms": ms}))
        print(f"TopK {heads}x{tokens}x{head_dim} (batch {batch}, K {k}): "
              + "  ".join(f"{n} {v:.3f} ms" if isinstance(v, float) else f"{n} {v}" for n, v in ms.items())
              + f"  chosen {kernel}")
    table = attention_choice.TABLE if a.write else a.table
    if table is not None:
        old = attention_choice.load(table) if table.exists() else []
        with written_whole(table) as tmp:
            tmp.write_text(json.dumps(attention_choice.merged(old, choices), indent=1) + "\n")
        print(f"wrote {len(choices)} entries into {table}")
    return choices


if __name__ == "__main__":
    refusing(lambda: main(sys.argv[1:]), (ConfigError, ValueError))
