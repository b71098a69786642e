"""Phase `compile`: what run.compile (compiled blocks, replayed as CUDA graphs on one GPU) and the
measured attention kernels give, in the order a short call should learn it:

1. equality: eager and compiled blocks trained from the same weights, images and masks
   (tools/compile_probe.py `loss_curve`), bf16 at micro-batch 64, and fp32 with 2 micro-batches
   per step (the gradient sums that start in the graphs' memory pool);
2. the attention table: tools/choose_attention.py times SDPA's kernels on the shapes of MAE and
   MAE+ on ViT-B/L and writes kernels/attention_choices.json, which every later item then uses;
3. throughput through train/bench.py (the real loop, synthetic images, bf16), eager and compiled
   alternating: MAE ViT-B/16 at micro-batch 128 and 64 (the host's share: 64 should take at most
   0.6x the time of 128), ViT-L/16 at 128;
4. the methods with compiled blocks at micro-batch 128, where the host no longer sets the pace:
   MixedAE against MAE, AdPE against MAE+.

The CPU smoke mode runs items 2-3 with the debug model (compile and graphs are GPU-only there:
tests/train/engine/test_compile.py proves the compiled step on CPU).
"""
from __future__ import annotations

import statistics

from tools.gpu_check import Check
from tools.phases.common import CONFIGS, CPU_DEBUG_DS, DEBUG_PRESET, ds_config, our_bench

TARGETS = {"compile_over_eager_vit_b_128": ">= 1.2", "step_64_over_step_128": "<= 0.6",
           "mixedae_over_mae_step": "<= 1.03", "adpe_over_maeplus_step": "<= 1.015", "mfu_vit_b": ">= 0.40"}


def run(check: Check, a) -> None:
    from tools import choose_attention, compile_probe

    summary = check.record["summary"]
    summary["targets"] = TARGETS
    if check.cuda:
        check.item("equality_bf16_micro64", 60, lambda: compile_probe.equality("vit_base_patch16", 64, 12, "bf16", 1))
        check.item("equality_fp32_micro32_accum2", 70,
                   lambda: compile_probe.equality("vit_base_patch16", 32, 8, "fp32", 2))
        for name in ("equality_bf16_micro64", "equality_fp32_micro32_accum2"):
            item = check.record["items"].get(name, {})
            summary[name] = {k: item.get(k) for k in ("max_relative_difference", "tolerance", "equal", "error")
                             if k in item}
        attention_argv = ["--write", "--micro", "128"]
    else:
        check.skip("equality_bf16_micro64", "compiled blocks and CUDA graphs run on the GPU only (CPU smoke)")
        check.skip("equality_fp32_micro32_accum2", "compiled blocks and CUDA graphs run on the GPU only (CPU smoke)")
        attention_argv = ["--device", "cpu", "--dtype", "fp32", "--micro", "2", "--iters", "1",
                          "--model", "vit_base_patch16", "--config", "defaults",
                          "--table", str(check.work / "attention_choices.json")]
    check.item("attention_choice", 60, lambda: {"entries": [
        {k: v for k, v in vars(c).items() if k != "measured"} | {"ms": c.measured["ms"]}
        for c in choose_attention.main(attention_argv)]})

    if check.cuda:
        steps, rounds = ["--steps", "15", "--warmup", "5"], 2
        runs = [("vit_b_128", ["--model.name", "vit_base_patch16"], 128, 40),
                ("vit_b_64", ["--model.name", "vit_base_patch16"], 64, 30),
                ("vit_l_128", ["--model.name", "vit_large_patch16"], 128, 70)]
        variants = {"eager": [], "compiled": ["--run.compile", "true"]}
    else:
        steps, rounds = ["--steps", "2", "--warmup", "1"], 1
        runs = [("debug", ["--config", str(DEBUG_PRESET)], 8, 0)]
        variants = {"eager": []}

    def argv(model: list[str], micro: int, *extra: str) -> list[str]:
        ds = ds_config(check, f"compile_{micro}", micro) if check.cuda else CPU_DEBUG_DS
        return ["--ds_config", str(ds), "--data.source", "synthetic", *model, *steps, *extra]

    for key, model, micro, est in runs:
        for r in range(rounds):
            for variant in (variants if r % 2 == 0 else dict(reversed(variants.items()))):
                check.item(f"{key}_{variant}_r{r}", est + (60 if variant == "compiled" else 0),
                           lambda m=model, mb=micro, v=variant: our_bench(check, argv(m, mb, *variants[v])))
    rows = {}
    for key, *_ in runs:
        for variant in variants:
            done = [v for k, v in check.record["items"].items() if k.startswith(f"{key}_{variant}_r")
                    and "images_per_s" in v]
            if done:
                rows[f"{key}_{variant}"] = {"images_per_s": statistics.fmean(v["images_per_s"] for v in done),
                                            "step_time_s": statistics.fmean(v["step_time_s"] for v in done),
                                            "mfu": statistics.fmean(v["mfu"] for v in done if v.get("mfu") is not None)
                                            if any(v.get("mfu") is not None for v in done) else None}
    summary["throughput"] = rows
    ratios = {}
    for key in ("vit_b_128", "vit_b_64", "vit_l_128"):
        if f"{key}_compiled" in rows and f"{key}_eager" in rows:
            ratios[f"compile_over_eager_{key}"] = rows[f"{key}_compiled"]["images_per_s"] / rows[f"{key}_eager"]["images_per_s"]
    for variant in variants:
        if f"vit_b_64_{variant}" in rows and f"vit_b_128_{variant}" in rows:
            ratios[f"step_64_over_step_128_{variant}"] = (rows[f"vit_b_64_{variant}"]["step_time_s"]
                                                          / rows[f"vit_b_128_{variant}"]["step_time_s"])
    summary["ratios"] = ratios
    check.save()

    if not check.cuda:
        check.skip("methods_compiled_micro128", "the methods' compiled steps are measured on the GPU only (CPU smoke)")
        return
    ds = str(ds_config(check, "compile_methods_128", 128))
    presets = {"mae": ["--model.name", "vit_base_patch16"], "mixedae": ["--config", str(CONFIGS / "mixedae/vit_b.json")],
               "maeplus": ["--config", str(CONFIGS / "maeplus/vit_b.json"),
                           "--config", str(CONFIGS / "maeplus/variants/maeplus_rpe.json")],
               "adpe": ["--config", str(CONFIGS / "maeplus/vit_b.json"),
                        "--config", str(CONFIGS / "maeplus/variants/rpe_coord.json")]}
    order = list(presets)
    for r in range(2):
        for method in (order if r % 2 == 0 else order[::-1]):
            check.item(f"method_{method}_compiled_r{r}", 100, lambda m=method: our_bench(check, [
                "--ds_config", ds, "--data.source", "synthetic", *presets[m], *steps, "--run.compile", "true"]))
    step = {}
    for method in order:
        times = [v["step_time_s"] for k, v in check.record["items"].items()
                 if k.startswith(f"method_{method}_compiled_r") and "step_time_s" in v]
        if times:
            step[method] = statistics.fmean(times)
    summary["methods_compiled_micro128"] = {
        "step_time_s": step,
        **({"mixedae_over_mae": step["mixedae"] / step["mae"]} if {"mixedae", "mae"} <= step.keys() else {}),
        **({"adpe_over_maeplus": step["adpe"] / step["maeplus"]} if {"adpe", "maeplus"} <= step.keys() else {})}
    check.save()
