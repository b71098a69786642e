"""The run folder: merged config, final ds_config, provenance, metrics.jsonl, TensorBoard events.

Only rank 0 writes. metrics.jsonl has one JSON object per logged step (strict JSON: a value that
is not finite, e.g. the loss of a window without a finite one, is null). A run that starts at step
0 where an earlier attempt logged steps but completed no checkpoint keeps that attempt's records
in earlier_attempts/<n>/ (`set_aside_unsaved_attempt`).
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from data.folders import unwritable
from data.outputs import clashing_input, written_whole
from data.progress import Progress
from train.engine.checkpoint import is_complete

REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger("pretrain")


def git_commit() -> dict:
    """The checkout's commit, and whether its tracked files differ from it (benchmark records left
    out: writing one must not make the next one's code look changed)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed)}
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"commit": "unknown", "dirty": None}


# The records of earlier starts in a folder that holds no complete checkpoint (`set_aside_unsaved_attempt`)
ATTEMPTS = "earlier_attempts"
# What a run writes into its folder (launchers/submit.py's `launch/` snapshots are not the run's own)
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tb", "vis", "config.json", "ds_config.json", "meta.json",
               "encoder.safetensors", "encoder.json", "eval.json", "split.json", "resumes.jsonl", ATTEMPTS)
# An attempt's records that a start from step 0 would overwrite or mix with its own
ATTEMPT_RECORDS = ("metrics.jsonl", "tb", "eval.json", "vis")


def _experiment(config: dict) -> dict:
    """The part of a config that defines the experiment: not where it writes, how it resumes,
    or the run section's logging, checkpoint and stopping cadence."""
    return {k: v for k, v in config.items() if k not in ("output_dir", "resume", "run")}


def never_trained(run_dir: Path, checkpoints: list[Path]) -> bool:
    """No complete checkpoint, no line in metrics.jsonl and no earlier attempt's records: a start
    that failed before (or during) its first logged step left the folder, and nothing in it can be
    resumed or is worth keeping."""
    metrics = run_dir / "metrics.jsonl"
    return (not checkpoints and (not metrics.is_file() or not metrics.read_text().strip())
            and not (run_dir / ATTEMPTS).exists())


def check_writable_folder(path: Path, what: str) -> None:
    """ValueError naming `path` when it cannot be (or become) a folder this process writes into."""
    problem = unwritable(path)
    if problem:
        raise ValueError(f"{what} {path} {problem}")


def check_run_folder(run_dir: Path, config: dict, resuming: Path | None, overwrite: bool,
                     inputs: dict[str, str] | None = None, clear: bool = True) -> None:
    """A run that does not resume must not mix into another run's folder: refuse one that holds
    checkpoints, or a config.json of another experiment, unless `overwrite` (then delete the old
    run's outputs). A folder whose run never trained (`never_trained`) is no other run: its
    outputs are deleted and the folder reused, unless its config.json is not a run's (a folder of
    something else: refused without `overwrite`). Neither deletes an input the run reads later
    (`inputs`: option -> path, e.g. the weights of --model.init_from), and output_dir is never an
    input folder itself: refused instead. A resume (`resuming`: the checkpoint tag) of a tag outside
    output_dir into a folder where a run trained is the same mix: refused. Raises
    ValueError naming the way out; runs before any process group starts (after check_writable_folder).
    Only the rank holding the folder's lock deletes (`clear`); the others check and read only."""
    if not run_dir.is_dir():
        return
    if resuming is not None:
        check_resume_target(run_dir, resuming)
        return
    refuse_writing_into_inputs(run_dir, inputs or {})
    if never_trained(run_dir, complete_checkpoints(run_dir)):
        foreign = foreign_config(run_dir, config)  # e.g. a transformers folder: no failed start of a run
        if foreign and not overwrite:
            kept = ", ".join(sorted(n for n in RUN_OUTPUTS if (run_dir / n).exists()))
            raise ValueError(f"output_dir {run_dir} {foreign}, so it is no run folder, and a run writes its own "
                             f"config.json there: choose another --output_dir (--run.overwrite true deletes its {kept})")
        if (run_dir / "config.json").is_file():  # a failed start's config.json, meta.json, empty logs, partial checkpoint
            refuse_deleting_inputs(run_dir, inputs or {}, "its outputs, left by a start that never trained, are "
                                   "deleted before this run writes its own")
            if clear:
                clear_run_outputs(run_dir)
    elif problem := other_run(run_dir, config):
        if not overwrite:
            raise ValueError(f"output_dir {run_dir} {problem}; continue it with --resume auto, choose another "
                             f"--output_dir, or start afresh with --run.overwrite true (deletes its checkpoints and "
                             f"logs)")
        refuse_deleting_inputs(run_dir, inputs or {}, "--run.overwrite true deletes the old run's outputs")
        if clear:
            clear_run_outputs(run_dir)
    # nothing cleared (or what was cleared held no input): the run's own files would replace an input
    # kept under their names, e.g. its export the encoder.safetensors it started from
    refuse_deleting_inputs(run_dir, inputs or {}, "the run writes its own there (its export replaces "
                           "encoder.safetensors)")


