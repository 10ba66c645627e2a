"""Rank processes: each traced rank runs apart, so that its failure stays its own.

A rank runs in a forked child by default (:func:`run_forked`): a crash, an out-of-memory kill,
a timeout or leaked global state ends only that child, and the batch records the error.
:func:`run_inline` runs it in this process and isolates Python exceptions only.  Either way
the rank's output and log records go to its own log file.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import sys
import time
import traceback
from contextlib import ExitStack, contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from megatron_dynapipe.interrupts import default_signals, held_while_forking, interrupted
from megatron_dynapipe.tracer.batch_results import error_line

__all__ = ["PRELOAD_MODULES", "preload_tracer_modules", "rank_start_method", "run_forked", "run_forked_many",
           "run_inline", "finish_log"]

log = logging.getLogger(__name__)


#: Modules the fake-rank tracer imports lazily; imported once in the parent before any rank is
#: forked, so that no child pays seconds for them again (their import warnings stay out of the
#: rank logs too).  A missing one is skipped: this is a warm-up, not a dependency list.
PRELOAD_MODULES = (
    "torch.testing._internal.distributed.fake_pg",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
    "megatron.core.transformer.module",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron_dynapipe.compat.cpu_compat",
)


def preload_tracer_modules() -> float:
    """Import :data:`PRELOAD_MODULES` now (quietly); returns the seconds it took."""
    import importlib
    import warnings

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD_MODULES:
            try:
                importlib.import_module(name)
            except Exception as error:  # optional warm-up: the tracer reports real problems
                log.debug("not preloaded %s: %s", name, error)
    return time.perf_counter() - start


@contextmanager
def _rank_logging(stream) -> Any:
    """Send this process's log records to ``stream`` (the rank's log) while the rank runs."""
    root = logging.getLogger()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    old_level = root.level
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def run_inline(work: Callable[[], dict], log_path: Path) -> dict[str, Any]:
    """Run ``work`` here, its output and log records going to ``log_path``."""
    with open(log_path, "a", buffering=1) as stream, ExitStack() as stack:
        stack.enter_context(redirect_stdout(stream))
        stack.enter_context(redirect_stderr(stream))
        stack.enter_context(_rank_logging(stream))
        try:
            return {"ok": True, **work()}
        except Exception as error:  # isolate: the batch goes on
            traceback.print_exc(file=stream)
            return {"ok": False, "error": error_line(error)}


def _child_main(work: Callable[[], dict], conn, log_path: Path) -> None:
    """Body of a forked rank process: output to the log, result down the pipe."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    default_signals()
    logging.getLogger().handlers.clear()
    with _rank_logging(sys.stderr):
        try:
            result = {"ok": True, **work()}
        except BaseException as error:  # the parent records it; nothing escapes this process
            traceback.print_exc()
            result = {"ok": False, "error": error_line(error)}
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(result)
    conn.close()


def rank_start_method() -> str:
    """How rank processes start: forked from this process (its imports are already warm), unless
    this torch sees a CUDA device.  A forked child cannot use CUDA ("Cannot re-initialize CUDA in
    forked subprocess") once its parent has so much as counted the GPUs, and on an H100 ranks
    forked from a forkserver that had imported megatron-core failed the same way; so there each
    rank starts as a fresh interpreter (spawn), paying its own imports."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return "spawn"
    return "fork"


NOTED_POLL_S = 0.5  # how often the wait for ranks looks for a noted interrupt


def run_forked(work: Callable[[], dict], log_path: Path, timeout: float | None,
               start_method: str = "fork") -> dict[str, Any]:
    """Run ``work`` in a child process so that a crash, a kill or leaked global state stays
    there (``work`` must pickle unless ``start_method`` is "fork")."""
    for _, outcome, _ in run_forked_many([(work, log_path)], 1, timeout, start_method):
        return outcome
    raise AssertionError("unreachable: one job gives one outcome")


def run_forked_many(jobs: Sequence[tuple[Callable[[], dict], Path]], parallel: int,
                    timeout: float | None, start_method: str = "fork") -> Iterator[tuple[int, dict[str, Any], float]]:
    """Run each ``(work, log_path)`` of ``jobs`` in its own child, at most ``parallel`` at once;
    yields ``(index, outcome, seconds)`` as each ends (a child that cannot even start fails at
    once, alone).  ``timeout`` bounds each child from its start.
    Closing the generator early (Ctrl-C included) kills the children still running."""
    import multiprocessing
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context(start_method)
    waiting = list(enumerate(jobs))[::-1]
    running: dict[int, _Child] = {}
    try:
        while waiting or running:
            while waiting and len(running) < max(1, parallel):
                index, (work, log_path) = waiting.pop()
                try:
                    running[index] = _Child.start(ctx, work, log_path, timeout)
                except Exception as error:  # e.g. fork failed, or work does not pickle for a spawn
                    yield index, {"ok": False, "error": f"cannot start the rank process: {error_line(error)}"}, 0.0
            if not running:
                continue
            ready = wait([c.receive for c in running.values()] + [c.process.sentinel for c in running.values()],
                         timeout=_next_wake(running.values()))
            if interrupted() is not None:  # its KeyboardInterrupt may have been swallowed (at fork, say)
                raise KeyboardInterrupt
            for index, child in list(running.items()):
                outcome = child.outcome_if_done(ready)
                if outcome is not None:
                    del running[index]
                    yield index, outcome, time.monotonic() - child.started
    finally:
        for child in running.values():
            child.kill()


def _next_wake(children) -> float:
    """Seconds until the first child's deadline, and at most :data:`NOTED_POLL_S`: an interrupt whose
    KeyboardInterrupt was swallowed is only noted, and this loop must look."""
    deadlines = [c.deadline for c in children if c.deadline is not None]
    return min([NOTED_POLL_S] + [max(0.0, d - time.monotonic()) for d in deadlines])


class _Child:
    """One rank's process and the pipe its result comes down."""

    def __init__(self, process, receive, timeout: float | None) -> None:
        self.process, self.receive, self.timeout = process, receive, timeout
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout

    @classmethod
    def start(cls, ctx, work, log_path: Path, timeout: float | None) -> "_Child":
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_child_main, args=(work, send, log_path), daemon=True)
        try:
            with held_while_forking():
                process.start()
        except BaseException:
            receive.close()
            raise
        finally:
            send.close()
        return cls(process, receive, timeout)

    def outcome_if_done(self, ready) -> dict[str, Any] | None:
        """The child's outcome if it reported, died or ran out of time; else None."""
        if self.receive in ready or self.process.sentinel in ready:
            return self._collect()
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.kill()
            return {"ok": False, "error": f"timed out after {self.timeout:g} s (rank process killed)"}
        return None

    def _collect(self) -> dict[str, Any]:
        try:
            if self.receive.poll():
                return self.receive.recv()
        except EOFError:
            pass  # died before sending: reported from the exit code below
        finally:
            self.process.join(10)
            if self.process.is_alive():  # reported, but stuck on its way out
                self.kill()
            self.receive.close()
        code = self.process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            hint = " (out of memory?)" if -code == signal.SIGKILL else ""
            return {"ok": False, "error": f"rank process died of {name}{hint}"}
        return {"ok": False, "error": f"rank process exited with code {code} before reporting"}

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.receive.close()


def finish_log(tmp: Path, final: Path, lines: Sequence[str]) -> None:
    with open(tmp, "a") as f:
        for line in lines:
            f.write(line + "\n")
    os.replace(tmp, final)
