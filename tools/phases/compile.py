"""Phase `compile`: what run.compile (compiled blocks, replayed as CUDA graphs on one GPU) and the
measured attention kernels give, in the order a short call should learn it (a call whose budget
runs out keeps what came first; docs/GPU.md's one call, `compile:230`, reaches the end of 3.):

1. eager against compiled through train/bench.py (the real loop, synthetic images, bf16), MAE
   ViT-B/16 at micro-batch 128: eager, then compiled;
2. the methods compiled at micro-batch 128, where the host no longer sets the pace: MixedAE, MAE+
   (RPE), AdPE (MAE's compiled step is 1.'s and 3.'s compiled run: the same command);
3. ViT-B at 128 again, compiled then eager (the second round, reversed: a drift in the device's
   pace favours neither);
4. the methods' second round (reversed);
5. equality, bf16: eager and compiled blocks trained from the same weights, images and masks
   (tools/compile_probe.py `loss_curve`), MAE ViT-B/16 at micro-batch 64, 12 steps;
6. ViT-B at 64, eager and compiled (the host's share: 64 should take at most 0.6x the time of 128);
7. the attention table: tools/choose_attention.py times SDPA's kernels on the shapes of MAE and
   MAE+ on ViT-B/L and writes kernels/attention_choices.json, which every later item (and phase)
   then uses; a copy of the table this item wrote goes beside the records, to be committed;
8. ViT-B at 512 (toward the best micro-batch), equality in fp32 with 2 micro-batches per step (the
   gradient sums that start in the graphs' memory pool), ViT-L/16 at 128 eager and compiled;
9. float8 (run.float8, compiled): ViT-L/16 at 128 images/s, then 200 steps at micro-batch 64 of
   float8 and bf16 from one seed and bf16 from another (tools/compile_probe.py `float8_curves`:
   float8's gap to bf16 beside bf16's own seed-to-seed gap).

The CPU smoke mode runs the attention table and the eager throughput item with the debug model
(compile and graphs are GPU-only there: tests/train/engine/test_compile.py proves the compiled
step on CPU).
"""
from __future__ import annotations

import shutil
import statistics
from pathlib import Path

from tools.gpu_check import Check
from tools.method_costs import METHODS
from tools.phases.common import CPU_DEBUG_DS, DEBUG_PRESET, ds_config, our_bench

TARGETS = {"compile_over_eager_vit_b_128": ">= 1.2", "step_64_over_step_128": "<= 0.6",
           "mixedae_over_mae_step": "<= 1.03", "adpe_over_maeplus_step": "<= 1.015", "mfu_vit_b": ">= 0.40",
           "float8": "faster than compiled bf16, with the loss within bf16's seed-to-seed noise over 200 steps"}
# Seconds per item on the GPU (`check.item`'s estimates), from the committed H100 records
# (benchmarks/results/) and the H200's compile probe:
# train/bench.py eager, 5 warm-up + 15 timed steps at micro-batch 128: ViT-B/16 3.4-4.3 s, ViT-L/16
# 6.1-6.9 s (gpu_check_bench_cuda_20261127T021025.json, vit_b_ours_r*, vit_l_ours_r*); the methods'
# ViT-B presets (MAE+'s step ~2x MAE's, gpu_check_methods_cuda_20261127T021741.json) within ViT-B's
EAGER_S = {"vit_b": 10, "vit_l": 15, "debug": 0}  # debug: the CPU smoke, whose estimates are not read
# compiled, on top of the eager run, at block shapes new to the call: vit_b_ours_compile took 25.8 s
# there against 4.3 s eager (21.5 s compiling, each block then with a symbolic batch; inductor's cold
# compile of the static blocks took 13.4 s on the H200, compile_probe_cuda_20261128.json
# compiled_no_graphs warmup_s)
COMPILE_S = 30
# compiled again at shapes compiled earlier in the call: inductor's graphs and kernels come from its
# cache, Dynamo traces and the CUDA graphs are recorded again (the H200's compiled run after one of
# the same blocks without graphs: 10.3 s of warm-up, compile_probe_cuda_20261128.json compiled warmup_s)
RECOMPILE_S = 15
# tools/choose_attention.py --write: not timed on a GPU yet; kernels/bench.py's sweep of the TopK
# kernels against SDPA at the ViT-B/L shapes took 36.8 s (gpu_check_methods_cuda_20261127T021741.json
# kernels_bf16), and this one times SDPA's kernels at every MAE and MAE+ shape of ViT-B and ViT-L too
ATTENTION_S = 60
GPU_ONLY = "compiled blocks and CUDA graphs run on the GPU only (CPU smoke)"
METHOD_ORDER = ("mixedae", "maeplus", "adpe")  # MAE's compiled step: the ViT-B compiled run (the same command)


