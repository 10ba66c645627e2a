"""Links between local ranks, timed and fitted: the one measurement ``megatron-dynapipe calibrate``
makes of every collective and the profiler makes of the link a pipeline's transfers cross.

Each op runs after a barrier; its time is the slower rank's (an all-reduce of the maxima), the
median of ``repeats`` after one warm-up, every rank timing the same ops (nothing adapts to the
times seen, so no rank waits on another for ever).  Per kind, latency and bandwidth are fitted to
the points by least squares on the relative error (:func:`fit_link`), under the cost formula of
:mod:`megatron_dynapipe.hardware`.

The profiler's link (:func:`measure_link`, ``metadata.link`` of a profile): two local ranks of the
profiled device -- gloo on the CPU, NCCL on two GPUs -- exchanging 4 KiB to 16 MiB.  One GPU cannot
host two NCCL ranks: there the profile records no link, and the planner prices transfers at the
default (docs/cost_model.md).  torch is imported where it runs, not here: ``calibrate`` is part
of ``simulate``, whose commands start without it.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from typing import TYPE_CHECKING, Optional

import numpy as np

from megatron_dynapipe.hardware import ring_terms
from megatron_dynapipe.local_ranks import run_local_ranks
from megatron_dynapipe.planning.cost_model.link import Link

if TYPE_CHECKING:
    import torch

__all__ = ["KINDS", "SIZES", "measure_link", "link_backend", "measure_p2p", "time_kinds", "time_op", "fit_link",
           "device_and_sync"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
SIZES = [4096 << k for k in range(0, 13, 2)]  # the profiler's: 4 KiB .. 16 MiB
REPEATS = 9


def link_backend(device: "torch.device", ranks: int = 2) -> Optional[str]:
    """The backend ``ranks`` local ranks of ``device``'s kind talk over, or None where they cannot
    run (NCCL wants a GPU each)."""
    import torch

    if device.type != "cuda":
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= ranks else None


def measure_link(backend: str) -> dict:
    """``metadata.link`` of a profile: the link between two local ranks of ``backend``
    (:func:`link_backend`), fitted, and how it was measured."""
    link = measure_p2p(backend, SIZES, repeats=REPEATS, timeout=300.0)
    return {"bandwidth_GBps": float(link.bandwidth_GBps), "latency_us": float(link.latency_us), "backend": backend,
            "sizes_bytes": SIZES, "repeats": REPEATS}


def measure_p2p(backend: str, sizes: list[int], *, repeats: int = 5, timeout: float = 600.0) -> Link:
    """The link between two local ranks: their ``p2p`` timed at ``sizes`` and fitted."""
    points = run_local_ranks(time_kinds, 2, ("p2p",), sizes, repeats, timeout=timeout, backend=backend)[0]
    return fit_link("p2p", points["p2p"], 2)


def device_and_sync():
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return device, torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def time_kinds(rank: int, world: int, kinds, sizes: list[int], repeats: int, say: bool = False):
    """``{kind: [(bytes, seconds)]}`` of each of ``kinds`` at every size."""
    device, sync = device_and_sync()
    points: dict[str, list[tuple[int, float]]] = {}
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*is deprecated")  # megatron-core calls it too
    for kind in kinds:
        points[kind] = [(size, time_op(kind, size, rank, world, device, repeats, sync)) for size in sizes]
        if say:
            print(f"calibrate: {kind} timed at {len(sizes)} sizes", file=sys.stderr, flush=True)
    return points


def time_op(kind: str, size: int, rank: int, world: int, device, repeats: int, sync) -> float:
    import torch
    import torch.distributed as dist

    numel = max(size // 4 // world * world, world)  # float32 elements, divisible by the group
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // world, device=device)
    partner = rank ^ 1

    def op() -> None:
        if kind == "all_reduce":
            dist.all_reduce(full)
        elif kind == "all_gather":
            dist.all_gather_into_tensor(full, shard)
        elif kind == "reduce_scatter":
            dist.reduce_scatter_tensor(shard, full)
        elif kind == "all_to_all":
            dist.all_to_all_single(full.clone(), full)
        elif partner < world:  # p2p: pairs (0, 1), (2, 3), ... exchange at once, as pipeline stages do
            ops = [dist.P2POp(dist.isend, full, partner), dist.P2POp(dist.irecv, full.clone(), partner)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()

    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        dist.barrier()
        sync()
        started = time.perf_counter()
        op()
        sync()
        slowest = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if i:
            times.append(float(slowest.item()))
    return statistics.median(times)


def fit_link(kind: str, points: list[tuple[int, float]], n: int) -> Link:
    """The latency and bus bandwidth that best explain ``points`` ((bytes, seconds)) of ``kind``
    over ``n`` ranks, on relative error; neither goes negative.  The all-reduce is fitted as a
    ring (what gloo and NCCL run at the sizes that matter) and pinned to it."""
    steps, factor = ring_terms(kind, n)
    sizes = np.array([s for s, _ in points], dtype=float)
    times = np.array([t * 1e6 for _, t in points], dtype=float)
    design = np.stack([np.full_like(sizes, steps), factor * sizes], axis=1) / times[:, None]
    (alpha, per_byte), *_ = np.linalg.lstsq(design, np.ones_like(times), rcond=None)
    if per_byte <= 0:  # latency explains everything: bandwidth as the largest point allows
        per_byte = max(float(np.min(times / (factor * sizes))), 1e-12) * 1e-3
        alpha = float(np.median((times - per_byte * factor * sizes) / steps))
    elif alpha < 0:
        alpha = 0.0
        per_byte = float(np.sum(factor * sizes / times) / np.sum((factor * sizes / times) ** 2))
    return Link(bandwidth_GBps=1.0 / (per_byte * 1e3), latency_us=max(float(alpha), 0.0),
                algorithm="ring" if kind == "all_reduce" else "auto")
