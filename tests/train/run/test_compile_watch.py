"""train/run/compile_watch.py: the log steps of a compiled run report the graphs the first steps
compiled, and warn only about graphs compiled after them (a recompile)."""
import logging

from torch._dynamo.utils import counters

from train.run.compile_watch import CompileWatch


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_reads_without_new_graphs_report_once_and_warn_of_no_recompile(caplog, monkeypatch):
    monkeypatch.setitem(counters["stats"], "unique_graphs", 4)  # compiled before the run's watch started
    caplog.set_level(logging.INFO, logger="pretrain")
    watch = CompileWatch()
    assert [watch.read(step, quiet=False) for step in (1, 2, 3)] == [{"compiled_graphs": 0}] * 3
    assert warnings_in(caplog) == []
    assert [r.getMessage().startswith("run.compile: 0 block graphs compiled in") for r in caplog.records] == [True]


def test_a_graph_compiled_after_the_first_read_is_a_warning_naming_the_steps(caplog, monkeypatch):
    monkeypatch.setitem(counters["stats"], "unique_graphs", 0)
    caplog.set_level(logging.INFO, logger="pretrain")
    watch = CompileWatch()
    counters["stats"]["unique_graphs"] = 3  # the first steps' graphs
    assert watch.read(1, quiet=False) == {"compiled_graphs": 3}
    assert watch.read(5, quiet=False) == {"compiled_graphs": 3}
    counters["stats"]["unique_graphs"] = 5  # two more before step 9
    assert watch.read(9, quiet=False) == {"compiled_graphs": 5}
    assert watch.read(13, quiet=False) == {"compiled_graphs": 5}
    assert len(warnings_in(caplog)) == 1
    assert warnings_in(caplog)[0].startswith("run.compile: 2 block graphs compiled between steps 5 and 9, after")
