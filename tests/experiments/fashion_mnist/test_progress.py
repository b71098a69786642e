"""progress.py / `study.py --status`: each stage of a run read from fake run folders, the step
time and the time left computed from the logged steps, and a result with another budget flagged."""
import json
import os

import pytest

from experiments.fashion_mnist import progress
from experiments.fashion_mnist.study import main as study

FULL = {"pretrain_samples": 600000, "finetune_epochs": 1.0, "finetune_samples": 60000, "eval_epochs": [1, 3]}
NOW = 1_000_000.0


def _stage_folder(run, total, step_times, mtime=NOW - 120):
    """A pretrain/ or finetune/ folder: meta.json and a metrics row every 25 steps."""
    run.mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"total_steps": total}))
    rows = [{"step": 25 * (i + 1), "loss": 1.0, "step_time": t} for i, t in enumerate(step_times)]
    rows.insert(1, {"step": 30, "grad_norm_hist": 1.0})  # a row without a step time is not a training step
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.utime(run / "metrics.jsonl", (mtime, mtime))


def _result(out, entry, budget, **scores):
    (out / entry / "seed0").mkdir(parents=True, exist_ok=True)
    (out / entry / "seed0" / "result.json").write_text(json.dumps({"budget": budget, **scores}))


def test_each_stage_with_its_step_and_time_left(tmp_path):
    _result(tmp_path, "mae", FULL, knn_top1=82.49, linear_probe_top1=83.48, finetune_top1=81.23,
            pretrain_seconds=2425.8)
    _result(tmp_path, "maeplus", {**FULL, "pretrain_samples": 180000}, knn_top1=70.0)
    # pretraining: steps 25..175 logged; the last five step times 2, 2, 9, 2, 4 -> median 2.0 s
    _stage_folder(tmp_path / "energy" / "seed0" / "pretrain", 4680, [1, 1, 2, 2, 9, 2, 4])
    (tmp_path / "mixedae" / "seed0" / "pretrain").mkdir(parents=True)
    (tmp_path / "mixedae" / "seed0" / "pretrain" / "encoder.safetensors").write_bytes(b"")
    _stage_folder(tmp_path / "supervised" / "seed0" / "finetune", 1000, [0.5, 0.5], mtime=NOW - 3 * 3600)
    got = {e: progress.entry_status(tmp_path, e, 0, FULL, now=NOW)
           for e in ("mae", "maeplus", "energy", "mixedae", "supervised", "adpe")}

    assert [got[e].stage for e in got] == ["done", "done, other budget", "pretraining", "evaluating", "fine-tuning",
                                           "not started"]
    energy = got["energy"]
    assert (energy.step, energy.total_steps, energy.seconds_per_step) == (175, 4680, 2.0)
    assert energy.seconds_left == (4680 - 175) * 2.0 and energy.last_log_age_s == pytest.approx(120)
    assert got["supervised"].step == 50 and got["supervised"].seconds_left == 950 * 0.5

    lines = progress.report(list(got.values())).splitlines()
    assert lines[0].endswith("done: kNN 82.49, linear 83.48, fine-tune 81.23, pretrained in 40 min")
    assert "measured with {'pretrain_samples': 180000" in lines[1]
    assert "step 175 of 4680 (4%); 2.00 s/step, about 2.5 h of pretraining left" in lines[2]
    assert "last logged 2 min ago" in lines[2]
    assert "kNN and linear probe" in lines[3] and "last logged 3.0 h ago" in lines[4]
    assert lines[-1] == "1 of 6 runs done"


def test_a_resumed_run_without_a_time_and_a_folder_before_its_first_log(tmp_path):
    _result(tmp_path, "mlomae", FULL, knn_top1=81.18, pretrain_seconds=float("nan"))
    run = tmp_path / "mae" / "seed0" / "pretrain"
    run.mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"total_steps": 4680}))
    done, started = (progress.entry_status(tmp_path, e, 0, FULL, now=NOW) for e in ("mlomae", "mae"))
    assert progress.describe(done).endswith("done: kNN 81.18")  # no "pretrained in nan"
    assert (started.stage, started.step, started.seconds_left) == ("pretraining", 0, None)
    assert progress.describe(started).endswith("step 0 of 4680 (0%)")


def test_study_status_reads_the_preset_budget_and_needs_no_shards(tmp_path, capsys):
    _result(tmp_path, "mae", FULL, knn_top1=82.49)
    _result(tmp_path, "mixedae", {**FULL, "eval_epochs": [1]}, knn_top1=80.0)
    assert study(["--preset", "full", "--seeds", "0", "--only", "mae,mixedae,energy", "--out", str(tmp_path),
                  "--shards", str(tmp_path / "none"), "--status"]) == []
    lines = capsys.readouterr().out.splitlines()
    assert "mae" in lines[0] and lines[0].endswith("done: kNN 82.49")
    assert "done, other budget" in lines[1] and "not started" in lines[2]
    assert lines[3] == "1 of 3 runs done"


def test_a_result_cut_short_is_refused_in_one_line_naming_it(tmp_path, capsys):
    _result(tmp_path, "mae", FULL, knn_top1=82.49)
    cut = tmp_path / "mae" / "seed0" / "result.json"
    cut.write_text(cut.read_text()[:20])  # a write cut short
    with pytest.raises(SystemExit) as status:
        study(["--preset", "full", "--seeds", "0", "--only", "mae", "--out", str(tmp_path), "--status"])
    err = capsys.readouterr().err
    assert status.value.code == 2 and len(err.splitlines()) == 1
    assert f"{cut} is not readable JSON (a write cut short): delete it and the entry reruns" in err


def test_the_step_time_is_the_median_of_the_last_logged_steps_not_the_first(tmp_path):
    # five slow warm-up steps (compilation), then five at 2 s: the rate now is the last five's median
    times = [10, 10, 10, 10, 10, 2, 2, 2, 2, 2]
    _stage_folder(tmp_path / "mae" / "seed0" / "pretrain", 1000, times)
    s = progress.entry_status(tmp_path, "mae", 0, FULL, now=NOW)
    assert s.seconds_per_step == sorted(times[-progress.RECENT_STEPS:])[2] == 2
    assert s.seconds_left == (1000 - 250) * 2


def test_a_pretrained_entry_that_started_fine_tuning_is_fine_tuning_not_evaluating(tmp_path):
    # study.run_entry: pretrain/encoder.safetensors stays once fine-tuning has begun
    (tmp_path / "mae" / "seed0" / "pretrain").mkdir(parents=True)
    (tmp_path / "mae" / "seed0" / "pretrain" / "encoder.safetensors").write_bytes(b"")
    _stage_folder(tmp_path / "mae" / "seed0" / "finetune", 500, [0.5, 0.5])
    s = progress.entry_status(tmp_path, "mae", 0, FULL, now=NOW)
    assert (s.stage, s.step, s.total_steps) == ("fine-tuning", 50, 500)
