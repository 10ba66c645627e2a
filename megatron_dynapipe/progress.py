"""A rich progress bar for long work, drawn only where someone watches (a terminal)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any

__all__ = ["progress_bar", "progress_enabled"]


class _NoProgress:
    def add_task(self, *args, **kwargs) -> int:
        return 0

    def update(self, *args, **kwargs) -> None:
        pass

    def advance(self, *args, **kwargs) -> None:
        pass

    def remove_task(self, *args, **kwargs) -> None:
        pass


@contextmanager
def progress_bar(enabled: bool, stream) -> Any:
    if not enabled:
        yield _NoProgress()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=stream)
    if not console.is_terminal:
        yield _NoProgress()
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # What else writes to stderr meanwhile (megatron-core's warnings, log records) is printed above
    # the bar instead of through it.
    with Progress(*columns, console=console, redirect_stdout=False, redirect_stderr=True,
                  transient=True) as bar:
        yield bar


def progress_enabled(requested: bool, stream=None) -> bool:
    """A progress bar is drawn only when asked for and ``stream`` (stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(requested and callable(isatty) and isatty())