def run(check: Check, a) -> None:
    from tools import compile_probe

    summary = check.record["summary"]
    summary["targets"] = TARGETS
    compiled_before: set[str] = set()  # block shapes inductor has compiled in this call (its cache is warm)

    def estimate(model: str, variant: str, shapes: str) -> float:
        if variant == "eager":
            return EAGER_S[model]
        return EAGER_S[model] + (RECOMPILE_S if shapes in compiled_before else COMPILE_S)

    def measured(name: str, estimate_s: float, fn, shapes: str | None = None) -> dict | None:
        result = check.item(name, estimate_s, fn)
        if shapes is not None and result is not None and "error" not in result:
            compiled_before.add(shapes)
        return result

    def equality(name: str, micro: int, steps: int, precision: str, accum: int) -> None:
        if not check.cuda:
            check.skip(name, GPU_ONLY)
            return
        shapes = f"vit_b_{micro}_{precision}"  # an eager run, then a compiled one at these shapes

        def probe() -> dict:
            return compile_probe.equality("vit_base_patch16", micro, steps, precision, accum)

        item = measured(name, estimate("vit_b", "compiled", shapes), probe, shapes) or {}
        summary[name] = {k: item[k] for k in ("max_relative_difference", "tolerance", "equal", "error") if k in item}

    if check.cuda:
        # warm-up >= 3: a compiled step's CUDA graphs are recorded in the second and replay from the third
        steps = ["--steps", "15", "--warmup", "5"]
        models = {"vit_b": ["--model.name", "vit_base_patch16"], "vit_l": ["--model.name", "vit_large_patch16"]}
        variants = {"eager": [], "compiled": ["--run.compile", "true"]}
    else:
        steps = ["--steps", "2", "--warmup", "1"]
        models = {"debug": ["--config", str(DEBUG_PRESET)]}
        variants = {"eager": []}

    def throughput(model: str, micro: int, r: int) -> None:
        for variant in (variants if r % 2 == 0 else dict(reversed(variants.items()))):
            ds = ds_config(check, f"compile_{micro}", micro) if check.cuda else CPU_DEBUG_DS
            argv = ["--ds_config", str(ds), "--data.source", "synthetic", *models[model], *steps, *variants[variant]]
            shapes = f"{model}_{micro}"
            measured(f"{model}_{micro}_{variant}_r{r}" if check.cuda else f"{model}_{variant}_r{r}",
                     estimate(model, variant, shapes),
                     lambda a=argv: our_bench(check, a), shapes if variant == "compiled" else None)

    def methods(r: int) -> None:
        ds = str(ds_config(check, "compile_128", 128))
        for method in (METHOD_ORDER if r % 2 == 0 else METHOD_ORDER[::-1]):
            measured(f"method_{method}_compiled_r{r}", estimate("vit_b", "compiled", method),
                     lambda m=method: our_bench(check, ["--ds_config", ds, "--data.source", "synthetic", *METHODS[m],
                                                        *steps, "--run.compile", "true"]), method)

    if not check.cuda:
        attention_table(check)
        throughput("debug", 8, 0)
        equality("equality_bf16_micro64", 64, 12, "bf16", 1)
        equality("equality_fp32_micro32_accum2", 32, 8, "fp32", 2)
        check.skip("methods_compiled_micro128", GPU_ONLY)
    else:
        # the targets first: compiled against eager ViT-B at 128 in two rounds around the methods' first
        throughput("vit_b", 128, 0)
        methods(0)
        throughput("vit_b", 128, 1)
        methods(1)
        equality("equality_bf16_micro64", 64, 12, "bf16", 1)
        throughput("vit_b", 64, 0)
        attention_table(check)  # the items after it run with the kernels it measured fastest
        throughput("vit_b", 512, 0)  # toward the best micro-batch: the device's pace with the host out of the way
        equality("equality_fp32_micro32_accum2", 32, 8, "fp32", 2)
        throughput("vit_l", 128, 0)
        measured("vit_l_128_float8_r0", estimate("vit_l", "compiled", "vit_l_128_float8"), lambda: our_bench(check, [
            "--ds_config", str(ds_config(check, "compile_128", 128)), "--data.source", "synthetic", *models["vit_l"],
            *steps, "--run.compile", "true", "--run.float8", "true"]))
        # 3 compiled runs of 200 steps at 64 (~35 ms a step: ViT-L's eager step at 128 took 69 ms): bf16
        # compiles the shapes, the second seed finds them cached, float8 compiles its own
        item = check.item("float8_curves_vit_l_micro64", 3 * EAGER_S["vit_l"] + 2 * COMPILE_S + RECOMPILE_S,
                          lambda: compile_probe.float8_curves("vit_large_patch16", 64, 200)) or {}
        summary["float8_curves_vit_l_micro64"] = {k: item[k] for k in ("float8_gap", "seed_gap", "within_bf16_noise",
                                                                      "error") if k in item}
    summarise(check)


