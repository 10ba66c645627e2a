"""Timing benchmark methods side by side on local ranks."""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["time_alternating"]


def time_alternating(runs: dict[str, Callable[[], Any]], *, warmup: int, steps: int, rank: int,
                     before_each: Callable[[], None], synchronize: Callable[[], None] = lambda: None,
                     after_round: "Callable[[], None] | None" = None):
    """Run every ``runs[name]()`` once per step, ``warmup`` untimed steps and then ``steps``
    timed ones, rotating which goes first each step so that drift in the machine's load hits all
    alike. Each run starts after ``before_each()`` and a barrier and ends at the barrier after it
    (``synchronize()`` on either side waits for the device); ``after_round()``, where given, runs
    after every timed step's runs, followed by a barrier. Returns the seconds of each timed step
    per name and each name's result of the last step. Rank 0 reports progress on stderr."""
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
        if after_round is not None and i >= warmup:
            after_round()
            dist.barrier()
        if rank == 0:  # stdout keeps the result
            warm = " (warm-up, untimed)" if i < warmup else ""
            print(f"step {i + 1} of {warmup + steps}{warm}: every method ran", file=sys.stderr, flush=True)
    return times, results
