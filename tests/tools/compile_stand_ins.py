"""The GPU kit's compile phase with its measurements stood in, for the tests that run its GPU
branch on this CPU (tests/tools/test_gpu_check_plan.py, test_gpu_check_one_call.py)."""
from pathlib import Path


def compile_stand_ins(monkeypatch, runs: list, table: Path | None):
    """The compile phase's measurements stood in: train/bench.py (appending each run's micro-batch,
    compile and float8 switches and warm-up / timed steps to `runs`; compiled 1.3x, float8 1.2x
    faster), the attention table (written into `table` when given, as --write does), the probes."""
    import json

    from kernels import attention_choice
    from tools import choose_attention, compile_probe
    from tools.phases import compile as phase

    def bench(check, argv):
        micro = json.loads(open(argv[argv.index("--ds_config") + 1]).read())["train_micro_batch_size_per_gpu"]
        compiled, float8 = "--run.compile" in argv, "--run.float8" in argv
        runs.append((micro, compiled, float8, argv[argv.index("--warmup") + 1], argv[argv.index("--steps") + 1]))
        rate = 3000.0 * (1.3 if compiled else 1.0) * (1.2 if float8 else 1.0)
        if any("mixedae/" in a for a in argv):
            rate /= 1.02
        return {"images_per_s": rate, "step_time_s": micro / rate, "mfu": rate / 16800}

    def choose(argv):
        assert "--write" in argv and "--device" not in argv
        if table is not None:
            table.write_text('[{"written": "by this call"}]')
        return [attention_choice.Choice("9.0", "bf16", "dense", 12, 50, 64, "cudnn", {"ms": {"cudnn": 0.1}})]

    monkeypatch.setattr(phase, "our_bench", bench)
    monkeypatch.setattr(choose_attention, "main", choose)
    monkeypatch.setattr(attention_choice, "TABLE", table if table is not None else Path("/nonexistent/table.json"))
    monkeypatch.setattr(compile_probe, "equality", lambda *a: {"max_relative_difference": 1e-3, "tolerance": 2e-2,
                                                               "equal": True})
    monkeypatch.setattr(compile_probe, "float8_curves", lambda *a: {"float8_gap": 0.01, "seed_gap": 0.02,
                                                                    "within_bf16_noise": True})
