"""Run a function on N local processes joined by one torch.distributed process group.

    from megatron_dynapipe.local_ranks import run_local_ranks

    def work(rank, world_size, x):          # module level, so that it pickles by reference
        ...                                  # torch.distributed is initialised
        return something_picklable

    results = run_local_ranks(work, 2, x, timeout=60)   # [rank 0's result, rank 1's]

The one way this package starts local ranks: ``bench step``, ``bench executor``, ``calibrate``,
the benchmarks and the test suite.  The parent hosts the rendezvous store on a port the OS picks
(no race for a free port) and is not a rank; each child joins it, initialises the process group
(gloo, or NCCL with one GPU each) with short timeouts, runs ``fn(rank, world_size, *args,
**kwargs)`` and sends back its result (plain pickle, so tensors are copied, not shared through file
descriptors of a process that is about to exit).  If a rank raises, the others are killed and
:class:`LocalRanksError` carries that rank's traceback (the first failure reported first); if a
rank dies without a word or the ranks are not all done within ``timeout`` seconds, they are all
killed and it says which.  Nothing ever waits on a dead peer.

Children start with ``spawn`` (forking after torch's threads exist is unsafe, and a forked child
cannot use CUDA once its parent has) and share the cores: each takes the parent's thread count
(``OMP_NUM_THREADS``, ``torch.set_num_threads``), at most ``cores // world_size``, so that ranks run
with the threads a profile made in the parent's settings was measured with.  Each also takes the
parent's warning filters (a spawned interpreter starts from the defaults), so what the parent
silenced stays silent on its ranks.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable

__all__ = ["LocalRanksError", "run_local_ranks"]

_HOST = "127.0.0.1"
_GRACE_S = 1.0  # after a first failure, how long to wait for the other ranks' reports


class LocalRanksError(RuntimeError):
    """A rank failed, died or did not finish in time; ``raised`` holds, by rank, the exceptions
    the ranks raised that pickle (what a caller may act on; the message has every traceback)."""

    def __init__(self, message: str, raised: "dict[int, BaseException] | None" = None):
        super().__init__(message)
        self.raised = dict(raised or {})


def run_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60,
                    backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks of one ``backend``
    process group; the per-rank results in rank order (module docstring).  ``fn``, its arguments
    and its results must pickle."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    payload = pickle.dumps((fn, args, kwargs))
    filters = _warning_filters()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    deadline = time.monotonic() + timeout
    store = dist.TCPStore(_HOST, 0, None, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    pg_timeout_s = max(5.0, min(60.0, timeout / 2))
    threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // world_size))
    procs = [ctx.Process(target=_child, args=(rank, world_size, store.port, backend, payload, results, pg_timeout_s,
                                              threads, filters),
                         name=f"local-rank{rank}", daemon=True) for rank in range(world_size)]
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        for proc in procs:
            proc.start()
        values, errors = _collect(procs, results, deadline)
        problem = _problem(name, world_size, procs, values, {rank: text for rank, (text, _) in errors.items()},
                           timeout)
        if problem:
            raised = {rank: _unpickled(error) for rank, (_, error) in errors.items()}
            raise LocalRanksError(problem, {rank: error for rank, error in raised.items() if error is not None})
        return [values[rank] for rank in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join(timeout=5)
        results.close()
        results.join_thread()
        del store


def _warning_filters() -> list[tuple]:
    """This process's warning filters as ``warnings.filterwarnings`` takes them, those that pickle
    (a category the children cannot import is left behind)."""
    kept = []
    for action, message, category, module, lineno in warnings.filters:
        entry = (action, _pattern(message), category, _pattern(module), lineno)
        try:
            pickle.dumps(entry)
        except Exception:
            continue
        kept.append(entry)
    return kept


def _pattern(field) -> str:
    """A filter's message or module as text: compiled by ``filterwarnings``, a string or None where
    set otherwise."""
    return getattr(field, "pattern", field) or ""


def _child(rank, world_size, port, backend, payload, results, pg_timeout_s, threads, filters) -> None:
    import torch
    import torch.distributed as dist

    warnings.resetwarnings()
    for action, message, category, module, lineno in filters:
        warnings.filterwarnings(action, message, category, module, lineno, append=True)
    try:
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        fn, args, kwargs = pickle.loads(payload)
        store = dist.TCPStore(_HOST, port, None, is_master=False, timeout=timedelta(seconds=pg_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        message = (rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs)))
    except BaseException as error:  # report everything, including SystemExit / KeyboardInterrupt
        message = (rank, False, (traceback.format_exc(), _pickled(error)))
    # Report before tearing the group down: a failing rank's own traceback should reach the
    # parent before its peers' "connection closed" errors that the teardown provokes.
    results.put(message)
    if dist.is_initialized():
        dist.destroy_process_group()


def _pickled(error: BaseException) -> "bytes | None":
    try:
        return pickle.dumps(error)
    except Exception:  # an exception holding what does not pickle: its traceback says enough
        return None


def _unpickled(data: "bytes | None") -> "BaseException | None":
    try:
        return None if data is None else pickle.loads(data)
    except Exception:  # an exception class that does not rebuild from its arguments
        return None


def _collect(procs, results, deadline) -> tuple[dict[int, Any], dict[int, str]]:
    """Read reports until every rank has one, the deadline passes, or a grace period after the
    first failure (a raised error, or a rank that exited without a report) runs out."""
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    failed_at = None
    while len(values) + len(errors) < len(procs):
        now = time.monotonic()
        if now >= deadline or (failed_at is not None and now - failed_at >= _GRACE_S):
            break
        try:
            rank, ok, body = results.get(timeout=min(0.1, deadline - now))
        except queue.Empty:
            exited = any(proc.exitcode is not None and rank not in values and rank not in errors
                         for rank, proc in enumerate(procs))
            if exited and failed_at is None:
                failed_at = now  # its report may still be in flight: wait the grace period
            continue
        if ok:
            values[rank] = pickle.loads(body)
        else:
            errors[rank] = body
            failed_at = failed_at if failed_at is not None else now
    return values, errors


def _problem(name, world_size, procs, values, errors, timeout) -> "str | None":
    """What went wrong, rank by rank (None when every rank returned)."""
    silent = {rank: proc.exitcode for rank, proc in enumerate(procs)
              if rank not in values and rank not in errors and proc.exitcode is not None}
    running = sorted(set(range(world_size)) - set(values) - set(errors) - set(silent))
    if not (errors or silent or running):
        return None
    parts = [f"{name} failed on rank {rank}:\n{body}" for rank, body in errors.items()]
    if silent:
        parts.append(f"{name}: rank(s) {sorted(silent)} exited without a result (exit codes {silent})")
    if running and not errors and not silent:
        parts.append(f"{name} on {world_size} ranks did not finish within {timeout}s (ranks still running: {running})")
    elif running:
        parts.append(f"(ranks {running} were still running and have been killed)")
    return "\n".join(parts)
