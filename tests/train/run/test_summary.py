"""train/run/summary.py: the line that ends a run's log takes its throughput from the windows the loop
logged: an interrupted run's steps after its last logged window have no time counted, so they are not
counted as images either."""
import re

from train.run.summary import RunSummary


def images_per_s(line: str) -> int:
    return int(re.search(r", (\d+) images/s over the run", line).group(1))


def test_no_line_before_a_window_was_logged():
    assert RunSummary(0, 64).line(3) is None


def test_throughput_counts_the_logged_steps_over_their_own_time():
    """Windows logged at steps 5 (2 s a step) and 10 (1 s a step), then stopped after step 13:
    64 images a step over steps 1-10 in 15 s; steps 11-13 were never timed."""
    summary = RunSummary(0, 64)
    summary.add(5, {"step_time": 2.0, "loss": 1.5, "skipped_steps": 0})
    summary.add(10, {"step_time": 1.0, "loss": 1.25, "skipped_steps": 1})
    line = summary.line(13)
    assert line.startswith("trained steps 1-13 in ")
    assert images_per_s(line) == round(64 * 10 / (5 * 2.0 + 5 * 1.0))  # 43, not 64 * 13 / 15 = 55
    assert "loss 1.25 (last window)" in line and line.endswith("1 skipped step(s)")


def test_a_resumed_run_counts_from_the_step_it_resumed_at():
    summary = RunSummary(100, 8)
    summary.add(104, {"step_time": 0.5, "loss": 2.0, "skipped_steps": 0})
    summary.add(110, {"step_time": 0.25, "loss": 1.0, "skipped_steps": 0})
    line = summary.line(112)
    assert line.startswith("trained steps 101-112 in ")
    assert images_per_s(line) == round(8 * 10 / (4 * 0.5 + 6 * 0.25))  # 23, not 8 * 12 / 3.5 = 27
