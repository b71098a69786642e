"""Submit a multi-node pretraining job to Slurm, after checking it.

    python -m launchers.submit --nodes 2 --gpus_per_node 8 --gpu a100 [--mode task|node] \\
        [--ranks_per_node N] [--cpus_per_task C] [--gres SPEC | --no_gpus_per_node] [--constraint C] \\
        [--time 72:00:00] [--partition P] [--account A] [--qos Q] [--exclusive] [--job_name N] \\
        [--sbatch=--mail-type=END ...] [--dry] [--continue] \\
        -- --ds_config ds_configs/vit_l_8xa100_bf16_zero1.json --model.name vit_large_patch16 \\
           --data.train_index /data/in1k/train.json --output_dir runs/mae_vitl

    # CPU ranks (no GPU requested): 2 nodes x 4 ranks of 2 CPUs each
    python -m launchers.submit --nodes 2 --gpus_per_node 0 --ranks_per_node 4 --cpus_per_task 2 -- \\
        --ds_config ds_configs/cpu_debug.json --config train/configs/mae/debug.json --output_dir runs/cpu

1. The pretraining options are checked for the job's world size (nodes x ranks per node) and GPU
   with the dry run (train/estimate/dry_run.py; CPU ranks with --gpus_per_node 0): a configuration that
   would fail, or not fit, is refused here with the problems listed (exit 2) and nothing is
   submitted or written. So is a request Slurm itself refuses (`sbatch --test-only` first: an
   unknown partition, GRES the cluster lacks, more CPUs per task than a node has), and before it
   a --time that is none of sbatch's formats (minutes, minutes:seconds, hours:minutes:seconds,
   days-hours, days-hours:minutes, days-hours:minutes:seconds) or not positive, and a name
   (--job_name, --partition, --account, --qos, --constraint, --gres) or --sbatch argument holding
   a control character such as a newline (names also no quote, $ or backslash).
   A submission starts a new run: an --output_dir that holds another run (its checkpoints, or a
   config.json of another experiment) is refused unless --continue says to continue that run;
   without --output_dir each submission gets a folder of its own, runs/<objective>_<model>_<UTC
   time>. The job itself always runs with --resume auto, so its requeues continue where it stopped.
2. `<output_dir>/launch/<UTC time>/` gets a snapshot of the code (the checkout's files as they
   are now, those git ignores left out), the ds_config and --config presets, the commit and
   `git diff HEAD`, and submit.json (arguments, sbatch command, code hash, job id). The job runs
   from that snapshot with those copies, so a requeued job runs the same code and configuration
   even if the checkout moved on; the run folder's meta.json records the code that ran (its path and hash).
   If sbatch fails anyway, the launch folder is removed again: nothing is left without a job.
3. sbatch runs launchers/pretrain.sbatch (its resource lines left out) from the launch folder,
   on the snapshot, with the nodes, tasks (one per rank;
   in node mode one launcher per node starts them), CPUs per task (default: data.num_workers + 1,
   the rank and its loader workers), GPUs (--gpus-per-node, or --gres, or none), time, partition,
   account, QOS and the log file in the launch folder; --dry writes nothing and prints the sbatch
   command that runs the checkout as it is (the ds_config and presets where they are), which works
   as printed.

`--help` lists the options; without sbatch on PATH (not a Slurm login node) a submit is refused
(exit 2) before anything is written, while --dry needs no sbatch.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from data.cli import Parser, one_line

REPO = Path(__file__).resolve().parent.parent
RESOURCE_DIRECTIVE = re.compile(r"#SBATCH\s+--(nodes|ntasks-per-node|gpus-per-node|cpus-per-task|time|job-name)\b")
# sbatch --time: "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
# "days-hours:minutes" and "days-hours:minutes:seconds" (man sbatch)
SLURM_TIME = re.compile(r"(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                        r"|(?P<h>\d+):(?P<hm>\d+):(?P<hs>\d+)|(?P<m>\d+)(?::(?P<ms>\d+))?)")
TIME_FORMATS = ("minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes or "
                "days-hours:minutes:seconds (e.g. 72:00:00 or 3-00:00:00)")
# the options whose text sbatch takes as a value (--sbatch arguments are checked as text only)
NAMED_VALUES = ("job_name", "partition", "account", "qos", "constraint", "gres")
UNSAFE_TEXT = re.compile(r"[\x00-\x1f\x7f'\"`$\\]")  # control characters (newlines), quotes, $, backslashes


USAGE = "python -m launchers.submit [options] -- PRETRAINING_OPTIONS (--ds_config FILE ... --output_dir DIR)"


def split(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(submit.py's options, the pretraining options after `--`, or None without a `--`)."""
    if "--" not in argv:
        return argv, None
    k = argv.index("--")
    return argv[:k], argv[k + 1:]


