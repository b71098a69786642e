"""Submit a multi-node pretraining job to Slurm, after checking it.

    python launchers/submit.py --nodes 2 --gpus_per_node 8 --gpu a100 [--mode task|node] \\
        [--time 72:00:00] [--partition P] [--account A] [--job_name N] [--dry] \\
        -- --ds_config ds_configs/vit_l_8xa100_bf16_zero1.json --model.name vit_large_patch16 \\
           --data.train_index /data/in1k/train.json --output_dir runs/mae_vitl

1. The pretraining options are checked for the job's world size (nodes x GPUs) and GPU with the
   dry run (train/dry_run.py): a configuration that would fail, or not fit, is refused here with
   the problems listed (exit 2) and nothing is submitted or written.
2. `<output_dir>/launch/<UTC time>/` gets a snapshot of the code (the checkout's tracked files
   as they are now), the ds_config and --config presets, the commit and `git diff HEAD`, and
   submit.json (arguments, sbatch command, job id). The job runs from that snapshot with those
   copies, so a requeued job runs the same code and configuration even if the checkout moved on.
3. sbatch runs launchers/pretrain.sbatch from the snapshot with the nodes, tasks (one per GPU in
   task mode, one per node in node mode), GPUs, time, partition and the log file in the launch
   folder; --dry prints the command instead.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise SystemExit("give the pretraining options after --: submit.py [options] -- --ds_config ... --output_dir ...")
    k = argv.index("--")
    return argv[:k], argv[k + 1:]


def option(args: list[str], key: str) -> str | None:
    """The last value of --key in a --key value list."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == key]
    return values[-1] if values else None


def snapshot(dest: Path) -> dict:
    """Copy the checkout's tracked files (with uncommitted edits) to dest; record commit and diff."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    for rel in git("ls-files", "-z").split("\0"):
        if rel and (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    diff = git("diff", "HEAD")
    (dest.parent / "uncommitted.diff").write_text(diff)
    return {"commit": git("rev-parse", "HEAD").strip(), "dirty": bool(diff)}


def sbatch_command(a, launch: Path, code: Path, pretrain_args: list[str]) -> list[str]:
    tasks = a.gpus_per_node if a.mode == "task" else 1
    cmd = ["sbatch", "--nodes", str(a.nodes), "--ntasks-per-node", str(tasks), "--gpus-per-node",
           str(a.gpus_per_node), "--time", a.time, "--job-name", a.job_name, "--output", str(launch / "slurm-%j.out"),
           "--export", f"ALL,VITPRETRAIN_CODE={code},PYTHON={sys.executable},LAUNCH_MODE={a.mode}"]
    for flag, value in (("--partition", a.partition), ("--account", a.account)):
        if value:
            cmd += [flag, value]
    return [*cmd, str(code / "launchers" / "pretrain.sbatch"), *pretrain_args]


def main(argv: list[str] | None = None) -> int:
    ours, pretrain_args = split(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus_per_node", type=int, default=8)
    p.add_argument("--gpu", required=True, help="v100 | a100 | h100 | ... (train/gpus.py): checked against")
    p.add_argument("--mode", choices=["task", "node"], default="task")
    p.add_argument("--time", default="72:00:00")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--job_name", default="vitpretrain")
    p.add_argument("--dry", action="store_true", help="print the sbatch command, submit nothing")
    a = p.parse_args(ours)

    sys.path.insert(0, str(REPO))
    from train.config import ConfigError, parse_args
    from train.dry_run import check
    from train.gpus import gpu_named

    try:
        cfg = parse_args(pretrain_args)
        run = check(cfg, a.nodes * a.gpus_per_node, gpu_named(a.gpu))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"not submitted: {e}", file=sys.stderr)
        return 2
    for line in run.lines:
        print(f"  {line}")
    if not run.ok:
        print("not submitted:\n" + "\n".join(f"  {x}" for x in run.problems), file=sys.stderr)
        return 2

    out = Path(cfg.output_dir).resolve()
    launch = out / "launch" / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    code = launch / "code"
    code.mkdir(parents=True)
    provenance = snapshot(code)
    args = list(pretrain_args)
    for i, arg in enumerate(args[:-1]):  # the job reads the copies, and writes to the absolute run folder
        if arg in ("--ds_config", "--config"):
            copy = launch / f"{i:02d}_{Path(args[i + 1]).name}"  # presets of the same name may differ
            shutil.copy2(args[i + 1], copy)
            args[i + 1] = str(copy)
        elif arg in ("--output_dir", "--data.train_index", "--data.eval_index", "--model.init_from"):
            args[i + 1] = str(Path(args[i + 1]).resolve())
    if option(args, "--output_dir") is None:
        args += ["--output_dir", str(out)]
    cmd = sbatch_command(a, launch, code, args)
    record = {"date": launch.name, "argv": ours, "pretrain_args": args, "world_size": a.nodes * a.gpus_per_node,
              "gpu": a.gpu, "sbatch": cmd, **provenance}
    if a.dry:
        print(" ".join(cmd))
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            print(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}", file=sys.stderr)
            return proc.returncode
        record["job"] = proc.stdout.strip().split()[-1]
        print(f"{proc.stdout.strip()}; run folder {out}, launch record {launch}")
    (launch / "submit.json").write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
