"""Time and memory of one forward and backward, on CUDA or on the CPU.

Times: CUDA events on a GPU, the wall clock on the CPU; warm-up runs first, then the median of
``repeats`` runs, with their spread.  Memory, in bytes: on CUDA the caching allocator's counters
(exact); on the CPU, which keeps no counters, the bytes of every tensor that operations create,
counted while they are alive (:class:`LiveBytes`).

*Stored* is what stays allocated from the end of the forward until the backward runs (the
layer's output included: it is the next layer's input).  *Peak* is the most allocated on top of
that, at any moment of the forward or of the backward (temporaries, re-materialised activations,
activation gradients).
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Timing", "Memory", "time_step", "time_once", "backward_of_ones", "measure_memory", "LiveBytes",
           "is_out_of_memory", "unless_out_of_memory", "steady_cpu_allocator"]


@dataclass(frozen=True)
class Timing:
    """Median milliseconds of a forward and of its backward over the repeats, and their spreads
    (max - min, ms)."""

    forward_ms: float
    backward_ms: float
    forward_spread_ms: float
    backward_spread_ms: float


@dataclass(frozen=True)
class Memory:
    stored_bytes: int
    peak_bytes: int


Step = Callable[[], torch.Tensor]  # runs a forward, returns what backward starts from
MAX_REPEATS = 50


def steady_cpu_allocator() -> None:
    """Make this process's CPU timings independent of what it allocated before.

    glibc serves a block from its heap only once a block of that size has been freed (its mmap
    threshold rises with them, up to 32 MB); until then every such allocation maps fresh pages and
    faults them in.  So the same layer at the same shape timed 7 ms or 12 ms depending on whether a
    larger micro-batch had run earlier, and a step's time hung on the order of the steps before
    it.  A fixed threshold (and no trimming) takes the history out; elsewhere than glibc this does
    nothing."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    for option, value in ((_M_MMAP_THRESHOLD, 2**30), (_M_TRIM_THRESHOLD, 2**30), (_M_TOP_PAD, 2**28)):
        mallopt(option, value)


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # mallopt's options (malloc.h)


def backward_of_ones(out: torch.Tensor) -> None:
    """The backward of a step's output from a gradient of ones."""
    out.backward(torch.ones_like(out))


def time_step(forward: Step, device: torch.device, *, warmup: int = 1, repeats: int = 3, min_time_ms: float = 0.0,
              max_repeats: int = MAX_REPEATS) -> Timing:
    """Time ``forward()`` and the backward of its result (a gradient of ones): ``repeats`` timed
    runs, and more (up to ``max_repeats``) until they add up to ``min_time_ms``, since a median
    of three runs of a few milliseconds is at the mercy of the machine's jitter."""
    for _ in range(warmup):
        backward_of_ones(forward())
    fwd, bwd = [], []
    while len(fwd) < repeats or (sum(fwd) + sum(bwd) < min_time_ms and len(fwd) < max_repeats):
        f, b = time_once(forward, device)
        fwd.append(f)
        bwd.append(b)
    return Timing(statistics.median(fwd), statistics.median(bwd), max(fwd) - min(fwd), max(bwd) - min(bwd))


def time_once(forward: Step, device: torch.device) -> tuple[float, float]:
    """One run of ``forward()`` and the backward of its result: their ms."""
    return _time_cuda(forward) if device.type == "cuda" else _time_wall(forward)


def _time_wall(forward: Step) -> tuple[float, float]:
    start = time.perf_counter()
    out = forward()
    middle = time.perf_counter()
    backward_of_ones(out)
    return (middle - start) * 1e3, (time.perf_counter() - middle) * 1e3


def _time_cuda(forward: Step) -> tuple[float, float]:
    start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize()
    start.record()
    out = forward()
    middle.record()
    backward_of_ones(out)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(middle), middle.elapsed_time(end)


def measure_memory(forward: Step, device: torch.device) -> Memory:
    """Stored and peak bytes of one forward and backward (module docstring)."""
    if device.type == "cuda":
        return _memory_cuda(forward)
    with LiveBytes() as live:
        base = live.now
        out = forward()
        stored = live.now - base
        forward_peak = live.peak
        live.peak = live.now
        backward_of_ones(out)
        backward_peak = live.peak
    return Memory(stored, max(forward_peak, backward_peak) - base - stored)


def _memory_cuda(forward: Step) -> Memory:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = forward()
    torch.cuda.synchronize()
    stored = torch.cuda.memory_allocated() - base
    backward_of_ones(out)
    torch.cuda.synchronize()
    return Memory(stored, max(0, torch.cuda.max_memory_allocated() - base - stored))


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors that operations create while they are alive.

    A tensor's storage is counted once, when an operation first returns it, and released when
    that tensor is collected.  Views share their base's storage and are not counted again; a view
    that outlives its base is released with the base (so the count can run a little low, never
    high).  Recomputation inside a backward is counted too: the autograd engine carries the mode.
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self._live: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._live or storage.nbytes() == 0:
            return
        self._live.add(key)
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._release, key, storage.nbytes())

    def _release(self, key: int, nbytes: int) -> None:
        if key in self._live:
            self._live.discard(key)
            self.now -= nbytes


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item)


def unless_out_of_memory(device: torch.device, measure: Callable[[], Any]) -> Any:
    """``measure()``, or None when the device runs out of memory (an infeasible point: the
    allocator's cache is emptied for what comes next)."""
    try:
        return measure()
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the device running out of memory (an infeasible point, not a crash)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())
