"""train/run/folder.py reads files an earlier run (or someone else) left in the output folder:
metrics.jsonl and config.json nested too deep for json (a RecursionError, not a ValueError) are
treated as the malformed files they are."""
import json
import logging

from train.run.folder import (Reporter, check_run_folder, foreign_config, metric_rows, never_trained, other_run,
                              set_aside_unsaved_attempt)

DEEP_LINE = "[" * 100_000 + "]" * 100_000


def test_a_metrics_line_nested_too_deep_is_dropped_like_a_line_cut_short(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2)) + DEEP_LINE + "\n")
    rows, cut = metric_rows(path)
    assert [r["step"] for r in rows] == [1, 2] and cut == 1
    with caplog.at_level(logging.WARNING):
        Reporter(tmp_path, start_step=2, stop_step=4, tensorboard=False, progress=False).close()
    assert f"{path}: 1 line(s) that are no complete JSON record dropped" in caplog.text
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_config_json_nested_too_deep_is_not_a_runs_config(tmp_path):
    (tmp_path / "config.json").write_text(DEEP_LINE)
    assert foreign_config(tmp_path, {"optim": {}}) == "holds a config.json that is not readable JSON (nested too deep)"
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")  # a run trained there
    assert other_run(tmp_path, {"optim": {}}) == "holds a run whose config.json is not readable JSON (nested too deep)"


def strict_json(line: str):
    """json.loads refusing NaN and Infinity, which JSON does not have (JavaScript's JSON.parse fails on them)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_a_nonfinite_value_is_written_as_null_and_old_lines_are_rewritten_so(tmp_path):
    """A window without a finite loss logs NaN: metrics.jsonl holds null there, strict JSON; a line an
    older run wrote with NaN is rewritten as null when a resume cuts the file back."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": NaN, "lr": 0.1}\n{"step": 2, "loss": 1.0}\n')
    reporter = Reporter(tmp_path, start_step=1, stop_step=4, tensorboard=False, progress=False)
    reporter.log(2, {"loss": float("nan"), "images_per_s": float("inf"), "nonfinite_losses": 4, "lr": 0.1})
    reporter.log_eval(2, {"eval_top1": 50.0})
    reporter.close()
    rows = [strict_json(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": 1, "loss": None, "lr": 0.1},
                    {"step": 2, "loss": None, "images_per_s": None, "nonfinite_losses": 4, "lr": 0.1},
                    {"step": 2, "eval_top1": 50.0}]


def test_tensorboard_holds_each_step_once_after_a_resume_and_evaluations_under_eval(tmp_path):
    """The interrupted run logged steps 1-5, its checkpoint is step 3: the resumed run's steps 4 and 5
    replace the old ones in TensorBoard too (purge_step), as in metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = Reporter(tmp_path, start_step=0, stop_step=10, tensorboard=True, progress=False)
    for step in range(1, 6):
        first.log(step, {"loss": float(step), "images_per_s": 1.0})
    first.log_eval(2, {"eval_top1": 20.0})
    first.close()
    resumed = Reporter(tmp_path, start_step=3, stop_step=10, tensorboard=True, progress=False)
    for step in (4, 5):
        resumed.log(step, {"loss": 10.0 + step, "images_per_s": 1.0})
    resumed.log_eval(5, {"eval_top1": 50.0})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/eval_top1", "train/images_per_s", "train/loss"]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0),
                                                                        (5, 15.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/eval_top1")] == [(2, 20.0), (5, 50.0)]


def test_a_run_whose_metrics_hold_only_blank_lines_never_trained(tmp_path):
    """A metrics.jsonl with no line of text records no logged step: the folder's run never trained,
    while one real line (and no checkpoint) means it did."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n")
    assert never_trained(tmp_path, [])
    metrics.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert not never_trained(tmp_path, [])


def _logged_steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _events_files(folder) -> list:
    return sorted(folder.glob("events.out.tfevents.*"))


