"""A file system that takes no more writes (a full disk, a quota) outside a checkpoint save: one
line naming the file, the room left and the way on, exit 3; files rewritten at a start (the run's
metrics.jsonl, config.json, meta.json) are replaced whole or not at all; a failed final export
names the command that redoes it from the complete checkpoint."""
import errno
import json
import subprocess
import sys

import pytest
from conftest import CPU_DS, DEBUG_PRESET, REPO, run_pretrain
from safetensors import SafetensorError

from train.run.cli import cli
from train.run.folder import Reporter, read_metrics
from train.weights import export


def test_a_full_disk_ends_a_command_in_one_line_naming_the_file_and_the_room_left(tmp_path, capsys):
    target = tmp_path / "run" / "metrics.jsonl"

    def full():
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    with pytest.raises(SystemExit) as stopped:
        cli(full)
    err = capsys.readouterr().err
    assert stopped.value.code == 3 and err.count("\n") == 1, err
    assert err.startswith(f"stopped: could not write {target} (No space left on device; ") and " MiB free there): " \
        "make room (or mend the file system) and run the same command again; a training run continues from its " \
        "last complete checkpoint with --resume auto" in err

    def denied():
        raise PermissionError(errno.EACCES, "Permission denied", str(target))

    with pytest.raises(PermissionError):  # not a full file system: not this line
        cli(denied)


def test_the_metrics_rewrite_at_a_resume_is_whole_or_not_at_all(tmp_path, monkeypatch):
    """A resume drops the lines logged after its checkpoint by rewriting metrics.jsonl; cut short
    in place (a kill, a full disk) it lost the run's whole history."""
    path = tmp_path / "metrics.jsonl"
    history = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 25))
    path.write_text(history)
    real = type(path).write_text

    def cut_short(self, text, *a, **k):
        real(self, text[:200], *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(type(path), "write_text", cut_short)
    with pytest.raises(OSError):
        Reporter(tmp_path, 23, 30, tensorboard=False, progress=False)
    assert path.read_text() == history and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    monkeypatch.undo()
    before = path.stat().st_mtime_ns
    Reporter(tmp_path, 24, 30, tensorboard=False, progress=False).close()  # nothing to drop: not rewritten
    assert path.stat().st_mtime_ns == before
    Reporter(tmp_path, 23, 30, tensorboard=False, progress=False).close()
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 24))


def test_a_metrics_line_the_disk_refuses_names_the_file(tmp_path):
    reporter = Reporter(tmp_path, 0, 10, tensorboard=False, progress=False)

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    reporter.file = Full()
    with pytest.raises(OSError) as refused:
        reporter.log(1, {"loss": 1.0, "images_per_s": 1.0})
    assert refused.value.errno == errno.ENOSPC and refused.value.filename == str(tmp_path / "metrics.jsonl")


def test_a_safetensors_write_the_disk_refuses_is_the_oserror_it_is(tmp_path, monkeypatch):
    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(export, "save_file", full)
    with pytest.raises(OSError) as refused:
        export.save_safetensors({}, tmp_path / "encoder.safetensors")
    assert refused.value.errno == errno.ENOSPC and refused.value.filename == str(tmp_path / "encoder.safetensors")


FULL_AT_EXPORT = """
import errno, sys
from train.run import command, trainer
from train.run.cli import cli

def full(tag, out):
    raise OSError(errno.ENOSPC, "No space left on device", str(out))

trainer.export_checkpoint = full
cli(lambda: command.main(sys.argv[1:]))
"""


def test_a_final_export_the_disk_refuses_names_the_command_that_redoes_it(tmp_path):
    run = tmp_path / "run"
    argv = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(run), "--run.progress",
            "false", "--run.max_steps", "2", "--run.ckpt_every", "2"]
    proc = subprocess.run([sys.executable, "-c", FULL_AT_EXPORT, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    tag = run / "checkpoints" / "step00000002"
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert (f"training stopped: the encoder export {run / 'encoder.safetensors'} could not be written (No space left "
            f"on device); the checkpoint {tag} is complete: once there is room, write the export with python -m "
            f"train.export --checkpoint {run} --overwrite (its latest checkpoint, into {run / 'encoder.safetensors'})"
            ) in proc.stderr
    assert not (run / "encoder.safetensors").exists()
    hinted = subprocess.run([sys.executable, "-m", "train.export", "--checkpoint", str(run), "--overwrite"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert hinted.returncode == 0, hinted.stderr[-2000:]
    assert json.loads((run / "encoder.json").read_text())["step"] == 2  # the command does what the line says
    (run / "encoder.safetensors").unlink()
    run_pretrain(run, "--run.max_steps", "2", "--run.ckpt_every", "2", "--resume", "auto")  # room again
    assert (run / "encoder.safetensors").is_file()  # the resumed tag is exported: nothing was left to train
