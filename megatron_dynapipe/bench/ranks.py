"""Benchmark ranks: local processes in one torch.distributed job, results back to the caller."""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["launch", "time_alternating"]


def launch(fn: Callable, world_size: int, *args, timeout: float, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes of one
    ``backend`` process group (over a TCPStore on 127.0.0.1); their results in rank order.
    A rank that fails, dies or outlives ``timeout`` seconds raises RuntimeError here, and the
    other ranks are killed (nothing waits on a dead peer)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    procs = [ctx.Process(target=_child, args=(fn, rank, world_size, store.port, backend, args, results),
                         daemon=True) for rank in range(world_size)]
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    try:
        for proc in procs:
            proc.start()
        while len(out) < world_size:
            try:
                rank, ok, body = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"benchmark ranks {dead or 'all'} died or timed out") from None
                continue
            if not ok:
                raise RuntimeError(f"benchmark rank {rank} failed:\n{body}")
            out[rank] = pickle.loads(body)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        del store
    return [out[r] for r in range(world_size)]


def _child(fn, rank, world_size, port, backend, args, results) -> None:
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def time_alternating(runs: dict[str, Callable[[], Any]], *, warmup: int, steps: int, rank: int,
                     before_each: Callable[[], None], synchronize: Callable[[], None] = lambda: None):
    """Run every ``runs[name]()`` once per step, ``warmup`` untimed steps and then ``steps``
    timed ones, rotating which goes first each step so that drift in the machine's load hits all
    alike. Each run starts after ``before_each()`` and a barrier and ends at the barrier after it
    (``synchronize()`` on either side waits for the device). Returns the seconds of each timed
    step per name and each name's result of the last step. Rank 0 reports progress on stderr."""
    import sys

    import torch.distributed as dist

    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    results: dict[str, Any] = {}
    for i in range(warmup + steps):
        first = i % len(names)
        for name in names[first:] + names[:first]:
            before_each()
            dist.barrier()
            synchronize()
            started = time.perf_counter()
            results[name] = runs[name]()
            synchronize()
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - started)
        if rank == 0:  # stdout keeps the result
            warm = " (warm-up, untimed)" if i < warmup else ""
            print(f"step {i + 1} of {warmup + steps}{warm}: every method ran", file=sys.stderr, flush=True)
    return times, results