def test_a_start_from_step_0_sets_an_unsaved_attempts_records_aside_and_says_so(tmp_path, caplog):
    """An attempt killed before its first checkpoint logged steps 1-10 (metrics.jsonl, tb/, an
    evaluation): the next start, at step 0, keeps them in earlier_attempts/1/ and writes its own
    beside them, rather than cutting metrics.jsonl to nothing and adding a second events file to tb/."""
    killed = Reporter(tmp_path, start_step=0, stop_step=20, tensorboard=True, progress=False)
    for step in range(1, 11):
        killed.log(step, {"loss": float(step), "images_per_s": 1.0})
    killed.close()
    (tmp_path / "eval.json").write_text(json.dumps({"step": 10, "eval_top1": 20.0}))
    with caplog.at_level(logging.WARNING):
        again = Reporter(tmp_path, start_step=0, stop_step=20, tensorboard=True, progress=False)
    kept = tmp_path / "earlier_attempts" / "1"
    assert (f"output_dir {tmp_path} holds no complete checkpoint, so training starts at step 0; the earlier attempt "
            f"there (steps 1-10 logged) keeps its metrics.jsonl, tb/, eval.json in {kept}") in caplog.text
    for step in range(1, 4):
        again.log(step, {"loss": 100.0 + step, "images_per_s": 1.0})
    again.close()
    assert _logged_steps(kept / "metrics.jsonl") == list(range(1, 11))
    assert _logged_steps(tmp_path / "metrics.jsonl") == [1, 2, 3]
    assert len(_events_files(kept / "tb")) == 1 and len(_events_files(tmp_path / "tb")) == 1
    assert json.loads((kept / "eval.json").read_text())["eval_top1"] == 20.0 and not (tmp_path / "eval.json").exists()
    assert not never_trained(tmp_path, [])  # records worth keeping: not cleared as a failed start's
    Reporter(tmp_path, start_step=0, stop_step=20, tensorboard=False, progress=False).close()  # killed again
    assert _logged_steps(tmp_path / "earlier_attempts" / "2" / "metrics.jsonl") == [1, 2, 3]
    assert _logged_steps(kept / "metrics.jsonl") == list(range(1, 11))


def test_a_resume_auto_of_a_run_killed_before_its_first_checkpoint_starts_at_0_and_keeps_its_logs(tmp_path):
    """The run killed after step 5 (its first checkpoint due at 100) left steps 1-4 logged: --resume
    auto finds nothing to resume, says so, and trains steps 1-3 with the attempt's logs kept aside."""
    from conftest import run_pretrain

    killed = run_pretrain(tmp_path, "--run.max_steps", "8", "--run.ckpt_every", "100", faults="after_step@5",
                          check=False)
    assert killed.returncode != 0 and _logged_steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]
    proc = run_pretrain(tmp_path, "--resume", "auto", "--run.max_steps", "3", "--run.ckpt_every", "100")
    kept = tmp_path / "earlier_attempts" / "1"
    assert (f"output_dir {tmp_path} holds no complete checkpoint, so training starts at step 0; the earlier attempt "
            f"there (steps 1-4 logged) keeps its metrics.jsonl, tb/ in {kept}") in proc.stderr
    assert _logged_steps(tmp_path / "metrics.jsonl") == [1, 2, 3]
    assert _logged_steps(kept / "metrics.jsonl") == [1, 2, 3, 4]
    assert len(_events_files(tmp_path / "tb")) == 1 and len(_events_files(kept / "tb")) == 1


def test_an_evaluation_line_shows_counts_as_integers(tmp_path, capsys):
    reporter = Reporter(tmp_path, start_step=0, stop_step=4, tensorboard=False, progress=True)
    reporter.log_eval(4, {"eval_top1": 75.0, "eval_top5": 100.0, "eval_samples": 10000, "eval_listed": 10000,
                          "eval_skipped_undecodable_image": 2})
    reporter.close()
    said = capsys.readouterr()
    assert ("step 4: eval_top1 75.00, eval_top5 100.00, eval_samples 10000, eval_listed 10000, "
            "eval_skipped_undecodable_image 2") in said.out + said.err


def test_a_start_that_died_before_logging_keeps_the_earlier_attempts_records(tmp_path):
    """The second start died before its first logged step: the folder holds its config.json and the
    first attempt's records in earlier_attempts/1/, no metrics.jsonl and no checkpoint. The next
    start's folder check must not clear the folder as a never-trained one: the kept records survive."""
    config = {"seed": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    kept = tmp_path / "earlier_attempts" / "1"
    kept.mkdir(parents=True)
    (kept / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.3}) + "\n")
    assert not never_trained(tmp_path, [])
    check_run_folder(tmp_path, config, None, overwrite=False)
    assert _logged_steps(kept / "metrics.jsonl") == [1]


def test_a_metrics_file_holding_only_a_line_cut_short_is_set_aside_at_a_start_from_0(tmp_path):
    """An attempt killed while writing its first line left half a record and its TensorBoard events:
    no whole step logged, yet the events are an attempt's records, kept aside rather than mixed
    with the new run's."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.3')
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out").write_text("x")
    Reporter(tmp_path, start_step=0, stop_step=10, tensorboard=False, progress=False).close()
    kept = tmp_path / "earlier_attempts" / "1"
    assert (kept / "tb" / "events.out").read_text() == "x" and not (tmp_path / "tb").exists()
    assert (kept / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.3'


def test_an_attempt_is_kept_after_the_highest_numbered_one_when_earlier_ones_were_deleted(tmp_path):
    """earlier_attempts/1 was deleted by hand and 2 kept: the next attempt goes to 3, next to 2,
    not into a number already taken."""
    (tmp_path / "earlier_attempts" / "2").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.3}) + "\n")
    kept = set_aside_unsaved_attempt(tmp_path, [{"step": 1}])
    assert kept == tmp_path / "earlier_attempts" / "3"
    assert _logged_steps(kept / "metrics.jsonl") == [1]
