"""Long work is never silent: a bar on a terminal, plain lines elsewhere, on a clock the test turns."""

import io

from megatron_dynapipe import progress
from megatron_dynapipe.profiling.cli import GridProgress


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_without_a_terminal_progress_is_a_line_every_interval_and_one_at_the_end():
    out, clock = io.StringIO(), Clock()
    lines = progress._ProgressLines(out, every=30.0, clock=clock)
    task = lines.add_task("simulating layouts", total=5)
    for step in range(4):  # 20 s apart: a line once 30 s have passed since the last
        clock.now += 20
        lines.advance(task)
    clock.now += 1
    lines.advance(task)  # the last: said at once
    lines.advance(task)  # past the end: nothing more
    # with what is left at the pace so far: 3 more at 20 s each, then 1 more
    assert out.getvalue().splitlines() == ["simulating layouts: 2/5 (40 s, about 1 min 0 s left)",
                                           "simulating layouts: 4/5 (1 min 20 s, about 20 s left)",
                                           "simulating layouts: 5/5 (1 min 21 s)"]


def test_the_profile_progress_prints_lines_when_stderr_is_a_file():
    out, clock = io.StringIO(), Clock()
    with progress.progress_bar(True, out) as bar:
        assert isinstance(bar, progress._ProgressLines)
        bar.clock = clock
        grid = GridProgress(bar, bar.add_task("profile", total=87), expected=87)
        clock.now += 31
        grid("tp 1, recompute none, seqlen 512", 12)
        grid("tp 1, recompute none, seqlen 1024", 3)  # within 30 s of the last line
        clock.now += 200
        grid.finish()
    assert out.getvalue().splitlines() == ["tp 1, recompute none, seqlen 512: 12/87 (31 s, about 3 min 13 s left)",
                                           "tp 1, recompute none, seqlen 1024: 15/15 (3 min 51 s)"]


def test_the_profiles_own_estimate_is_the_time_left_where_it_gives_one():
    """The profile's points vary a thousandfold in cost, so its own estimate of the grid's time
    (duration.TimeLeft) is shown, not the pace of points so far; without one, the pace is."""
    out, clock = io.StringIO(), Clock()
    lines = progress._ProgressLines(out, every=30.0, clock=clock)
    grid = GridProgress(lines, lines.add_task("profile", total=87), expected=87)
    clock.now += 31
    grid("tp 1 none seq 64 mbs 2", 12, left=400.0)
    clock.now += 31
    grid("tp 1 whole-step overhead", 1)
    assert out.getvalue().splitlines() == ["tp 1 none seq 64 mbs 2: 12/87 (31 s, about 6 min 40 s left)",
                                           # at the pace: 62 s x (87 - 13) / 13 = 353 s
                                           "tp 1 whole-step overhead: 13/87 (1 min 2 s, about 5 min 52 s left)"]


def test_the_terminal_bar_shows_the_profiles_own_estimate():
    import rich.progress

    *_, left_column = columns = progress._columns()
    bar = rich.progress.Progress(*columns, auto_refresh=False)
    task = bar.add_task("profile", total=87)
    bar.update(task, completed=12, left=400.0)
    assert left_column.render(bar.tasks[task]).plain == "0:06:40"
    bar.update(task, completed=13, left=None)
    assert left_column.render(bar.tasks[task]).plain != "0:06:40"  # rich's own, at the pace so far


def test_no_progress_asked_for_prints_nothing():
    out = io.StringIO()
    with progress.progress_bar(False, out) as bar:
        bar.advance(bar.add_task("x", total=1))
    assert out.getvalue() == ""


def test_a_heartbeat_says_the_work_goes_on_until_it_ends():
    import io
    import threading

    from megatron_dynapipe.progress import heartbeat

    stream, said = io.StringIO(), threading.Event()

    class Watched(io.StringIO):
        def write(self, text):
            said.set()
            return stream.write(text)

    with heartbeat("plan", Watched(), every=0.01):
        assert said.wait(60)  # no deadline on the machine's speed: a minute's bound on a 10 ms beat
    lines = stream.getvalue().splitlines()
    assert lines and all(line.startswith("plan: still working (") for line in lines)
    count = len(stream.getvalue())
    said.clear()
    assert not said.wait(0.05) and len(stream.getvalue()) == count  # silent once the block ended


def test_plan_says_up_front_when_it_may_take_minutes(capsys):
    from megatron_dynapipe.cli import _say_when_planning_is_long

    _say_when_planning_is_long(1_000, fast=False)
    assert capsys.readouterr().err == ""
    # the development machine's worst: 100,000 samples in 45 s normal, 25 s fast -> 7.5 and 4.2 minutes a million
    _say_when_planning_is_long(1_000_000, fast=False)
    assert capsys.readouterr().err == ("plan: 1,000,000 samples in normal mode take up to 8 min on a core like "
                                       "the development machine's; --fast-mode takes up to 4 min; Ctrl-C stops it\n")


def test_a_milestone_is_said_at_once_though_the_last_line_was_just_said():
    """A phase of its own (a context-parallel group of the profile) that starts within the interval
    of the last line gets a line then, not up to 30 s later or, where it ends first, never."""
    out, clock = io.StringIO(), Clock()
    lines = progress._ProgressLines(out, every=30.0, clock=clock)
    grid = GridProgress(lines, lines.add_task("profile", total=87), expected=87)
    clock.now += 31
    grid("tp 1 none seq 64 mbs 2", 12, left=60.0)
    clock.now += 5
    grid("tp 1 none seq 64 mbs 4", 1, left=55.0)  # within 30 s of the last line: not said
    grid("tp 1 cp 2: the layer on 2 local ranks (gloo), 9 points", 1, left=41.0, milestone=True)
    assert out.getvalue().splitlines() == ["tp 1 none seq 64 mbs 2: 12/87 (31 s, about 1 min 0 s left)",
                                           "tp 1 cp 2: the layer on 2 local ranks (gloo), 9 points: 14/87 "
                                           "(36 s, about 41 s left)"]
