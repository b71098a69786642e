"""launchers/submit.py against a faked sbatch: the resources it asks for, what it leaves behind,
and what it refuses before anything is written (what a real cluster does)."""
import json
import os
import re
import shlex
from pathlib import Path

import pytest
from conftest import CPU_DS, DEBUG_PRESET, REPO

from launchers.submit import main, parser


def fake_sbatch(tmp_path, monkeypatch, fail: str = ""):
    """An `sbatch` that records each call's arguments (one line per call) and, with `fail`, refuses
    the submission (not the --test-only check) the way a cluster without GPU GRES does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    refuse = f'case "$*" in *--test-only*) ;; *) echo "sbatch: error: {fail}" >&2; exit 1;; esac\n' if fail else ""
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/sbatch.log\n{refuse}'
                                    f'echo Submitted batch job 4242\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return tmp_path / "sbatch.log"


def calls(log) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def cpu_job(run_dir, *extra: str) -> list[str]:
    return ["--", "--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(run_dir), *extra]


def test_cpu_ranks_ask_for_no_gpu_and_make_a_world(tmp_path, monkeypatch, capsys):
    """--gpus_per_node 0: no --gpus-per-node anywhere (neither argument nor the script's #SBATCH
    lines), a world of nodes x ranks, no ZeroDivisionError."""
    log = fake_sbatch(tmp_path, monkeypatch)
    assert main(["--nodes", "2", "--gpus_per_node", "0", "--ranks_per_node", "2", *cpu_job(tmp_path / "run")]) == 0
    assert "4 x CPU: global batch 32" in capsys.readouterr().out
    submit = calls(log)[-1]
    assert "--gpus-per-node" not in submit and "--gres" not in submit
    assert submit[:6] == ["--nodes", "2", "--ntasks-per-node", "2", "--cpus-per-task", "11"]  # 10 loader workers + 1
    launch = next((tmp_path / "run" / "launch").iterdir())
    script = (launch / "pretrain.sbatch").read_text()
    assert str(launch / "pretrain.sbatch") in submit and not re.search(r"^#SBATCH\s+--gpus", script, re.M)
    assert "#SBATCH --requeue" in script  # the template's other lines stay
    assert json.loads((launch / "submit.json").read_text())["world_size"] == 4

    # asked not to request GPUs (a partition that hands them out with the node): still checked for the GPU
    assert main(["--nodes", "1", "--gpu", "a100", "--no_gpus_per_node", *cpu_job(tmp_path / "run2")]) == 0
    assert "--gpus-per-node" not in calls(log)[-1]
    assert main(["--nodes", "1", "--gpus_per_node", "0", *cpu_job(tmp_path / "run3")]) == 0  # one rank per node
    assert calls(log)[-1][:4] == ["--nodes", "1", "--ntasks-per-node", "1"]


def test_a_refused_submission_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    log = fake_sbatch(tmp_path, monkeypatch, fail="Invalid generic resource (gres) specification")
    rc = main(["--nodes", "1", "--gpus_per_node", "8", "--gpu", "a100", "--",
               "--ds_config", str(REPO / "ds_configs" / "vit_b_8xa100_bf16_zero1.json"), "--model.name",
               "vit_base_patch16", "--data.source", "synthetic", "--output_dir", str(tmp_path / "run")])
    assert rc != 0 and "Invalid generic resource" in capsys.readouterr().err
    assert not any((tmp_path / "run").rglob("*.py"))  # no code snapshot without its submit.json and job
    assert len(calls(log)) == 2  # checked, then refused


def test_every_cluster_option_reaches_sbatch_and_dry_prints_the_command(tmp_path, monkeypatch, capsys):
    log = fake_sbatch(tmp_path, monkeypatch)
    opts = ["--nodes", "2", "--gpus_per_node", "0", "--ranks_per_node", "3", "--cpus_per_task", "2",
            "--constraint", "avx512", "--time", "0:30:00", "--partition", "short", "--account", "proj",
            "--qos", "high", "--exclusive", "--sbatch=--mail-type=END", "--sbatch=--reservation=r1"]
    assert main([*opts, "--dry", *cpu_job(tmp_path / "run", "--data.epoch_size", "96")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert not (tmp_path / "run").exists() and not log.exists()  # --dry: nothing written, nothing submitted
    assert printed[0] == "sbatch"
    for flag, value in (("--ntasks-per-node", "3"), ("--cpus-per-task", "2"), ("--constraint", "avx512"),
                        ("--time", "0:30:00"), ("--partition", "short"), ("--account", "proj"), ("--qos", "high")):
        assert printed[printed.index(flag) + 1] == value, flag
    assert {"--exclusive", "--mail-type=END", "--reservation=r1"} <= set(printed)
    assert "--gpus-per-node" not in printed

    assert main([*opts, *cpu_job(tmp_path / "run", "--data.epoch_size", "96")]) == 0
    resources = printed.index("--output")
    assert calls(log)[-1][:resources - 1] == printed[1:resources]  # the resources --dry printed are what ran
    assert Path(printed[printed.index("--ds_config") + 1]).is_file()  # the printed command's files exist
    assert main(["--nodes", "1", "--gpus_per_node", "4", "--gpu", "a100", "--gres", "gpu:a100:4",
                 *cpu_job(tmp_path / "run4")]) == 0  # GPUs as GRES: no --gpus-per-node besides
    gres = calls(log)[-1]
    assert gres[gres.index("--gres") + 1] == "gpu:a100:4" and "--gpus-per-node" not in gres
    assert gres[gres.index("--ntasks-per-node") + 1] == "4"
    assert main(["--nodes", "1", "--gpu", "a100", "--gres", "gpu:a100:2", *cpu_job(tmp_path / "run6")]) == 0
    gres = calls(log)[-1]  # the GRES's count is the GPUs per node, and the ranks per node follow it
    assert gres[gres.index("--gres") + 1] == "gpu:a100:2" and gres[gres.index("--ntasks-per-node") + 1] == "2"
    capsys.readouterr()
    assert main(["--nodes", "1", "--gpus_per_node", "8", "--gpu", "a100", "--gres", "gpu:a100:4",
                 *cpu_job(tmp_path / "run7")]) == 2
    assert "--gres gpu:a100:4 asks for 4 GPUs per node, --gpus_per_node 8 for 8" in capsys.readouterr().err
    assert not (tmp_path / "run7").exists()
    assert main(["--nodes", "1", "--gpus_per_node", "4", *cpu_job(tmp_path / "run5")]) == 2  # which GPU?
    assert "--gpu" in capsys.readouterr().err


@pytest.mark.parametrize("spec, gpus", [("gpu:a100:4", 4), ("gpu:2", 2), ("gpu", 1), ("gpu:h100", 1),
                                        ("tmpdisk:100,gpu:a100:8", 8), ("tmpdisk:100", None), ("gpu:a100:x", None)])
def test_the_gpus_a_gres_asks_for(spec, gpus):
    from launchers.submit import gres_gpus
    assert gres_gpus(spec) == gpus



def test_shards_that_do_not_fit_the_model_are_refused_before_any_process_starts(tmp_path, rgb_shards,
                                                                                 monkeypatch, capsys):
    """The debug preset's 1-channel model on RGB shards: refused by the dry run, by submit.py and
    by train/pretrain.py before the process group starts (it used to die after it)."""
    from train.config.errors import ConfigError
    from train.config.parsing import parse_args
    from train.engine import distributed
    from train.estimate.dry_run import check
    from train.estimate.gpus import gpu_named
    from train.pretrain import main as pretrain

    args = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--data.source", "shards",
            "--data.train_index", str(rgb_shards), "--data.num_workers", "0", "--output_dir", str(tmp_path / "run")]
    run = check(parse_args(args), 2, gpu_named("a100"))
    assert any("model.in_chans is 1" in p for p in run.problems), run.problems

    log = fake_sbatch(tmp_path, monkeypatch)
    assert main(["--nodes", "1", "--gpus_per_node", "0", "--", *args]) == 2
    assert "model.in_chans is 1" in capsys.readouterr().err and not log.exists()

    def started(*a, **k):
        raise AssertionError("the process group started")

    monkeypatch.setattr(distributed, "init", started)
    with pytest.raises(ConfigError, match="model.in_chans is 1"):
        pretrain(args)
    assert main(["--nodes", "1", "--gpus_per_node", "0", "--", *args, "--model.in_chans", "3"]) == 0


def test_help_lists_every_option_with_its_default_and_exits_0(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])  # no `--` and no --nodes: still the help
    assert stop.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # as wrapped at any terminal width
    for action in parser()._actions:
        assert action.option_strings[-1] in out, action.option_strings
    assert "(int; default: the count --gres names, else 8)" in out and "(default: 72:00:00)" in out
    assert "-- PRETRAINING_OPTIONS" in out
    assert "a100" in out  # the GPU names --gpu takes


def test_without_sbatch_a_submit_is_refused_before_anything_is_written_and_dry_needs_none(tmp_path, monkeypatch,
                                                                                           capsys):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no sbatch (nor anything else) on PATH
    assert main(["--nodes", "1", "--gpus_per_node", "0", *cpu_job(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "sbatch is not on PATH" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()

    before = sorted(tmp_path.rglob("*"))
    assert main(["--nodes", "1", "--gpus_per_node", "0", "--dry", *cpu_job(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "--dry: nothing written or submitted" in out and out.strip().splitlines()[-1].startswith("sbatch ")
    assert sorted(tmp_path.rglob("*")) == before  # no snapshot, no launch folder, no run folder


def test_submit_options_after_the_separator_and_a_missing_separator_are_refused(tmp_path, monkeypatch, capsys):
    log = fake_sbatch(tmp_path, monkeypatch)
    assert main(["--nodes", "1", "--gpus_per_node", "0", *cpu_job(tmp_path / "run", "--dry")]) == 2
    assert "--dry is submit.py's: give it before the --" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["--nodes", "1", "--gpus_per_node", "0", "--dry"])
    assert stop.value.code == 2 and "give the pretraining options after --" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not log.exists()


def test_a_submission_never_continues_another_run_by_accident(tmp_path, monkeypatch, capsys):
    """A folder with a run's checkpoint: refused without --continue (nothing written, nothing
    submitted), accepted with it; --continue where there is nothing to continue is refused too."""
    log = fake_sbatch(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)  # a folder read wrongly would land under tmp_path/runs, not the checkout's
    run = tmp_path / "run"
    tag = run / "checkpoints" / "step00000004"
    tag.mkdir(parents=True)
    (tag / "complete.json").write_text(json.dumps({"step": 4, "world_size": 1, "files": {}}))
    job = ["--nodes", "1", "--gpus_per_node", "0", *cpu_job(run, "--optim.blr", "3e-3")]
    assert main(job) == 2
    err = capsys.readouterr().err
    assert f"--output_dir {run} holds the checkpoints of a run (step00000004 ...)" in err and "--continue" in err
    assert not (run / "launch").exists() and not log.exists()
    equals_form = [a for a in job if a not in ("--output_dir", str(run))] + [f"--output_dir={run}"]
    assert main(equals_form) == 2 and "holds the checkpoints of a run" in capsys.readouterr().err
    assert not log.exists()
    assert main(["--continue", *job]) == 0  # asked for: the job resumes it (pretrain.sbatch's --resume auto)
    submitted = [c for c in calls(log) if "--test-only" not in c]
    assert len(submitted) == 1 and submitted[0][submitted[0].index("--output_dir") + 1] == str(run)
    assert (tag / "complete.json").exists()  # the run to continue is left as it was
    assert main(["--continue", "--nodes", "1", "--gpus_per_node", "0", *cpu_job(tmp_path / "new")]) == 2
    assert "holds no run to continue" in capsys.readouterr().err
    assert main(["--nodes", "1", "--gpus_per_node", "0", *cpu_job(tmp_path / "new2", "--run.overwrite", "true")]) == 2
    assert "--run.overwrite is not for a submission" in capsys.readouterr().err


def test_without_output_dir_each_submission_gets_its_own_folder(tmp_path, monkeypatch, capsys):
    log = fake_sbatch(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    job = ["--nodes", "1", "--gpus_per_node", "0", "--", "--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET)]
    assert main(job) == 0
    monkeypatch.setattr("launchers.submit.datetime", _LaterClock)
    assert main(job) == 0
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(folders) == 2 and all(f.startswith("mae_vit_debug_patch4_") for f in folders)
    outs = [c[c.index("--output_dir") + 1] for c in calls(log) if "--test-only" not in c]
    assert len(set(outs)) == 2 and all(Path(o).parent == tmp_path / "runs" for o in outs)


class _LaterClock:
    """datetime for the second submission: a later second, so its stamp differs."""
    @staticmethod
    def now(tz=None):
        from datetime import datetime, timedelta

        return datetime.now(tz) + timedelta(seconds=5)


def test_dry_writes_nothing_and_prints_a_command_whose_files_exist(tmp_path, monkeypatch, capsys):
    """--dry writes nothing; the command it prints names the checkout's job script and the given
    configs, all of which exist (a submit's snapshot would not exist yet)."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no sbatch: --dry needs none
    assert main(["--nodes", "1", "--gpus_per_node", "0", "--dry", *cpu_job(tmp_path / "run")]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    script = next(a for a in cmd if a.endswith("pretrain.sbatch"))
    assert Path(script) == REPO / "launchers" / "pretrain.sbatch"
    assert Path(cmd[cmd.index("--ds_config") + 1]).is_file() and Path(cmd[cmd.index("--config") + 1]).is_file()
    assert f"VITPRETRAIN_CODE={REPO}," in cmd[cmd.index("--export") + 1]
    assert not (tmp_path / "run").exists()


def test_time_limits_are_read_in_sbatchs_formats_only(tmp_path, capsys):
    """man sbatch: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
    days-hours:minutes:seconds; a duration of 0 (no limit at all) or another text is refused in one
    line before anything is written."""
    from launchers.submit import time_seconds

    for text, seconds in {"60": 3600, "30:30": 1830, "4:30:30": 16230, "72:00:00": 259200, "4-12": 388800,
                          "4-12:15": 389700, "4-12:15:30": 389730}.items():
        assert time_seconds(text) == seconds, text
    for text in ("0", "0:00:00", "0-0", "72h", "3 days", "1:2:3:4", "1-2-3", "-1", "", " 60", "60\n", "1.5"):
        assert time_seconds(text) is None, text
    assert main(["--nodes", "1", "--gpus_per_node", "0", "--time", "72h", "--dry", *cpu_job(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not submitted: --time '72h' is not a Slurm time limit: give a positive minutes, " \
                                  "minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes or " \
                                  "days-hours:minutes:seconds" in err
    assert main(["--nodes", "1", "--gpus_per_node", "0", "--time", "3-00:00:00", "--dry",
                 *cpu_job(tmp_path / "run")]) == 0
    assert "--time 3-00:00:00" in capsys.readouterr().out and not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag, value", [("--job_name", "mae\n#SBATCH --exclusive"), ("--partition", "gpu'"),
                                         ("--account", "a$HOME"), ("--qos", "q\\"), ("--constraint", "a100\r"),
                                         ("--gres", 'gpu:"8"'), ("--job_name", " ")])
def test_names_that_would_break_the_job_are_refused(tmp_path, capsys, flag, value):
    assert main(["--nodes", "1", "--gpus_per_node", "0", flag, value, "--dry", *cpu_job(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag} {value!r}: give a name without control characters (newlines), " \
                                    f"quotes, $ or backslashes" in err, err


def test_names_slurm_reads_pass_and_an_sbatch_argument_holds_no_newline(tmp_path, capsys):
    ok = ["--job_name", "mae vit-b", "--constraint", "a100|h100", "--partition", "gpu,gpu2", "--gres", "gpu:a100:8"]
    assert main(["--nodes", "1", "--gpu", "a100", *ok, "--dry", *cpu_job(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["--nodes", "1", "--gpus_per_node", "0", "--sbatch=--comment=a\nb", "--dry",
                 *cpu_job(tmp_path / "run")]) == 2
    assert "--sbatch '--comment=a\\nb' holds a control character (a newline)" in capsys.readouterr().err


def test_every_path_the_job_reads_is_absolute_wherever_it_was_given(tmp_path, monkeypatch, capsys):
    """The job starts in the code snapshot (--dry: the checkout), so a relative path names another
    file there: a preset's relative shard index passed submit's check and failed after the queue
    wait ("shard index shards/train.json not found"), --dry's printed command failed from another
    folder, and a preset's output_dir was replaced by a new folder under runs/."""
    import numpy as np
    from PIL import Image

    from data.write_shards import main as write_shards

    images = tmp_path / "images" / "0"
    images.mkdir(parents=True)
    for i in range(8):
        Image.fromarray(np.full((28, 28), 30 * i, dtype=np.uint8), mode="L").save(images / f"{i}.png")
    write_shards(["imagefolder", str(tmp_path / "images"), str(tmp_path / "shards"), "--samples_per_shard", "4"])
    (tmp_path / "preset.json").write_text(json.dumps({"data": {"train_index": "shards/train.json"},
                                                      "model": {"init_from": "weights/encoder.safetensors"},
                                                      "output_dir": "preset_run"}))
    log = fake_sbatch(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    job = ["--nodes", "1", "--gpus_per_node", "0", "--", "--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET),
           "--data.source", "shards", "--data.num_workers", "1", "--model.in_chans", "3",
           "--config", "preset.json"]  # a relative path as the last option too
    _save_encoder(tmp_path / "weights" / "encoder.safetensors",  # the preset's weights: the job's model
                  ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--model.in_chans", "3"])
    assert main(["--dry", *job]) == 0
    mkdir, printed = capsys.readouterr().out.strip().splitlines()[-2:]
    assert mkdir == f"mkdir -p {tmp_path / 'preset_run'}"
    assert main(job) == 0
    submitted = [c for c in calls(log) if "--test-only" not in c][-1]
    for cmd in (shlex.split(printed), submitted):
        paths = {key: cmd[len(cmd) - 1 - cmd[::-1].index(f"--{key}") + 1]
                 for key in ("ds_config", "config", "output_dir", "data.train_index", "model.init_from")}
        assert all(Path(v).is_absolute() for v in paths.values()), paths  # (the last of each)
        assert paths["output_dir"] == str(tmp_path / "preset_run")
        assert paths["data.train_index"] == str(tmp_path / "shards" / "train.json")
        assert paths["model.init_from"] == str(tmp_path / "weights" / "encoder.safetensors")


def _save_encoder(path: Path, pretrain_args: list[str]) -> None:
    """An encoder.safetensors of the model these options configure (what model.init_from reads)."""
    from safetensors.torch import save_file

    from train.config.parsing import parse_args
    from train.config.plan import build_encoder

    path.parent.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in build_encoder(parse_args(pretrain_args)).state_dict().items()}, path)


def test_requests_a_job_cannot_start_are_refused_before_anything_is_written(tmp_path, capsys):
    """16 ranks per node on 8 GPUs passed every check (ranks 8-15 would find no device); a run
    folder with a comma was split by sbatch --export and the job failed at its first line."""
    assert main(["--nodes", "2", "--gpus_per_node", "8", "--gpu", "a100", "--ranks_per_node", "16", "--dry",
                 *cpu_job(tmp_path / "run")]) == 2
    assert "--ranks_per_node 16 with 8 GPUs per node: each rank trains on a GPU of its own; give at most 8" in \
        capsys.readouterr().err
    assert main(["--nodes", "1", "--gpus_per_node", "0", "--dry", *cpu_job(tmp_path / "a,b")]) == 2
    assert "holds a comma, which sbatch --export cannot pass" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_job_gets_its_mode_its_log_in_the_launch_folder_and_each_preset_as_given(tmp_path, monkeypatch, capsys):
    """--mode node reaches the job script (LAUNCH_MODE), in the check and the submission; Slurm's log
    goes into the launch folder; two presets of the same file name are copied apart, each as it was."""
    log = fake_sbatch(tmp_path, monkeypatch)
    presets = []
    for folder, preset in (("a", {"optim": {"weight_decay": 0.1}}), ("b", {"mae": {"mask_ratio": 0.6}})):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "p.json").write_text(json.dumps(preset))
        presets += ["--config", str(tmp_path / folder / "p.json")]
    assert main(["--nodes", "1", "--gpus_per_node", "0", "--mode", "node", *cpu_job(tmp_path / "run", *presets)]) == 0
    test, submit = calls(log)
    launch = next((tmp_path / "run" / "launch").iterdir())
    for cmd in (test, submit):
        assert cmd[cmd.index("--export") + 1].split(",")[-1] == "LAUNCH_MODE=node"
    assert submit[submit.index("--output") + 1] == str(launch / "slurm-%j.out")
    copies = [Path(submit[i + 1]) for i, arg in enumerate(submit) if arg == "--config"][1:]  # after the debug preset
    assert len(set(copies)) == 2 and all(c.parent == launch for c in copies)
    assert [c.read_text() for c in copies] == [(tmp_path / f / "p.json").read_text() for f in ("a", "b")]

    capsys.readouterr()
    assert main(["--nodes", "1", "--gpus_per_node", "0", "--mode", "node", "--dry", *cpu_job(tmp_path / "dry")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert printed[printed.index("--export") + 1].endswith(",LAUNCH_MODE=node")


def test_ranks_per_node_up_to_the_gpus_are_asked_for_as_given(tmp_path, capsys):
    """--ranks_per_node wins over --gpus_per_node (4 ranks on 8 GPUs start 4 tasks), and as many ranks
    as GPUs is accepted."""
    for ranks in (4, 8):
        assert main(["--nodes", "2", "--gpus_per_node", "8", "--gpu", "a100", "--ranks_per_node", str(ranks), "--dry",
                     *cpu_job(tmp_path / "run", "--data.epoch_size", "100000")]) == 0, capsys.readouterr().err
        printed = capsys.readouterr().out.strip().splitlines()[-1].split()
        assert printed[printed.index("--ntasks-per-node") + 1] == str(ranks)
        assert printed[printed.index("--gpus-per-node") + 1] == "8"


def test_cpus_per_task_are_the_rank_and_its_loader_workers(tmp_path, rgb_shards, capsys):
    """Without --cpus_per_task: data.num_workers + 1 (the rank and each worker; 0 workers: the rank
    alone), MAX_AUTO_WORKERS + 1 for -1 (auto); --cpus_per_task wins."""
    from data.loader import MAX_AUTO_WORKERS

    shards = ["--data.source", "shards", "--data.train_index", str(rgb_shards), "--model.in_chans", "3"]
    for workers, extra, cpus in ((2, [], 2 + 1), (0, [], 0 + 1), (-1, [], MAX_AUTO_WORKERS + 1),
                                 (2, ["--cpus_per_task", "7"], 7)):  # 0: loading in the rank, one CPU
        assert main(["--nodes", "1", "--gpus_per_node", "0", *extra, "--dry",
                     *cpu_job(tmp_path / "run", *shards, "--data.num_workers", str(workers))]) == 0, \
            capsys.readouterr().err
        printed = capsys.readouterr().out.strip().splitlines()[-1].split()
        assert printed[printed.index("--cpus-per-task") + 1] == str(cpus), workers


@pytest.mark.parametrize("flags, extra, message", [
    (["--gpu", "a100", "--gres", "gpu:a100:8", "--no_gpus_per_node"], [],
     "--gres and --no_gpus_per_node contradict each other: give one"),
    (["--gpus_per_node", "0"], ["--resume", "/x/checkpoints/step00000004"],
     "--resume /x/checkpoints/step00000004: a submission continues its own run folder only (with --continue)")])
def test_contradicting_requests_and_another_runs_checkpoint_are_refused_in_one_line(tmp_path, capsys, flags, extra,
                                                                                      message):
    assert main(["--nodes", "1", *flags, "--dry", *cpu_job(tmp_path / "run", *extra)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_the_snapshot_holds_the_checkout_as_it_is_and_its_diff(tmp_path, monkeypatch):
    """snapshot() on a small checkout: tracked files with their uncommitted edits, new files git does
    not ignore (a module not yet added), no ignored ones; `git diff HEAD` in uncommitted.diff."""
    import subprocess

    import launchers.submit as submit

    repo = tmp_path / "checkout"
    (repo / "pkg").mkdir(parents=True)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True,
                              capture_output=True, text=True).stdout

    git("init", "-q")
    (repo / "pkg" / "mod.py").write_text("X = 1\n")
    (repo / ".gitignore").write_text("*.log\n")
    git("add", "-A")
    git("commit", "-qm", "start")
    (repo / "pkg" / "mod.py").write_text("X = 2\n")  # an uncommitted edit
    (repo / "pkg" / "new.py").write_text("Y = 3\n")  # untracked, not ignored
    (repo / "pkg" / "run.log").write_text("noise\n")  # ignored
    monkeypatch.setattr(submit, "REPO", repo)
    dest = tmp_path / "launch" / "code"
    dest.mkdir(parents=True)
    record = submit.snapshot(dest)
    assert (dest / "pkg" / "mod.py").read_text() == "X = 2\n" and (dest / "pkg" / "new.py").read_text() == "Y = 3\n"
    assert not (dest / "pkg" / "run.log").exists()
    diff = (tmp_path / "launch" / "uncommitted.diff").read_text()
    assert "-X = 1\n+X = 2\n" in diff and diff == git("diff", "HEAD")
    assert record == {"commit": git("rev-parse", "HEAD").strip(), "dirty": True}
