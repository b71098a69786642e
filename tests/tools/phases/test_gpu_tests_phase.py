"""tools/phases/gpu_tests.py (the `tests` phase) on its GPU branch, with the pretraining command,
its metrics and pytest stood in: the engines' "decreasing" judgement, resume equality within its
tolerance, and the junit summary's counts."""
import subprocess
import types

import pytest

JUNIT = """<testsuites><testsuite name="pytest">
<testcase classname="tests.a" name="test_pass"/>
<testcase classname="tests.a" name="test_fail"><failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.a" name="test_fail_too"><failure message="assert 3 == 4">trace</failure></testcase>
<testcase classname="tests.b" name="test_error"><error message="fixture blew up">trace</error></testcase>
<testcase classname="tests.b" name="test_skip"><skipped message="needs a CUDA GPU"/></testcase>
</testsuite></testsuites>"""


@pytest.fixture(autouse=True)
def no_collection(monkeypatch):
    """free_memory's gc.collect after every item (~0.4 s each in the suite's heap) frees nothing here."""
    import tools.gpu_check
    from tools.phases import gpu_tests

    for module in (tools.gpu_check, gpu_tests):
        monkeypatch.setattr(module, "free_memory", lambda: None)


def test_the_junit_summary_counts_passes_failures_errors_and_skips_apart(tmp_path):
    from tools.phases.gpu_tests import junit_summary

    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    assert junit_summary(path) == {
        "passed": 1, "failed": 2, "errors": 1, "skipped": 1,  # two failures against one error: not mixed up
        "failures": [{"test": "tests.a::test_fail", "message": "assert 1 == 2"},
                     {"test": "tests.a::test_fail_too", "message": "assert 3 == 4"},
                     {"test": "tests.b::test_error", "message": "fixture blew up"}],
        "skip_reasons": {"needs a CUDA GPU": 1}}
    assert "error" in junit_summary(tmp_path / "none.xml")


def _engine_losses(n: int) -> list[float]:
    """Falling on the whole (the first fifth's mean 1.9 > the last fifth's 1.1) though the first
    point is a low outlier below the last: a noisy loss, judged on fifths, not on two points."""
    return [0.5] + [2.0 - (s / (n - 1)) for s in range(1, n)]