def snapshot(dest: Path) -> dict:
    """Copy the checkout's files (tracked, with uncommitted edits, and new ones git does not ignore)
    to dest; record commit and diff."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    for rel in git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0"):
        if rel and (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    diff = git("diff", "HEAD")
    (dest.parent / "uncommitted.diff").write_text(diff)
    return {"commit": git("rev-parse", "HEAD").strip(), "dirty": bool(diff)}


def refused(problems: list[str]) -> int:
    """Nothing is submitted or written: one line naming every problem (exit status 2)."""
    print(f"not submitted: {'; '.join(one_line(p) for p in problems)}", file=sys.stderr)
    return 2


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, each option that has a default with it."""

    def _get_help_string(self, action):
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return f"{action.help} (default: {action.default})"


def parser() -> argparse.ArgumentParser:
    """submit.py's own options (those before `--`); `--help` lists them with type and default."""
    from train.estimate.gpus import GPUS

    p = Parser(prog="python -m launchers.submit", usage=USAGE, description=__doc__,
                                formatter_class=_HelpFormatter)
    p.add_argument("--nodes", type=int, required=True, help="nodes (int >= 1; required)")
    p.add_argument("--gpus_per_node", type=int,
                   help="GPUs per node (int; default: the count --gres names, else 8); 0: CPU ranks, no GPU requested")
    p.add_argument("--gpu", metavar="NAME",
                   help=f"the GPU the run is checked against (train/estimate/gpus.py: {', '.join(sorted(GPUS))}); "
                        "needed with GPUs")
    p.add_argument("--ranks_per_node", type=int, help="ranks per node (int; default: --gpus_per_node, 1 without GPUs)")
    p.add_argument("--cpus_per_task", type=int,
                   help="CPUs per rank (int; default: data.num_workers + 1, 5 with data.num_workers -1: auto)")
    p.add_argument("--mode", choices=["task", "node"], default="task",
                   help="task: srun starts one task per rank; node: one launcher per node starts its ranks "
                        "(launchers/slurm.py)")
    p.add_argument("--gres", help="request GPUs as this GRES (e.g. gpu:a100:8) instead of --gpus-per-node; its GPU "
                                  "count is the GPUs per node")
    p.add_argument("--no_gpus_per_node", action="store_true",
                   help="request no GPUs (a partition that allocates them with the node), still check for --gpu")
    p.add_argument("--constraint", help="node features (sbatch --constraint)")
    p.add_argument("--time", default="72:00:00",
                   help="time limit (sbatch --time): minutes, minutes:seconds, hours:minutes:seconds, days-hours, "
                        "days-hours:minutes or days-hours:minutes:seconds")
    p.add_argument("--partition", help="Slurm partition (sbatch --partition; default: the cluster's)")
    p.add_argument("--account", help="Slurm account (sbatch --account)")
    p.add_argument("--qos", help="quality of service (sbatch --qos)")
    p.add_argument("--exclusive", action="store_true", help="whole nodes")
    p.add_argument("--job_name", default="vitpretrain", help="job name (sbatch --job-name)")
    p.add_argument("--sbatch", action="append", default=[], metavar="ARG",
                   help="an extra sbatch argument, passed through (repeat; --sbatch=--mail-type=END)")
    p.add_argument("--dry", action="store_true",
                   help="check and print the sbatch command; submit nothing, write nothing (no sbatch needed)")
    p.add_argument("--continue", dest="continue_run", action="store_true",
                   help="continue the run already in --output_dir (refused without it: a submission starts a new run)")
    return p


def gres_gpus(spec: str) -> int | None:
    """The GPUs per node a GRES asks for (Slurm: name[:type][:count], comma-separated; a gpu item
    without a count asks for one), None when it names no gpu or its count is not a number."""
    for item in spec.split(","):
        parts = item.strip().split(":")
        if parts[0] == "gpu":
            if len(parts) == 1:
                return 1
            return int(parts[-1]) if parts[-1].isdigit() else (1 if len(parts) == 2 else None)
    return None