def check_resume_target(run_dir: Path, tag: Path) -> None:
    """A tag of the run folder itself continues its run. A tag from elsewhere continues in
    output_dir only when no run trained there: that run's metrics.jsonl would be cut back to the
    tag's step, its config.json and checkpoints replaced, and its later tags left beside the
    resumed run's (run.overwrite does not combine with --resume: nothing is deleted for it)."""
    if tag.resolve().is_relative_to(run_dir.resolve()):
        return
    checkpoints = complete_checkpoints(run_dir)
    if never_trained(run_dir, checkpoints):
        return
    held = f"the checkpoints of a run ({checkpoints[-1].name} ...)" if checkpoints else "the logs of a run that trained"
    raise ValueError(f"output_dir {run_dir} holds {held}, and --resume {tag} is a checkpoint of another folder: "
                     f"continuing there would replace that run's logs, config and checkpoints; resume into another "
                     f"--output_dir")


def foreign_config(run_dir: Path, config: dict) -> str:
    """What makes `run_dir`'s config.json not a run's config ("holds a config.json ..."), '' when
    there is none or it is one: a JSON object whose keys are all options sections of `config` (a
    transformers model's config.json, e.g. {"model_type": "vit_mae"}, is not)."""
    path = run_dir / "config.json"
    if not path.is_file():
        return ""
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"holds a config.json that is not readable JSON ({type(e).__name__})"
    except RecursionError:  # json's error for arrays/objects nested past the interpreter's recursion limit
        return "holds a config.json that is not readable JSON (nested too deep)"
    if not isinstance(saved, dict):
        return "holds a config.json that is not a run's config (not a JSON object of options sections)"
    unknown = sorted(set(saved) - set(config))
    if unknown:
        return f"holds a config.json that is not a run's config (keys {', '.join(map(repr, unknown[:3]))} are no options)"
    return ""


def refuse_writing_into_inputs(run_dir: Path, inputs: dict[str, str]) -> None:
    """ValueError when output_dir is an input folder itself (e.g. --model.init_from a transformers
    folder): the run's config.json would replace the input's."""
    for option, given in inputs.items():
        if given and Path(given).is_dir() and Path(given).resolve() == run_dir.resolve():
            raise ValueError(f"{option} {given} is output_dir itself, where the run writes its config.json, "
                             f"checkpoints and logs: choose another --output_dir")


def refuse_deleting_inputs(run_dir: Path, inputs: dict[str, str], why: str) -> None:
    """ValueError when an input (option -> path) is or lies inside one of the outputs that
    clear_run_outputs would delete (symbolic links resolved)."""
    outputs = [run_dir / name for name in RUN_OUTPUTS]
    for option, given in inputs.items():
        if not given:
            continue
        clash = clashing_input(Path(given), outputs)
        if clash is not None:
            raise ValueError(f"{option} {given} {clash[1]} {clash[0]} of "
                             f"output_dir, and {why}: copy it out of {run_dir} first, or choose another --output_dir")


