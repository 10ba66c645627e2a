"""Ctrl-C and SIGTERM, taken alike by every command.

Each raises KeyboardInterrupt where it lands, so a command stops the way it stops for Ctrl-C:
what finished is kept and says so, nothing half-done reads as complete. Each is also *noted*,
because the KeyboardInterrupt can land where it is swallowed (a hook that runs at fork while a rank
starts) and the work go on; the command line then still exits as the shell reports a command
stopped by that signal (128 + its number: 130 for Ctrl-C, 143 for SIGTERM), never 0.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Callable, Iterator, Optional

__all__ = ["INTERRUPTS", "noted_interrupts", "interrupted", "exit_code", "exit_status", "default_signals",
           "held_while_forking", "worker_pool"]

INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
_noted: list[int] = []


def _note(signum, frame) -> None:
    _noted.append(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def noted_interrupts() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt and are noted while this runs (on the main thread;
    elsewhere signals are not delivered to Python anyway). What is noted lasts as long as this does:
    outside it :func:`interrupted` is None."""
    _noted.clear()
    previous = {}
    try:
        for signum in INTERRUPTS:
            previous[signum] = signal.signal(signum, _note)
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _noted.clear()


def default_signals() -> None:
    """In a child process: Ctrl-C and SIGTERM end it quietly, whatever handlers (and, from
    :func:`held_while_forking`, mask) it inherited (its parent says what was interrupted)."""
    for signum in INTERRUPTS:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)


@contextlib.contextmanager
def held_while_forking() -> Iterator[None]:
    """Ctrl-C and SIGTERM held back while a child process starts: raised in a hook that runs at fork,
    the KeyboardInterrupt would be printed with a traceback and dropped; held, the signal arrives
    right after, where it stops the work. The child must call :func:`default_signals`."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def worker_pool(context, workers: int, initializer: Callable = default_signals, initargs: tuple = ()):
    """``context.Pool(workers, initializer, initargs)`` with its workers started under
    :func:`held_while_forking` (``initializer`` must call :func:`default_signals`). The pool's exit
    sends SIGTERM to a worker that may still be starting; landing in a fork hook, it was dropped,
    and the pool then waited on that worker forever. Held, it ends the worker once it starts."""
    with held_while_forking():
        return context.Pool(workers, initializer=initializer, initargs=initargs)


def interrupted() -> Optional[int]:
    """The last interrupting signal noted while :func:`noted_interrupts` runs, or None."""
    return _noted[-1] if _noted else None


def exit_code(signum: int = signal.SIGINT) -> int:
    """What a shell reports for a command that ``signum`` stopped."""
    return 128 + int(signum)


def exit_status(command: Callable[[], int]) -> int:
    """A command's exit status: what ``command()`` returns, unless an interrupt came while it ran
    (noted, as the module docstring says), then the signal's. A KeyboardInterrupt that reaches here
    stops a command that keeps nothing."""
    with noted_interrupts():
        try:
            code = command()
        except KeyboardInterrupt:
            print("megatron-dynapipe: interrupted", file=sys.stderr)
            code = exit_code(signal.SIGINT)
        signum = interrupted()
    return code if signum is None else exit_code(signum)