def settle_gpus_per_node(a) -> list[str]:
    """--gpus_per_node from --gres where it is not given (8 without either): the ranks per node
    follow it, so a GRES of 4 GPUs starts 4 ranks, not 8. Problems where the two disagree."""
    counted = gres_gpus(a.gres) if a.gres else None
    if a.gpus_per_node is None:
        if a.gres and counted is None:
            a.gpus_per_node = 8
            return [f"--gres {a.gres!r} names no GPU count this can read (gpu:TYPE:COUNT): give --gpus_per_node too"]
        a.gpus_per_node = 8 if counted is None else counted
    elif counted is not None and counted != a.gpus_per_node:
        return [f"--gres {a.gres} asks for {counted} GPUs per node, --gpus_per_node {a.gpus_per_node} for "
                f"{a.gpus_per_node}: give the same count (or leave --gpus_per_node out)"]
    return []


def request_problems(a) -> list[str]:
    problems = settle_gpus_per_node(a)
    if a.nodes < 1:
        problems.append(f"--nodes {a.nodes}: give at least 1")
    if a.gpus_per_node < 0:
        problems.append(f"--gpus_per_node {a.gpus_per_node}: give 0 (CPU ranks) or more")
    if a.ranks_per_node is not None and a.ranks_per_node < 1:
        problems.append(f"--ranks_per_node {a.ranks_per_node}: give at least 1")
    if a.cpus_per_task is not None and a.cpus_per_task < 1:
        problems.append(f"--cpus_per_task {a.cpus_per_task}: give at least 1")
    if a.gpus_per_node > 0 and a.ranks_per_node is not None and a.ranks_per_node > a.gpus_per_node:
        problems.append(f"--ranks_per_node {a.ranks_per_node} with {a.gpus_per_node} GPUs per node: each rank "
                        f"trains on a GPU of its own; give at most {a.gpus_per_node}")
    if a.gpus_per_node and not a.gpu:
        problems.append("name the GPU to check against with --gpu (v100, a100, h100, ...), or use --gpus_per_node 0 "
                        "for CPU ranks")
    if a.gres and a.no_gpus_per_node:
        problems.append("--gres and --no_gpus_per_node contradict each other: give one")
    if time_seconds(a.time) is None:
        problems.append(f"--time {a.time!r} is not a Slurm time limit: give a positive {TIME_FORMATS}")
    for key in NAMED_VALUES:
        value = getattr(a, key)
        if value is not None and (UNSAFE_TEXT.search(value) or not value.strip()):
            problems.append(f"--{key} {value!r}: give a name without control characters (newlines), quotes, $ or "
                            f"backslashes, as Slurm names are")
    for value in a.sbatch:
        if re.search(r"[\x00-\x1f\x7f]", value):
            problems.append(f"--sbatch {value!r} holds a control character (a newline): give one sbatch argument "
                            f"per --sbatch")
    return problems


def time_seconds(text: str) -> int | None:
    """The seconds an sbatch --time value gives, None when it is none of Slurm's formats or not
    positive (0 would ask Slurm for no limit at all)."""
    match = SLURM_TIME.fullmatch(text)
    if match is None:
        return None
    n = {k: int(v) for k, v in match.groupdict().items() if v is not None}
    seconds = (n.get("days", 0) * 86400 + (n.get("dh", 0) + n.get("h", 0)) * 3600
               + (n.get("dm", 0) + n.get("hm", 0) + n.get("m", 0)) * 60 + n.get("ds", 0) + n.get("hs", 0)
               + n.get("ms", 0))
    return seconds if seconds > 0 else None


def sbatch_options(a, ranks_per_node: int, cpus_per_task: int) -> list[str]:
    """The job's resources (both modes ask for one task per rank: the node launcher reads the count)."""
    cmd = ["--nodes", str(a.nodes), "--ntasks-per-node", str(ranks_per_node), "--cpus-per-task", str(cpus_per_task)]
    if a.gres:
        cmd += ["--gres", a.gres]
    elif a.gpus_per_node and not a.no_gpus_per_node:
        cmd += ["--gpus-per-node", str(a.gpus_per_node)]
    cmd += ["--time", a.time, "--job-name", a.job_name]
    for flag, value in (("--partition", a.partition), ("--account", a.account), ("--qos", a.qos),
                        ("--constraint", a.constraint)):
        if value:
            cmd += [flag, value]
    if a.exclusive:
        cmd.append("--exclusive")
    return [*cmd, *a.sbatch]