def _run_phase(tmp_path, monkeypatch, resumed_off_by: float):
    """The phase's GPU branch: every run's metrics made up by its folder's name; the resumed run's
    losses after the checkpoint off by `resumed_off_by` (relative)."""
    import train.run.command
    import train.run.folder
    from tools.gpu_check import Check
    from tools.phases import gpu_tests

    calls = []

    def metrics(run):
        if run.name == "straight" or run.name == "resumed":
            off = resumed_off_by if run.name == "resumed" else 0.0
            return [{"step": s, "loss": (1.0 / s) * (1 + off if s > 10 else 1)} for s in range(1, 21)]
        return [{"step": s + 1, "loss": x, "loss_scale": 1024.0} for s, x in enumerate(_engine_losses(50))]

    def pytest_run(cmd, timeout, env=None):
        junit = next(a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml="))
        open(junit, "w").write(JUNIT)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(train.run.command, "main", lambda argv: calls.append(argv))
    monkeypatch.setattr(train.run.folder, "read_metrics", metrics)
    check = Check("tests", tmp_path, smoke=False, deadline=float("inf"), work=tmp_path / "work", log=tmp_path / "log")
    check.work.mkdir()
    check.cuda = True
    check.run = pytest_run
    gpu_tests.run(check, types.SimpleNamespace())
    return check, calls


@pytest.mark.parametrize("off, ok", [(0.05, False), (1e-3, True)])
def test_resume_equality_holds_within_one_percent_of_the_loss(tmp_path, monkeypatch, off, ok):
    check, calls = _run_phase(tmp_path, monkeypatch, off)
    resume = check.record["items"]["resume_equality"]
    assert resume["checkpoint_at"] == 10 and resume["compared_steps"] == 10  # the steps after the checkpoint
    assert resume["max_rel_loss_diff"] == pytest.approx(off) and resume["ok"] is ok
    assert not resume["bitwise_equal"]
    resumed = [argv for argv in calls if "resumed" in argv[argv.index("--output_dir") + 1]]
    assert "--run.max_steps" in resumed[0] and resumed[1][resumed[1].index("--resume") + 1] == "auto"


def test_an_engine_s_loss_is_judged_decreasing_on_its_first_and_last_fifths(tmp_path, monkeypatch):
    check, _ = _run_phase(tmp_path, monkeypatch, 0.0)
    items = check.record["items"]
    losses = _engine_losses(50)
    for name in ("engine_fp16_zero2", "engine_bf16_zero1", "engine_bf16_zero2"):
        engine = items[name]
        assert engine["mean_first_fifth"] == pytest.approx(sum(losses[:10]) / 10)
        assert engine["mean_last_fifth"] == pytest.approx(sum(losses[-10:]) / 10)
        assert engine["decreasing"] and engine["ok"] and engine["steps"] == 50
    assert items["resume_equality"]["ok"] and items["resume_equality"]["bitwise_equal"]
    summary = check.record["summary"]["pytest_gpu"]
    assert (summary["passed"], summary["failed"], summary["errors"], summary["skipped"]) == (1, 2, 1, 1)


def _gpu_phase(tmp_path, monkeypatch, metrics, command=lambda argv: None):
    """The phase's GPU branch with the pretraining command (`command`) and its metrics (`metrics`,
    by the run folder) stood in, and pytest answering with an empty suite."""
    import train.run.command
    import train.run.folder
    from tools.gpu_check import Check
    from tools.phases import gpu_tests

    monkeypatch.setattr(train.run.command, "main", command)
    monkeypatch.setattr(train.run.folder, "read_metrics", metrics)
    check = Check("tests", tmp_path, smoke=False, deadline=float("inf"), work=tmp_path / "work", log=tmp_path / "log")
    check.work.mkdir()
    check.cuda = True
    check.run = lambda cmd, timeout, env=None: subprocess.CompletedProcess(cmd, 0)
    gpu_tests.run(check, types.SimpleNamespace())
    return check.record["items"]


def test_an_engine_that_logged_fewer_steps_than_asked_is_not_ok(tmp_path, monkeypatch):
    """Finite and falling, but 30 of the 50 steps asked: the run stopped early (or logged short)."""
    items = _gpu_phase(tmp_path, monkeypatch, lambda run: [{"step": s, "loss": 2.0 - s / 30} for s in range(1, 31)])
    for name in ("engine_fp16_zero2", "engine_bf16_zero1", "engine_bf16_zero2"):
        engine = items[name]
        assert engine["finite"] and engine["decreasing"] and engine["steps"] == 30 and engine["ok"] is False


def test_resume_equality_needs_every_step_after_the_checkpoint(tmp_path, monkeypatch):
    """The resumed run logged steps 11-15 of 11-20, each equal to the straight run's: 5 steps
    compared of 10 is not a resume shown equal."""
    def metrics(run):
        last = {"straight": 20, "resumed": 15}.get(run.name, 50)
        return [{"step": s, "loss": 1.0 / s} for s in range(1, last + 1)]

    resume = _gpu_phase(tmp_path, monkeypatch, metrics)["resume_equality"]
    assert resume["compared_steps"] == 5 and resume["max_rel_loss_diff"] == 0.0 and resume["ok"] is False


def test_each_engine_runs_the_precision_and_zero_stage_it_is_named_for(tmp_path, monkeypatch):
    """What the ds_config each run was given asks for, read from the file itself."""
    import json
    from pathlib import Path

    ran = {}

    def command(argv):
        ds = json.loads(Path(argv[argv.index("--ds_config") + 1]).read_text())
        precision = "fp16" if ds["fp16"]["enabled"] else "bf16" if ds["bf16"]["enabled"] else "fp32"
        ran[Path(argv[argv.index("--output_dir") + 1]).name] = (precision, ds["zero_optimization"]["stage"])

    items = _gpu_phase(tmp_path, monkeypatch, lambda run: [{"step": s, "loss": 2.0 - s / 50} for s in range(1, 51)],
                       command)
    assert ran == {"fp16_zero2": ("fp16", 2), "bf16_zero1": ("bf16", 1), "bf16_zero2": ("bf16", 2),
                   "straight": ("bf16", 1), "resumed": ("bf16", 1)}
    assert [items[f"engine_{n}"]["precision"] for n in ("fp16_zero2", "bf16_zero1", "bf16_zero2")] == [
        "fp16", "bf16", "bf16"]