def attention_table(check: Check) -> None:
    """tools/choose_attention.py: on the GPU written into kernels/attention_choices.json, and a copy
    of the table beside the records when, and only when, this item wrote it (the committed file is
    always there: copied unconditionally, a table measured elsewhere would pass for this call's)."""
    from kernels import attention_choice
    from tools import choose_attention

    argv = (["--write", "--micro", "128"] if check.cuda else
            ["--device", "cpu", "--dtype", "fp32", "--micro", "2", "--iters", "1", "--model",
             "vit_base_patch16", "--config", "defaults", "--table", str(check.work / "attention_choices.json")])
    table = attention_choice.TABLE if check.cuda else check.work / "attention_choices.json"
    before = file_version(table)
    result = check.item("attention_choice", ATTENTION_S, lambda: {"entries": [
        {k: v for k, v in vars(c).items() if k != "measured"} | {"ms": c.measured["ms"]}
        for c in choose_attention.main(argv)]})
    if check.cuda and result is not None and "entries" in result and file_version(table) not in (None, before):
        copy = check.path.with_name(f"attention_choices_{check.path.stem}.json")
        shutil.copyfile(table, copy)
        result["table_copy"] = copy.name
        check.save()


def file_version(path: Path) -> tuple[int, int] | None:
    """(inode, modification time in ns) of `path`, None where it is absent: a rewrite (written whole,
    through a new file) changes it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def summarise(check: Check) -> None:
    """Means over rounds: images/s, step time and MFU of each model x micro-batch x variant, the
    ratios the targets name, and the methods' compiled step ratios (MixedAE over MAE, AdPE over MAE+)."""
    items, summary = check.record["items"], check.record["summary"]
    groups: dict[str, list[dict]] = {}
    for name, v in items.items():
        if "_r" in name and "images_per_s" in v and not name.startswith("method_"):
            groups.setdefault(name.rsplit("_r", 1)[0], []).append(v)
    rows = {key: {"images_per_s": statistics.fmean(v["images_per_s"] for v in done),
                  "step_time_s": statistics.fmean(v["step_time_s"] for v in done),
                  "mfu": statistics.fmean(v["mfu"] for v in done) if all(v.get("mfu") is not None for v in done) else None,
                  "rounds": len(done)}
            for key, done in groups.items()}
    summary["throughput"] = rows
    ratios = {}
    if "vit_l_128_float8" in rows and "vit_l_128_compiled" in rows:
        ratios["float8_over_compiled_vit_l_128"] = (rows["vit_l_128_float8"]["images_per_s"]
                                                    / rows["vit_l_128_compiled"]["images_per_s"])
    for key in ("vit_b_128", "vit_b_64", "vit_b_512", "vit_l_128"):
        if f"{key}_compiled" in rows and f"{key}_eager" in rows:
            ratios[f"compile_over_eager_{key}"] = rows[f"{key}_compiled"]["images_per_s"] / rows[f"{key}_eager"]["images_per_s"]
    for variant in ("eager", "compiled"):
        if f"vit_b_64_{variant}" in rows and f"vit_b_128_{variant}" in rows:
            ratios[f"step_64_over_step_128_{variant}"] = (rows[f"vit_b_64_{variant}"]["step_time_s"]
                                                          / rows[f"vit_b_128_{variant}"]["step_time_s"])
    summary["ratios"] = ratios
    vit_b = {key: row for key, row in rows.items() if key.startswith("vit_b_")}
    if vit_b:  # the fastest ViT-B run: what the 6,000 images/s (40% MFU) target is read against
        key = max(vit_b, key=lambda k: vit_b[k]["images_per_s"])
        summary["vit_b_best"] = {"run": key, **vit_b[key]}
    step = {}
    for method in ("mae", *METHOD_ORDER):  # MAE's: the ViT-B compiled rounds at 128, before and after the methods
        prefix = "vit_b_128_compiled_r" if method == "mae" else f"method_{method}_compiled_r"
        times = [v["step_time_s"] for k, v in items.items() if k.startswith(prefix) and "step_time_s" in v]
        if times:
            step[method] = statistics.fmean(times)
    summary["methods_compiled_micro128"] = {
        "step_time_s": step,
        **({"mixedae_over_mae": step["mixedae"] / step["mae"]} if {"mixedae", "mae"} <= step.keys() else {}),
        **({"adpe_over_maeplus": step["adpe"] / step["maeplus"]} if {"adpe", "maeplus"} <= step.keys() else {})}
    check.save()
