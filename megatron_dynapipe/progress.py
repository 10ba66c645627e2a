"""Progress of long work: a rich bar on a terminal, and elsewhere (a log file, a pipe, a batch
job's output) a plain line now and then, so that long work is never silent."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable

__all__ = ["progress_bar", "progress_enabled", "heartbeat", "LINE_EVERY_SECONDS"]

LINE_EVERY_SECONDS = 30.0  # a log reader sees life twice a minute, and a long run's log stays short


class _NoProgress:
    def add_task(self, *args, **kwargs) -> int:
        return 0

    def update(self, *args, **kwargs) -> None:
        pass

    def advance(self, *args, **kwargs) -> None:
        pass

    def remove_task(self, *args, **kwargs) -> None:
        pass


class _ProgressLines:
    """rich's Progress calls, answered with one line a task at most every ``every`` seconds, one
    when the task completes, and one for each update marked ``milestone`` (a phase of its own,
    which may take minutes, starts: it is said at once, not up to ``every`` seconds late or never):
    "profile: 12/87 (2 min 10 s, about 13 min left)", what is left at the pace so far (as rich's
    bar shows it), or the caller's own estimate (``left=`` seconds)."""

    def __init__(self, stream, every: float = LINE_EVERY_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.stream, self.every, self.clock = stream, every, clock
        self.tasks: dict[int, dict] = {}

    def add_task(self, description: str, total: "float | None" = None, completed: float = 0, **_) -> int:
        task = len(self.tasks)
        now = self.clock()
        self.tasks[task] = dict(description=description, total=total, completed=completed, started=now,
                                said=now, ended=False)
        return task

    def update(self, task: int, *, description=None, total=None, completed=None, advance=None, left=None,
               milestone=False, **_) -> None:
        state = self.tasks.get(task)
        if state is None:
            return
        state["left"] = left
        for key, value in (("description", description), ("total", total), ("completed", completed)):
            if value is not None:
                state[key] = value
        if advance is not None:
            state["completed"] += advance
        self._say(state, milestone)

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, advance=advance)

    def remove_task(self, task: int) -> None:
        self.tasks.pop(task, None)

    def _say(self, state: dict, milestone: bool = False) -> None:
        now = self.clock()
        complete = state["total"] is not None and state["completed"] >= state["total"]
        if state["ended"] or not (complete or milestone or now - state["said"] >= self.every):
            return
        state["said"], state["ended"] = now, complete
        total = "" if state["total"] is None else f"/{state['total']:g}"
        elapsed, left = now - state["started"], ""
        if state.get("left") is not None and not complete:
            left = f", about {_elapsed(state['left'])} left"
        elif state["total"] is not None and 0 < state["completed"] < state["total"]:
            left = f", about {_elapsed(elapsed * (state['total'] / state['completed'] - 1))} left"
        print(f"{state['description']}: {state['completed']:g}{total} ({_elapsed(elapsed)}{left})",
              file=self.stream, flush=True)


def _elapsed(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


@contextmanager
def progress_bar(enabled: bool, stream) -> Any:
    """A bar where ``stream`` is a terminal; progress lines every LINE_EVERY_SECONDS where it is
    not; nothing where progress was not asked for (``enabled`` False)."""
    if not enabled:
        yield _NoProgress()
        return
    from rich.console import Console
    from rich.progress import Progress

    console = Console(file=stream)
    if not console.is_terminal:
        yield _ProgressLines(stream)
        return
    # What else writes to stderr meanwhile (megatron-core's warnings, log records) is printed above
    # the bar instead of through it.
    with Progress(*_columns(), console=console, redirect_stdout=False, redirect_stderr=True,
                  transient=True) as bar:
        yield bar


def _columns() -> tuple:
    """The bar's columns: what it does, the bar, done of total, time taken, and time left, at the
    pace so far or the caller's own estimate (``left=`` seconds: a profile's points vary a
    thousandfold in cost, so the pace of points misleads)."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.text import Text

    class TimeLeftColumn(TimeRemainingColumn):
        def render(self, task):
            left = task.fields.get("left")
            if left is None or task.finished:
                return super().render(task)
            minutes, seconds = divmod(int(left), 60)
            hours, minutes = divmod(minutes, 60)
            return Text(f"{hours}:{minutes:02d}:{seconds:02d}", style="progress.remaining")

    return TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeLeftColumn()


@contextmanager
def heartbeat(description: str, stream, every: float = LINE_EVERY_SECONDS):
    """A line on ``stream`` every ``every`` seconds while the block runs ("plan: still working
    (1 min 0 s)"), for work that cannot count its own steps: long work is never silent."""
    stop, started = threading.Event(), time.monotonic()

    def beat() -> None:
        while not stop.wait(every):
            print(f"{description}: still working ({_elapsed(time.monotonic() - started)})", file=stream, flush=True)

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def progress_enabled(requested: bool, stream=None) -> bool:
    """A progress bar is drawn only when asked for and ``stream`` (stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(requested and callable(isatty) and isatty())