def complete_checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "checkpoints").glob("step*") if is_complete(p))


def other_run(run_dir: Path, config: dict) -> str:
    """What in `run_dir` belongs to a run that trained ("holds the checkpoints of a run ..."), '' if
    nothing does; reads only (the submit check uses it too)."""
    if not run_dir.is_dir():
        return ""
    checkpoints = complete_checkpoints(run_dir)
    if never_trained(run_dir, checkpoints):
        return ""
    if checkpoints:
        return f"holds the checkpoints of a run ({checkpoints[-1].name} ...)"
    old_config = run_dir / "config.json"
    if old_config.is_file():
        try:
            saved = json.loads(old_config.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            return "holds a run whose config.json is not readable JSON"
        except RecursionError:
            return "holds a run whose config.json is not readable JSON (nested too deep)"
        if not isinstance(saved, dict):
            return "holds a run whose config.json is not a JSON object"
        now = json.loads(json.dumps(config))  # as stored: tuples become lists
        differing = sorted(k for k in set(_experiment(saved)) | set(_experiment(now)) if saved.get(k) != now.get(k))
        if differing:
            return f"holds a run with another config (sections differing: {', '.join(differing)})"
    return ""


def clear_run_outputs(run_dir: Path) -> None:
    """Delete what a run wrote into `run_dir` (RUN_OUTPUTS; not launchers/submit.py's `launch/`)."""
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink(missing_ok=True)


def write_whole(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file renamed over it: a crash or a full disk midway
    leaves the old file as it was."""
    with written_whole(path) as tmp:
        tmp.write_text(text)


def write_run_files(run_dir: Path, config: dict, ds_config: dict, extra: dict) -> None:
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    write_whole(run_dir / "config.json", json.dumps(config, indent=2))
    write_whole(run_dir / "ds_config.json", json.dumps(ds_config, indent=2))
    meta = {"git": git_commit(), "argv": sys.argv, "torch": torch.__version__, **extra}
    write_whole(run_dir / "meta.json", json.dumps(meta, indent=2))


def record_resume(run_dir: Path, step: int, tag: Path, changes: dict[str, list]) -> None:
    """Rank 0 at a resume: log the options changed since the checkpoint, one line each, and append
    the resume to resumes.jsonl ({"step", "from", "changes": {option: [old, new]}}), so that a
    reader of the run knows e.g. that the lr changed at step N (config.json holds the newest)."""
    for key, (old, new) in changes.items():
        log.info("resumed with %s changed: %s -> %s", key, json.dumps(old), json.dumps(new))
    with open(run_dir / "resumes.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "from": str(tag), "changes": changes}) + "\n")


def json_line(record: dict) -> str:
    """`record` as one line of JSON with its non-finite values as null (JSON has no NaN or Infinity,
    and JavaScript's JSON.parse, jq and others refuse them). The run's own records are flat; what a
    line written by something else holds deeper is kept as it was when a resume rewrites it."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}) + "\n"


class Reporter:
    """Rank 0's outputs per logged step: metrics.jsonl, TensorBoard, progress bar (images/s, ETA).

    On resume from step `start_step`, lines and events logged after it by the interrupted run
    are dropped first, so every step appears once; a start at step 0 over an attempt's logs (no
    checkpoint of it was complete) keeps them in earlier_attempts/<n>/ first.
    """

    def __init__(self, run_dir: Path, start_step: int, stop_step: int, tensorboard: bool, progress: bool):
        path = run_dir / "metrics.jsonl"
        if path.exists():
            rows, cut = metric_rows(path)
            if not start_step and (rows or cut):  # an attempt trained here, and no checkpoint of it was complete
                set_aside_unsaved_attempt(run_dir, rows)
            if cut:  # a write cut short (power loss, a full disk): its step is logged again by this run if after the tag
                log.warning("%s: %d line(s) that are no complete JSON record dropped (a write cut short)", path, cut)
            kept = [r for r in rows if r["step"] <= start_step]
            if cut or len(kept) < len(rows):  # the whole history stays readable if this rewrite is cut short
                write_whole(path, "".join(map(json_line, kept)))
        self.path = path
        self.file = open(path, "a", buffering=1)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        # a bar on a terminal; in a log (a Slurm job, a file) a line at least every 30 s
        self.bar = Progress("training", stop_step, "steps", initial=start_step, leave=True) if progress else None

    def _write(self, step: int, metrics: dict[str, float], tb_section: str) -> None:
        try:
            self.file.write(json_line({"step": step, **metrics}))
        except OSError as e:  # a full disk: say which file (a write names none)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(f"{tb_section}/{k}", v, step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._write(step, metrics, "train")
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", img_s=f"{metrics['images_per_s']:.0f}")
            self.bar.update(step - self.bar.done)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation result: its own line in metrics.jsonl, `eval/` in TensorBoard."""
        self._write(step, metrics, "eval")
        if self.bar is not None:
            self.bar.write(f"step {step}: " + ", ".join(f"{k} {shown_value(v)}" for k, v in metrics.items()))

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()


def shown_value(value: float | int) -> str:
    """A logged value as a line shows it: a count (eval_samples) as the integer it is, a measure
    (eval_top1) to two decimals."""
    return f"{value:.2f}" if isinstance(value, float) else f"{value}"


def set_aside_unsaved_attempt(run_dir: Path, rows: list[dict]) -> Path:
    """A run that starts at step 0 in a folder where an earlier attempt logged steps (`rows`, from
    its metrics.jsonl) but completed no checkpoint, e.g. one killed before its first: that
    attempt's records (ATTEMPT_RECORDS) move to earlier_attempts/<n>/, so that the new run's
    metrics.jsonl, TensorBoard curves, eval.json and figures are its own and the old ones are kept;
    said in one warning line. The folder it made."""
    attempts = run_dir / ATTEMPTS
    numbers = [int(p.name) for p in attempts.glob("*") if p.name.isdigit()]
    kept = attempts / str(max(numbers, default=0) + 1)
    kept.mkdir(parents=True)
    moved = []
    for name in ATTEMPT_RECORDS:
        record = run_dir / name
        if not record.exists():
            continue
        moved.append(f"{name}/" if record.is_dir() else name)
        if name == "metrics.jsonl":  # copied: the Reporter then rewrites it whole (or not at all, on a full disk)
            shutil.copy2(record, kept / name)
        else:
            record.rename(kept / name)
    steps = sorted({r["step"] for r in rows})
    logged = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}" if steps else "no whole step"
    log.warning("output_dir %s holds no complete checkpoint, so training starts at step 0; the earlier attempt "
                "there (%s logged) keeps its %s in %s", run_dir, logged, ", ".join(moved), kept)
    return kept


def metric_rows(path: Path) -> tuple[list[dict], int]:
    """(the records of a metrics.jsonl, how many of its non-empty lines are none): a line cut short
    by a crash (half a record, NUL bytes) is left out, not a traceback for every later reader."""
    rows, cut = [], 0
    # split at newlines only: str.splitlines also splits at U+2028, U+0085 and others a JSON string may hold
    for line in path.read_text(errors="replace").split("\n"):
        if not line.strip("\0 \t"):
            cut += bool(line.strip())
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deep, no record this program wrote
            cut += 1
            continue
        if isinstance(row, dict) and type(row.get("step")) is int:
            rows.append(row)
        else:
            cut += 1
    return rows, cut


def read_metrics(run_dir: Path) -> list[dict]:
    return metric_rows(Path(run_dir) / "metrics.jsonl")[0]