def job_script() -> str:
    """The template without its resource defaults (8 tasks and GPUs per node, 10 CPUs per task,
    72 h): this script gives every resource on sbatch's command line, and no GPU request at all
    where it asks for none (a cluster without GPU GRES refuses any)."""
    lines = (REPO / "launchers" / "pretrain.sbatch").read_text().splitlines(keepends=True)
    return "".join(line for line in lines if not RESOURCE_DIRECTIVE.match(line))


def new_run_problem(out: Path, cfg, continue_run: bool) -> str:
    """Why the submission may not use `out` as its run folder ('' when it may)."""
    from train.config.parsing import to_dict
    from train.run.folder import other_run

    if cfg.run.overwrite:
        return ("--run.overwrite is not for a submission: every start of the job (its requeues too) runs --resume "
                "auto; delete the old run's folder yourself, or give another --output_dir")
    if cfg.resume and cfg.resume != "auto":
        return (f"--resume {cfg.resume}: a submission continues its own run folder only (with --continue); "
                f"to start from another run's weights use --model.init_from")
    held = other_run(out, to_dict(cfg))
    if held and not continue_run:
        return (f"--output_dir {out} {held}: the job would continue that run. Add --continue (before the --) to "
                f"resume it, or give another --output_dir")
    if continue_run and not held:
        return f"--continue: --output_dir {out} holds no run to continue; leave --continue out to start one"
    return ""


# Options whose value is a path, read by the job from the launch's code snapshot: made absolute.
# Those a preset may give too (the configs are named on the command line, the run folder is settled apart):
PRESET_PATH_OPTIONS = ("data.train_index", "data.eval_index", "model.init_from")
PATH_OPTIONS = ("ds_config", "config", "output_dir", *PRESET_PATH_OPTIONS)


def absolute_paths(pretrain_args: list[str], cfg, out: Path) -> list[str]:
    """The pretraining options with every path absolute, as resolved where submit runs: the job
    starts in the code snapshot, where a relative path (on the command line or in a preset) would
    name another file. A preset's relative path is overridden on the command line, which wins over
    presets; `--output_dir out` closes the list."""
    args = list(pretrain_args)
    for i, arg in enumerate(args[:-1]):
        if arg.startswith("--") and arg[2:] in PATH_OPTIONS and args[i + 1]:
            args[i + 1] = str(Path(args[i + 1]).resolve())
    given = {arg[2:] for arg in args if arg.startswith("--")}
    for key in PRESET_PATH_OPTIONS:  # wherever a preset gave them
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value and key not in given and not Path(value).is_absolute():
            args += [f"--{key}", str(Path(value).resolve())]
    if "output_dir" in given:
        i = args.index("--output_dir")
        del args[i:i + 2]
    return [*args, "--output_dir", str(out)]


