"""What every rank of the `scale` phase runs (tools/phases/scale.py), under one launcher call per
GPU count: train/bench.py once per ds_config, in order, in one process group, so that the
launcher's and the imports' start-up is paid once per GPU count rather than once per ZeRO stage.

    torchrun --standalone --nproc_per_node K -m tools.phases.scale_ranks OUT DS_CONFIG [DS_CONFIG ...] -- BENCH_ARGS

Each ds_config's record goes to OUT/<its file stem>/ (train/bench.py writes it on rank 0). A
ds_config whose run raises on every rank (a configuration error) is reported and the next one
runs; a failure on some ranks only leaves the others waiting in a collective, which the phase's
timeout ends, keeping the records already written.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import sys
import traceback
from pathlib import Path

USAGE = "usage: python -m tools.phases.scale_ranks OUT DS_CONFIG [DS_CONFIG ...] -- BENCH_ARGS"


def main(argv: list[str]) -> int:
    if argv[:1] in (["--help"], ["-h"]):
        print(f"{USAGE}\n{__doc__}")
        return 0
    if "--" not in argv or argv.index("--") < 2:
        print(USAGE, file=sys.stderr)
        return 2
    split = argv.index("--")
    out, configs, bench_args = Path(argv[0]), argv[1:split], argv[split + 1:]
    from tools.gpu_check import free_memory
    from train import bench
    from train.run.cli import end_process_group, leave_before_teardown

    failed = 0
    for path in configs:
        try:
            bench.main([*bench_args, "--ds_config", path, "--out_dir", str(out / Path(path).stem)])
        except Exception:  # noqa: BLE001 - the next stage's run is still worth having
            failed += 1
            print(f"[scale_ranks] {path} failed:\n{traceback.format_exc()[-1500:]}", flush=True)
        free_memory()
    if failed:
        return 1
    # before the interpreter's shutdown, and on several ranks without it, as the training commands do
    # (train/run/cli.py run_script: what gloo leaves behind its ended group can abort the teardown)
    if end_process_group() > 1:
        leave_before_teardown(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
