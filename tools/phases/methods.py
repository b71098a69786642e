"""Phase `methods`: step-time ratios of every method to MAE at ViT-B/224 through train/bench.py at
micro-batch 128, where the host no longer sets the pace (at 64 a MAE step took as long as at 128 on
an H100); kernels/bench.py; where each method's step goes, phase by phase, beside its counted
arithmetic (tools/method_time.py, at 64: energy's double backward at 128 is near an H100's memory).

In the order a short call should learn it (docs/GPU.md's one call, `methods:130`, reaches the end
of 2.): 1. MAE, MixedAE, MAE+ (RPE), AdPE (the ratios the targets name), then the TopK kernel
against SDPA and the PyTorch composition in bf16 (kernels/bench.py); 2. the four again, reversed
(a drift in the device's pace favours neither); 3. where each step goes (tools/method_time.py);
4. MixedAE through the PyTorch TopK composition, MLO-MAE and energy, two rounds; 5. the kernels in
fp16."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from tools.gpu_check import Check, free_memory
from tools.method_costs import DEBUG_METHODS, METHODS
from tools.phases.common import CPU_DEBUG_DS, TARGETS, ds_config, our_bench

# Seconds per item on a GPU. train/bench.py at micro-batch 64 on an H100 took, for its build, 3 warmup
# and 10 timed steps, the slower round's seconds of
# benchmarks/results/gpu_check_methods_cuda_20261127T021741.json (MLO-MAE 13.7 s, energy 7.0 s, MAE 5.6 s);
# at 128 each of the 13 steps may take twice as long, so the estimate adds them once more
# (MLO-MAE 13.7 + 13 x 0.67 s).
BENCH_ESTIMATE_S = {"mae": 7, "mixedae": 9, "mixedae_torch_topk": 7, "maeplus": 6, "adpe": 7, "mlomae": 23,
                    "energy": 12}
KERNELS_ESTIMATE_S = 40  # kernels/bench.py at the ViT-B/L shapes: 36.8 s in bf16 there
# Not measured yet: the six methods built and stepped (under their bench items' 42 s at 64) and their
# FLOPs counted on the host for the same steps (43 s on a 2-core CPU)
PHASE_TIMES_ESTIMATE_S = 90


def run(check: Check, a) -> None:
    summary = check.record["summary"]
    summary["targets"] = {k: TARGETS[k] for k in ("mixedae_over_mae_step", "adpe_over_maeplus_step",
                                                  "topk_fused_speedup_vs_topk_torch", "topk_fused_over_dense")}
    if check.cuda:
        ds, steps, presets, rounds = ds_config(check, "methods_128", 128), ("10", "3"), METHODS, 2
        est = BENCH_ESTIMATE_S
    else:
        ds, steps, presets, rounds = CPU_DEBUG_DS, ("1", "0"), DEBUG_METHODS, 1
        est = dict.fromkeys(BENCH_ESTIMATE_S, 0)

    def argv(method: str) -> list[str]:
        return ["--ds_config", str(ds), "--data.source", "synthetic", "--steps", steps[0], "--warmup", steps[1],
                *presets[method]]

    targets = ["mae", "mixedae", "maeplus", "adpe"]  # MixedAE over MAE, AdPE over MAE+
    others = ["mixedae_torch_topk", "mlomae", "energy"]

    def methods_round(order: list[str], r: int) -> None:
        for method in (order if r % 2 == 0 else order[::-1]):  # alternate, so drift cancels between rounds
            name = method.replace("_torch_topk", "")
            check.item(f"{method}_r{r}", est[method],
                       lambda m=method, n=name: our_bench(check, argv(n), m.endswith("torch_topk")))

    def kernel_bench(dtype: str) -> None:
        from kernels.bench import main as kbench

        def measure() -> dict:
            opts = (["--dtype", dtype, "--shapes", "vit_b", "vit_l", "--iters", "20", "--warmup", "5"] if check.cuda
                    else ["--device", "cpu", "--dtype", "fp32", "--shapes", "2,2,17,16", "--iters", "2", "--warmup", "1"])
            record = json.loads(Path(kbench([*opts, "--out_dir", str(check.work / "kernels")])).read_text())
            free_memory()
            return {"dtype": record["dtype"], "triton": record.get("triton"),
                    "shapes": {k: {"ms": {n: r["ms"] for n, r in v["results"].items()}, "ratios": v["ratios"]}
                               for k, v in record["shapes"].items()}}

        result = check.item(f"kernels_{dtype}", KERNELS_ESTIMATE_S, measure)
        if result and "shapes" in result:
            summary[f"kernels_{dtype}"] = {k: v["ratios"] for k, v in result["shapes"].items()}

    def phase_times() -> None:
        from tools import method_time

        def measure() -> dict:
            opts = (["--micro", "64", "--steps", "4", "--warmup", "2"] if check.cuda else
                    ["--device", "cpu", "--debug", "--micro", "4", "--steps", "1", "--warmup", "1"])
            rows = method_time.main([*opts, "--methods", *method_time.METHODS])
            free_memory()
            return {"rows": rows, "markdown": method_time.markdown(rows)}

        result = check.item("phase_times", PHASE_TIMES_ESTIMATE_S, measure)
        if result and "rows" in result:
            summary["phase_times"] = {m: {k: r.get(k) for k in ("ms", "step_ms", "over_mae_measured", "over_mae_counted")}
                                      for m, r in result["rows"].items()}

    # the targets first (a call cut short keeps them): a round of their methods, the kernels, the second round
    methods_round(targets, 0)
    kernel_bench("bf16" if check.cuda else "fp32")
    for r in range(1, rounds):
        methods_round(targets, r)
    phase_times()
    for r in range(rounds):
        methods_round(others, r)
    if check.cuda:
        kernel_bench("fp16")
    steps = {}
    for method in targets + others:
        times = [v["step_time_s"] for k, v in check.record["items"].items()
                 if k.rsplit("_r", 1)[0] == method and "step_time_s" in v]
        if times:
            steps[method] = statistics.fmean(times)
    summary["step_time_s"] = steps
    ratios = {}
    for method, ref in [("mixedae", "mae"), ("mixedae_torch_topk", "mae"), ("adpe", "maeplus"), ("maeplus", "mae"),
                        ("mlomae", "mae"), ("energy", "mae"), ("mixedae_torch_topk", "mixedae")]:
        if method in steps and ref in steps:
            ratios[f"{method}_over_{ref}"] = steps[method] / steps[ref]
    summary["step_ratios"] = ratios
    check.save()