def main(argv: list[str] | None = None) -> int:
    ours, pretrain_args = split(sys.argv[1:] if argv is None else argv)
    p = parser()
    a = p.parse_args(ours)  # --help: the options, exit 0
    if pretrain_args is None:
        p.error("give the pretraining options after --: submit.py [options] -- --ds_config ... --output_dir ...")
    pretrain_args = [part for arg in pretrain_args  # --key=value as --key value: every option found below
                     for part in (arg.split("=", 1) if arg.startswith("--") and "=" in arg else [arg])]
    problems = request_problems(a)
    if "--dry" in pretrain_args:
        problems.append("--dry is submit.py's: give it before the --")
    if not a.dry and shutil.which("sbatch") is None:
        problems.append("sbatch is not on PATH: submit from a Slurm login node (or check the job with --dry)")
    if problems:
        return refused(problems)
    ranks_per_node = a.ranks_per_node or a.gpus_per_node or 1
    world = a.nodes * ranks_per_node

    from data.loader import MAX_AUTO_WORKERS
    from train.config.errors import ConfigError
    from train.config.options import PretrainConfig
    from train.config.parsing import parse_args
    from train.estimate.dry_run import check
    from train.estimate.gpus import gpu_named
    from train.run.code_version import source_hash

    try:
        cfg = parse_args(pretrain_args)
        run = check(cfg, world, gpu_named(a.gpu) if a.gpus_per_node else None)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return refused([str(e)])
    for line in run.lines:
        print(f"  {line}")
    if not run.ok:
        return refused(run.problems)
    # the rank and its loader workers (data.num_workers -1, auto: as many as the rank's CPUs allow, up to MAX_AUTO_WORKERS)
    cpus_per_task = a.cpus_per_task or (cfg.data.num_workers if cfg.data.num_workers >= 0 else MAX_AUTO_WORKERS) + 1

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    # the run folder: the command line's, a preset's, else a new one under runs/
    given = cfg.output_dir if cfg.output_dir != PretrainConfig.output_dir else None
    out = Path(given).resolve() if given else Path("runs", f"{cfg.objective}_{cfg.model.name}_{stamp}").resolve()
    problem = new_run_problem(out, cfg, a.continue_run)
    if problem:
        return refused([problem])
    launch = out / "launch" / stamp
    code = launch / "code"
    if "," in str(code) or "," in sys.executable:  # sbatch --export splits its value at commas
        return refused([f"the run folder {out} or the Python {sys.executable} holds a comma, which sbatch --export "
                        f"cannot pass (it splits the job's variables there): give an --output_dir without one"])
    here = absolute_paths(pretrain_args, cfg, out)  # what the job reads, wherever it starts
    args = list(here)
    copies = {}
    for i, arg in enumerate(args[:-1]):  # the job reads the copies of the configs
        if arg in ("--ds_config", "--config"):
            copies[launch / f"{i:02d}_{Path(args[i + 1]).name}"] = args[i + 1]  # presets of the same name may differ
            args[i + 1] = str(launch / f"{i:02d}_{Path(args[i + 1]).name}")
    resources = sbatch_options(a, ranks_per_node, cpus_per_task)
    export = ["--export", f"ALL,VITPRETRAIN_CODE={code},PYTHON={sys.executable},LAUNCH_MODE={a.mode}"]
    script = job_script()
    cmd = ["sbatch", *resources, "--output", str(launch / "slurm-%j.out"), *export, str(launch / "pretrain.sbatch"),
           *args]
    if a.dry:  # nothing written: a command on the checkout and the given files, which works as printed, from anywhere
        dry = ["sbatch", *resources, "--output", str(out / "slurm-%j.out"), "--export",
               f"ALL,VITPRETRAIN_CODE={REPO},PYTHON={sys.executable},LAUNCH_MODE={a.mode}",
               str(REPO / "launchers" / "pretrain.sbatch"), *here]
        print(f"--dry: nothing written or submitted. A submit snapshots the code and configs into {launch} and runs "
              f"the job from there; these commands run the checkout as it is now (Slurm writes its log only into "
              f"a folder that exists):\n{shlex.join(['mkdir', '-p', str(out)])}\n{shlex.join(dry)}")
        return 0

    # Slurm's own verdict on the request before anything is written (the script on stdin)
    test = subprocess.run(["sbatch", "--test-only", *resources, *export], input=script, capture_output=True, text=True)
    if test.returncode:
        return refused([f"sbatch refuses the request ({test.returncode}): {test.stderr.strip()}"])
    record = {"date": launch.name, "argv": ours, "pretrain_args": args, "world_size": world,
              "ranks_per_node": ranks_per_node, "gpu": a.gpu if a.gpus_per_node else None, "sbatch": cmd}
    try:
        code.mkdir(parents=True)
        record.update(snapshot(code), source_sha256=source_hash(code))
        (launch / "pretrain.sbatch").write_text(script)
        for copy, original in copies.items():
            shutil.copy2(original, copy)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            print(f"not submitted: sbatch failed ({proc.returncode}): {proc.stderr.strip()}", file=sys.stderr)
            shutil.rmtree(launch)  # a snapshot without a job would only mislead
            return proc.returncode
    except BaseException:
        shutil.rmtree(launch, ignore_errors=True)
        raise
    record["job"] = proc.stdout.strip().split()[-1]
    (launch / "submit.json").write_text(json.dumps(record, indent=2))
    print(f"{proc.stdout.strip()}; run folder {out}, launch record {launch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
