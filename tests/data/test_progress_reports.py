"""data/progress.py: a bar on a terminal; in a log, a line at least every 30 s and a last one."""
import io

from data.progress import Progress, mapped


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_a_line_every_30_s_and_a_last_one():
    out, clock = io.StringIO(), Clock()
    with Progress("verifying", total=100, unit="shards", stream=out, clock=clock) as p:
        for _ in range(100):
            clock.now += 1.0  # one shard a second: 100 s in all
            p.update()
    lines = out.getvalue().splitlines()
    assert lines[0] == "verifying: 30/100 shards (30%), 30 s, about 70 s left"
    assert [line.split(":")[1].split()[0] for line in lines] == ["30/100", "60/100", "90/100", "100/100"]
    assert lines[-1] == "verifying: 100/100 shards (100%), 100 s"
    assert "\r" not in out.getvalue()


def test_quick_work_says_nothing_and_a_resumed_count_leaves_the_rate_alone():
    out, clock = io.StringIO(), Clock()
    with Progress("kNN", total=10, stream=out, clock=clock) as p:
        p.update(10)
    assert out.getvalue() == ""
    p = Progress("training", total=1000, unit="steps", stream=out, clock=clock, initial=500)
    clock.now = 40.0
    p.set_postfix(loss="0.5")
    p.update(100)  # 100 steps in 40 s: the 400 left take 160 s, whatever the 500 before
    assert out.getvalue().strip() == "training: 600/1000 steps (60%), 40 s, about 2.7 min left, loss 0.5"


def test_a_terminal_gets_a_bar():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    with Progress("writing train shards", total=4, unit="shards", stream=out) as p:
        p.update(4)
    assert out.getvalue().startswith("\rwriting train shards:   0%|") and "0/4 [" in out.getvalue()  # tqdm's bar


def test_mapped_keeps_the_order_in_one_process_or_several():
    assert mapped(abs, [-3, 1, -2], 1, "x") == mapped(abs, [-3, 1, -2], 2, "x") == [3, 1, 2]
