"""Record every compute and communication op a rank issues while megatron-core trains.

How it hooks in
---------------
**Communication.**  megatron-core calls torch's collectives through module attributes:
``torch.distributed.all_reduce(...)`` (mappings, finalize_model_grads, DDP buffers),
``torch.distributed.P2POp(torch.distributed.isend, ...)`` + ``batch_isend_irecv`` (p2p), and
a few names bound at import (``dist_all_gather_func = torch.distributed.all_gather_into_tensor``
in mappings/layers/param_and_grad_buffer, ``from torch.distributed import _coalescing_manager``).
:meth:`Recorder.install` replaces each wrapped function in ``torch.distributed``, in
``torch.distributed.distributed_c10d`` (so torch's own identity checks, e.g. ``op.op is isend``
in ``batch_isend_irecv``, still hold) and in every loaded ``megatron.*`` module that bound it by
name; :meth:`Recorder.uninstall` puts every original back.  Wrapping at the Python API (rather
than the ``ProcessGroup`` methods underneath) sees the arguments megatron passed: the group,
the global peer, the tensors whose shape and dtype give the bytes.  A collective issued from
inside another wrapped call (the isends inside ``batch_isend_irecv``) is not recorded twice.

**Compute.**  The schedules call ``forward_step``, ``backward_step`` and
``forward_step_calc_loss`` through module globals of ``megatron.core.pipeline_parallel.schedules``,
so wrapping those three names records one op per micro-batch forward, backward and loss, with the
micro-batch index the schedule itself passes (``current_microbatch``); megatron-core's
schedules (no pipelining, 1F1B, interleaved) all call these names; under interleaving the op
also records the model chunk the schedule passes (``vp_stage``).  Module forward/backward hooks would see
every layer but not the micro-batch, and a backward hook cannot bracket a whole backward pass;
the schedule functions are exactly the units a pipeline simulator replays.  Regions that are not
schedule steps (the optimizer step, gradient finalisation) are marked by the caller with
:meth:`Recorder.compute` and :meth:`Recorder.region`.

Durations
---------
``clock="wall"`` (CPU): ``time.perf_counter_ns`` around each op.  ``clock="cuda_events"``: a
pair of CUDA events around each op, resolved after each iteration (``torch.cuda.synchronize``);
for an asynchronous collective that is the launch, not the transfer.  ``clock="cost_model"``
(shapes-only): compute durations come from ``cost_fn(kind, microbatch, chunk)`` (milliseconds), comm
durations are 0, and ``start_us`` is a serial replay clock (each compute op starts when the
previous one ends), not a measurement.

Fake process groups
-------------------
With torch's fake backend collectives return at once and receive buffers keep whatever was in
memory.  ``fill=True`` makes each collective leave the values a job would have if every peer
were this rank (all-reduce SUM multiplies by the group size, all-gather repeats the local input,
reduce-scatter keeps the local chunk, all-to-all cycles the local rows, receives get
seeded normal noise), so forward passes stay finite and data-dependent code (MoE routing
counts) sees consistent, deterministic numbers.  ``execute=False`` does not call the backend at
all (used with meta tensors, which the backends cannot take).

Memory
------
See :class:`ActivationMeter` and :meth:`Recorder.memory`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_dynapipe.compat.patching import Patches
from megatron_dynapipe.tracer.trace_format import TraceOp

__all__ = ["ActivationMeter", "Recorder", "WRAPPED_COLLECTIVES", "storage_key", "tensor_bytes"]


# ---------------------------------------------------------------------------------------------
# small helpers


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def storage_key(t: torch.Tensor) -> tuple[int, Any]:
    """An id of the storage ``t`` views (shared by all its views; works for meta tensors), and
    the object that keeps it alive: an id is unique only while its storage lives, so whoever keeps
    ids must keep that object too (a freed storage's address is soon reused)."""
    try:
        storage = t.untyped_storage()
        return storage._cdata, storage
    except Exception:  # tensor subclasses without a plain storage
        return id(t), t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


class _DoneWork:
    """What a collective returns when the backend was not called: already complete."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        return None

    def result(self) -> list:
        return []

    def get_future(self):
        future = torch.futures.Future()
        future.set_result([])
        return future


class _DoneCoalesced:
    """Stand-in for ``_coalescing_manager``'s handle when the backend is not called."""

    def __init__(self) -> None:
        self.works: list = []

    def append(self, work) -> None:
        self.works.append(work)

    def wait(self) -> None:
        return None


_SKIP_FRAME_PREFIXES = ("torch", "contextlib", "functools", __name__)


def _call_site() -> str:
    """``module.function`` of the innermost caller outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(_SKIP_FRAME_PREFIXES):
            return f"{module.rsplit('.', 1)[-1]}.{frame.f_code.co_name}"
        frame = frame.f_back
    return ""


# ---------------------------------------------------------------------------------------------
# what each wrapped collective looks like


@dataclass(frozen=True)
class _Spec:
    kind: str  # op kind in the trace
    style: str  # how to read its arguments (see Recorder._describe)


#: torch.distributed function -> (trace kind, argument style).
WRAPPED_COLLECTIVES: dict[str, _Spec] = {
    "all_reduce": _Spec("all_reduce", "inplace"),
    "broadcast": _Spec("broadcast", "rooted"),
    "reduce": _Spec("reduce", "rooted"),
    "all_gather": _Spec("all_gather", "gather_list"),
    "all_gather_into_tensor": _Spec("all_gather", "gather_tensor"),
    "_all_gather_base": _Spec("all_gather", "gather_tensor"),
    "reduce_scatter": _Spec("reduce_scatter", "scatter_list"),
    "reduce_scatter_tensor": _Spec("reduce_scatter", "scatter_tensor"),
    "_reduce_scatter_base": _Spec("reduce_scatter", "scatter_tensor"),
    "all_to_all_single": _Spec("all_to_all", "a2a_single"),
    "all_to_all": _Spec("all_to_all", "a2a_list"),
    "barrier": _Spec("barrier", "barrier"),
    "send": _Spec("send", "p2p"),
    "recv": _Spec("recv", "p2p"),
    "isend": _Spec("isend", "p2p"),
    "irecv": _Spec("irecv", "p2p"),
    "batch_isend_irecv": _Spec("batch_isend_irecv", "batch"),
}



# ---------------------------------------------------------------------------------------------
# activation memory


class ActivationMeter:
    """Activation bytes a rank holds, counted from what autograd saves for backward.

    Around each micro-batch forward a ``saved_tensors_hooks`` pair sees every tensor autograd
    keeps for the backward pass; the bytes of their distinct storages (parameters, gradient
    buffers and optimizer state excluded: they are registered with :meth:`set_static`) are that
    micro-batch's activations, held until its backward finishes.  ``peak_bytes`` is the largest
    sum over forward passes in flight at once (1F1B keeps up to ``pp - stage`` micro-batches;
    interleaving counts each micro-batch once per model chunk it has passed).
    Transient buffers that are freed within the forward or the backward, and tensors a custom
    autograd function stashes on ``ctx`` without ``save_for_backward``, are not counted.
    Works on meta tensors (it reads sizes, not data).
    """

    def __init__(self) -> None:
        self.static: dict[int, Any] = {}  # storage id -> the storage, kept alive with its id
        self.live = 0
        self.peak_bytes = 0
        self.peak_in_flight = 0
        self.per_microbatch: dict[Any, int] = {}
        self.enabled = True

    def set_static(self, tensors) -> None:
        for t in tensors:
            if _is_tensor(t):
                key, storage = storage_key(t)
                self.static[key] = storage

    def reset(self) -> None:
        self.live = 0
        self.peak_bytes = 0
        self.peak_in_flight = 0
        self.per_microbatch.clear()

    @contextlib.contextmanager
    def forward(self, key) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        seen: dict[int, Any] = {}  # as static: held until the forward ends, so no id is reused
        total = [0]

        def pack(t):
            k, storage = storage_key(t)
            if k not in self.static and k not in seen:
                seen[k] = storage
                try:
                    total[0] += t.untyped_storage().nbytes()
                except Exception:
                    total[0] += tensor_bytes(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.per_microbatch[key] = self.per_microbatch.get(key, 0) + total[0]
        self.live += total[0]
        if self.live > self.peak_bytes:
            self.peak_bytes = self.live
        self.peak_in_flight = max(self.peak_in_flight, len(self.per_microbatch))

    def backward_done(self, key) -> None:
        self.live -= self.per_microbatch.pop(key, 0)


# ---------------------------------------------------------------------------------------------
# the recorder


def _binds_collectives(module_name: str) -> bool:
    """The modules whose bindings of collectives and schedule steps the recorder wraps."""
    return module_name in ("torch.distributed", c10d.__name__) or module_name.startswith("megatron.")


class Recorder:
    """Records ops while installed (see the module docstring).

    Ops are kept only inside ``with recorder.iteration(i):``; the patches are in place between
    :meth:`install` and :meth:`uninstall` (or for the ``with recorder:`` block).

    ``stage`` is written into every op; ``clock`` is ``"wall"``, ``"cuda_events"``,
    ``"cost_model"`` or ``"auto"`` (CUDA events when CUDA is available, else wall);
    ``cost_fn(kind, microbatch, chunk) -> ms`` prices compute ops for ``clock="cost_model"``;
    ``fill``/``execute`` control fake process groups (module docstring); ``seed`` seeds the
    noise written into receive buffers when ``fill`` is on; ``track_activations`` turns the
    :class:`ActivationMeter` on; ``hook_schedules=False`` records communication only (and does
    not import megatron-core).
    """

    def __init__(
        self,
        *,
        stage: int = 0,
        clock: str = "auto",
        fill: bool = False,
        execute: bool = True,
        seed: int = 0,
        cost_fn: Optional[Callable[[str, Optional[int], Optional[int]], float]] = None,
        track_activations: bool = True,
        hook_schedules: bool = True,
    ) -> None:
        if clock == "auto":
            clock = "cuda_events" if torch.cuda.is_available() else "wall"
        if clock not in ("wall", "cuda_events", "cost_model"):
            raise ValueError(f"clock must be wall, cuda_events, cost_model or auto, got {clock!r}")
        if clock == "cost_model" and cost_fn is None:
            raise ValueError("clock='cost_model' needs cost_fn(kind, microbatch, chunk) -> milliseconds")
        self.stage = stage
        self.clock = clock
        self.fill = fill
        self.execute = execute
        self.cost_fn = cost_fn
        self.hook_schedules = hook_schedules
        self.ops: list[TraceOp] = []
        self.meter = ActivationMeter()
        self.meter.enabled = track_activations
        self._generator = torch.Generator().manual_seed(seed)
        self._lock = threading.RLock()
        self._local = threading.local()  # per-thread depth of wrapped calls
        self._patches = Patches()
        self._iteration: Optional[int] = None
        self._compute_stack: list[TraceOp] = []
        self._phase_stack: list[str] = []
        self._coalesce_stack: list[int] = []
        self._next_coalesce = 0
        self._forward_count = 0
        # forward passes awaiting their backward, as (micro-batch, model chunk)
        self._pending_backward: dict[int, tuple[Any, tuple]] = {}
        self._fifo: list[tuple] = []
        self._origin_ns: Optional[int] = None
        self._virtual_us = 0.0
        self._events: list[tuple[TraceOp, Any, Any]] = []
        self._origin_event = None
        self._group_cache: dict[int, tuple[Any, tuple[int, ...], Optional[str]]] = {}

    # -- install / uninstall --------------------------------------------------------------------
    def install(self) -> "Recorder":
        with self._lock:
            if self._patches:
                return self
            wrappers: dict[Any, Any] = {}  # original -> wrapper
            for name, spec in WRAPPED_COLLECTIVES.items():
                original = getattr(c10d, name, None)
                if original is not None:
                    wrappers[original] = self._wrap_collective(name, spec, original)
            wrappers[c10d._coalescing_manager] = self._wrap_coalescing(c10d._coalescing_manager)
            if self.hook_schedules:
                import megatron.core.pipeline_parallel.schedules as schedules

                for name, wrap in (("forward_step", self._wrap_forward_step),
                                   ("backward_step", self._wrap_backward_step),
                                   ("forward_step_calc_loss", self._wrap_loss)):
                    original = getattr(schedules, name)
                    wrappers[original] = wrap(original)
            for original, wrapper in wrappers.items():
                wrapper.__recorder_original__ = original
            self._patches.rebind(wrappers, where=_binds_collectives)
        return self

    def uninstall(self) -> None:
        with self._lock:
            self._patches.undo()

    @property
    def installed(self) -> bool:
        return bool(self._patches)

    def __enter__(self) -> "Recorder":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # -- iterations, regions, compute ops -------------------------------------------------------
    @property
    def recording(self) -> bool:
        return self._iteration is not None

    @contextlib.contextmanager
    def iteration(self, index: int, record: bool = True) -> Iterator[None]:
        """One training iteration; ops are kept only when ``record`` is true."""
        self._forward_count = 0
        self._pending_backward.clear()
        self._fifo.clear()
        if record:
            self._iteration = index
            if self._origin_ns is None:
                self._start_clock()
        try:
            yield
        finally:
            self._iteration = None
            if self.clock == "cuda_events" and record:
                self._resolve_cuda_events()

    @contextlib.contextmanager
    def region(self, phase: str) -> Iterator[None]:
        """Ops issued inside get ``phase`` (e.g. ``"finalize_grads"``) unless a compute op
        nested deeper sets its own."""
        self._phase_stack.append(phase)
        try:
            yield
        finally:
            self._phase_stack.pop()

    @contextlib.contextmanager
    def compute(self, kind: str, microbatch: Optional[int] = None, name: str = "",
                chunk: Optional[int] = None) -> Iterator[Optional[TraceOp]]:
        """Record a compute op around the block (if recording); yields the op or None."""
        if not self.recording:
            self._phase_stack.append(kind)
            try:
                yield None
            finally:
                self._phase_stack.pop()
            return
        op = self._new_op("compute", kind, name=name or kind, microbatch=microbatch, chunk=chunk, phase=kind)
        timer = self._begin(op)
        self._compute_stack.append(op)
        self._phase_stack.append(kind)
        try:
            yield op
        finally:
            self._phase_stack.pop()
            self._compute_stack.pop()
            self._end(op, timer)

    def _new_op(self, cat: str, kind: str, **fields) -> TraceOp:
        with self._lock:
            parent = self._compute_stack[-1] if self._compute_stack else None
            if fields.get("phase") is None:
                fields["phase"] = self._phase_stack[-1] if self._phase_stack else None
            if parent is not None and cat == "comm":
                for inherited in ("microbatch", "chunk"):
                    if fields.get(inherited) is None:
                        fields[inherited] = getattr(parent, inherited)
            op = TraceOp(
                seq=len(self.ops),
                iteration=self._iteration if self._iteration is not None else -1,
                stage=self.stage,
                cat=cat,
                kind=kind,
                parent=parent.seq if parent is not None else None,
                coalesced=self._coalesce_stack[-1] if self._coalesce_stack else None,
                **fields,
            )
            self.ops.append(op)
            return op

    # -- clocks -----------------------------------------------------------------------------------
    def _start_clock(self) -> None:
        self._origin_ns = time.perf_counter_ns()
        if self.clock == "cuda_events":
            torch.cuda.synchronize()
            self._origin_event = torch.cuda.Event(enable_timing=True)
            self._origin_event.record()

    def _begin(self, op: TraceOp):
        if self.clock == "wall":
            return time.perf_counter_ns()
        if self.clock == "cuda_events":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        op.start_us = self._virtual_us
        return None

    def _end(self, op: TraceOp, timer) -> None:
        if self.clock == "wall":
            end = time.perf_counter_ns()
            op.start_us = (timer - self._origin_ns) / 1e3
            op.dur_us = (end - timer) / 1e3
        elif self.clock == "cuda_events":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((op, timer, end))
        else:
            ms = self.cost_fn(op.kind, op.microbatch, op.chunk) if op.cat == "compute" else 0.0
            op.dur_us = float(ms or 0.0) * 1e3
            # children of a compute op are priced inside it: only top-level ops move the clock
            if op.parent is None:
                self._virtual_us = max(self._virtual_us, op.start_us + op.dur_us)

    def _resolve_cuda_events(self) -> None:
        torch.cuda.synchronize()
        for op, start, end in self._events:
            op.start_us = self._origin_event.elapsed_time(start) * 1e3
            op.dur_us = start.elapsed_time(end) * 1e3
        self._events.clear()

    # -- groups -----------------------------------------------------------------------------------
    def _group_info(self, group) -> tuple[Any, tuple[int, ...], Optional[str]]:
        if group is None or group is c10d.GroupMember.WORLD:
            group = c10d._get_default_group()
        cached = self._group_cache.get(id(group))
        if cached is not None and cached[0] is group:
            return cached
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        name = getattr(group, "group_desc", None) or None
        if name == "undefined":
            name = None
        info = (group, ranks, name)
        self._group_cache[id(group)] = info
        return info

    # -- communication wrappers -------------------------------------------------------------------
    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _wrap_collective(self, api: str, spec: _Spec, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if self._depth() > 0:  # issued by another wrapped call: already accounted for
                return original(*args, **kwargs)
            if self.execute and not self.fill and not self.recording:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            op = None
            if self.recording:
                op = self._new_op("comm", spec.kind, name=_call_site(), **self._describe(spec, a))
                timer = self._begin(op)
            self._local.depth = self._depth() + 1
            try:
                if self.execute:
                    result = original(*args, **kwargs)
                else:
                    result = self._dry_result(spec, a)
                if self.fill:
                    self._fill(spec, a)
            finally:
                self._local.depth -= 1
            if op is not None:
                self._end(op, timer)
            return result

        return wrapper

    def _wrap_coalescing(self, original: Callable) -> Callable:
        @contextlib.contextmanager
        def coalescing_manager(group=None, device=None, async_ops=False):
            with self._lock:
                cid = self._next_coalesce
                self._next_coalesce += 1
            self._coalesce_stack.append(cid)
            try:
                if self.execute:
                    with original(group, device, async_ops) as cm:
                        yield cm
                else:
                    yield _DoneCoalesced()
            finally:
                self._coalesce_stack.pop()

        functools.update_wrapper(coalescing_manager, original)
        return coalescing_manager

    def _dry_result(self, spec: _Spec, a: dict):
        if spec.style == "batch":
            return [_DoneWork() for _ in a["p2p_op_list"]]
        if spec.kind in ("isend", "irecv"):
            return _DoneWork()
        if spec.kind == "recv":
            return a.get("src")
        return _DoneWork() if a.get("async_op") else None

    def _describe(self, spec: _Spec, a: dict) -> dict[str, Any]:
        style = spec.style
        if style == "batch":
            ops = a["p2p_op_list"]
            _, ranks, gname = self._group_info(ops[0].group if ops else None)
            parts = []
            for p2p in ops:
                fn = getattr(p2p.op, "__recorder_original__", p2p.op)
                kind = "isend" if fn is _ORIGINAL_ISEND or fn is c10d.isend else "irecv"
                t = p2p.tensor
                parts.append({
                    "kind": kind,
                    "peer": int(p2p.peer),
                    "shape": list(t.shape),
                    "dtype": _dtype_name(t.dtype),
                    "bytes": tensor_bytes(t),
                })
            return {
                "group": ranks,
                "group_name": gname,
                "bytes": sum(p["bytes"] for p in parts),
                "parts": parts,
            }
        group, ranks, gname = self._group_info(a.get("group"))
        out: dict[str, Any] = {"group": ranks, "group_name": gname}
        size = len(ranks)
        if style == "inplace":
            t = a["tensor"]
        elif style == "rooted":
            t = a["tensor"]
            key, gkey = ("src", "group_src") if spec.kind == "broadcast" else ("dst", "group_dst")
            peer = a.get(key)
            if peer is None and a.get(gkey) is not None:
                peer = dist.get_global_rank(group, a[gkey])
            out["peer"] = peer
        elif style == "gather_list":
            t = a["tensor"]
            out.update(shape=(size, *t.shape), dtype=_dtype_name(t.dtype), bytes=tensor_bytes(t) * size)
            return out
        elif style == "gather_tensor":
            t = a["output_tensor"]
        elif style == "scatter_list":
            t = a["output"]
            out.update(shape=(size, *t.shape), dtype=_dtype_name(t.dtype), bytes=tensor_bytes(t) * size)
            return out
        elif style == "scatter_tensor":
            t = a["input"]
        elif style == "a2a_single":
            t = a["input"]
            ins, outs = a.get("input_split_sizes"), a.get("output_split_sizes")
            if ins is not None or outs is not None:
                out["splits"] = {
                    "in": None if ins is None else [int(x) for x in ins],
                    "out": None if outs is None else [int(x) for x in outs],
                }
        elif style == "a2a_list":
            tensors = a["input_tensor_list"]
            out.update(
                shape=(len(tensors),),
                dtype=_dtype_name(tensors[0].dtype) if tensors else None,
                bytes=sum(tensor_bytes(x) for x in tensors),
            )
            return out
        elif style == "barrier":
            return out
        elif style == "p2p":
            t = a["tensor"]
            key, gkey = ("dst", "group_dst") if spec.kind in ("send", "isend") else ("src", "group_src")
            peer = a.get(key)
            if peer is None and a.get(gkey) is not None:
                peer = dist.get_global_rank(group, a[gkey])
            out["peer"] = peer
        else:  # pragma: no cover - every style is handled above
            raise AssertionError(style)
        out.update(shape=tuple(t.shape), dtype=_dtype_name(t.dtype), bytes=tensor_bytes(t))
        return out

    # -- fake-backend values ----------------------------------------------------------------------
    def _noise(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        if t.is_floating_point():
            noise = torch.randn(t.shape, generator=self._generator, dtype=torch.float32)
            t.copy_(noise.to(t.device))
        else:
            t.zero_()

    @staticmethod
    def _is_sum(op) -> bool:
        return op is None or op == dist.ReduceOp.SUM

    def _fill(self, spec: _Spec, a: dict) -> None:
        style = spec.style
        with torch.no_grad():
            if style == "batch":
                for p2p in a["p2p_op_list"]:
                    fn = getattr(p2p.op, "__recorder_original__", p2p.op)
                    if fn is _ORIGINAL_IRECV or fn is c10d.irecv:
                        self._noise(p2p.tensor)
                return
            tensors = [v for v in a.values() if _is_tensor(v)]
            if any(t.device.type == "meta" for t in tensors):
                return
            group = a.get("group")
            if style == "p2p":
                if spec.kind in ("recv", "irecv"):
                    self._noise(a["tensor"])
            elif style == "inplace":
                if self._is_sum(a.get("op")):
                    a["tensor"].mul_(dist.get_world_size(group))
            elif style == "gather_list":
                for out in a["tensor_list"]:
                    out.copy_(a["tensor"])
            elif style == "gather_tensor":
                out, inp = a["output_tensor"], a["input_tensor"]
                size = out.numel() // max(1, inp.numel())
                out.copy_(inp.reshape(1, -1).expand(size, -1).reshape(out.shape))
            elif style == "scatter_list":
                out = a["output"]
                out.copy_(a["input_list"][dist.get_rank(group)])
                if self._is_sum(a.get("op")):
                    out.mul_(dist.get_world_size(group))
            elif style == "scatter_tensor":
                out, inp = a["output"], a["input"]
                out.copy_(inp.reshape(-1, out.numel())[dist.get_rank(group)].reshape(out.shape))
                if self._is_sum(a.get("op")):
                    out.mul_(dist.get_world_size(group))
            elif style == "a2a_single":
                _cycle_rows(a["output"], a["input"])
            elif style == "a2a_list":
                for out, inp in zip(a["output_tensor_list"], a["input_tensor_list"]):
                    _cycle_rows(out, inp)

    # -- compute wrappers -------------------------------------------------------------------------
    def _wrap_forward_step(self, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def forward_step(*args, **kwargs):
            a = signature.bind(*args, **kwargs).arguments
            microbatch = a.get("current_microbatch")
            if microbatch is None:
                microbatch = self._forward_count
            self._forward_count += 1
            pass_ = (microbatch, a.get("vp_stage"))  # one micro-batch through one model chunk
            with self.compute("forward", microbatch, name="schedules.forward_step", chunk=pass_[1]):
                with self.meter.forward(pass_):
                    result = original(*args, **kwargs)
            output = result[0]
            self._pending_backward[id(output)] = (output, pass_)
            self._fifo.append(pass_)
            return result

        return forward_step

    def _wrap_backward_step(self, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def backward_step(*args, **kwargs):
            a = signature.bind(*args, **kwargs).arguments
            entry = self._pending_backward.pop(id(a.get("output_tensor")), None)
            if entry is not None:
                pass_ = entry[1]
                self._fifo.remove(pass_)
            else:
                pass_ = self._fifo.pop(0) if self._fifo else (None, None)
            with self.compute("backward", pass_[0], name="schedules.backward_step", chunk=pass_[1]):
                result = original(*args, **kwargs)
            self.meter.backward_done(pass_)
            return result

        return backward_step

    def _wrap_loss(self, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def forward_step_calc_loss(*args, **kwargs):
            a = signature.bind(*args, **kwargs).arguments
            is_last = a.get("is_last_stage")
            if is_last is None:
                from megatron.core import parallel_state

                is_last = parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=a.get("vp_stage")
                )
            if not (is_last and a.get("loss_func") is not None):
                return original(*args, **kwargs)
            parent = self._compute_stack[-1] if self._compute_stack else None
            microbatch, chunk = (parent.microbatch, parent.chunk) if parent is not None else (None, None)
            with self.compute("loss", microbatch, name="schedules.forward_step_calc_loss", chunk=chunk):
                return original(*args, **kwargs)

        return forward_step_calc_loss

    # -- memory -----------------------------------------------------------------------------------
    def memory(self, static_bytes: int = 0, static_detail: Optional[dict[str, int]] = None) -> dict[str, Any]:
        """Peak-memory figures of the recorded iterations.

        On CUDA: ``torch.cuda.max_memory_allocated()`` since the first recorded iteration
        (``method: "cuda_max_memory_allocated"``).  Elsewhere: ``static_bytes`` (model state the
        caller counted: parameters, gradient buffers, optimizer state) plus the activation
        high-water mark of :class:`ActivationMeter` (``method: "model_state+saved_activations"``).
        Both report ``model_state_bytes``, ``activation_peak_bytes`` and
        ``peak_in_flight_microbatches``; ``process_max_rss_bytes`` is the process's resident-set
        high-water mark (``getrusage``), for the whole process: when one process traces several
        ranks in turn it covers all of them so far.
        """
        out: dict[str, Any] = {
            "model_state_bytes": int(static_bytes),
            "activation_peak_bytes": int(self.meter.peak_bytes),
            "peak_in_flight_microbatches": int(self.meter.peak_in_flight),
        }
        if static_detail:
            out["model_state_detail"] = {k: int(v) for k, v in static_detail.items()}
        if self.clock == "cuda_events" and torch.cuda.is_available():
            out["method"] = "cuda_max_memory_allocated"
            out["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        else:
            out["method"] = "model_state+saved_activations"
            out["peak_bytes"] = int(static_bytes) + int(self.meter.peak_bytes)
        try:
            import resource

            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            out["process_max_rss_bytes"] = int(rss) * (1 if sys.platform == "darwin" else 1024)
        except (ImportError, OSError):  # pragma: no cover - non-POSIX
            pass
        return out


def _cycle_rows(out: torch.Tensor, inp: torch.Tensor) -> None:
    """Fill ``out`` with the rows of ``inp`` repeated (what a symmetric all-to-all delivers)."""
    if out.numel() == 0:
        return
    if inp.numel() == 0 or out.dim() == 0 or inp.dim() == 0 or out.shape[1:] != inp.shape[1:]:
        out.zero_()
        return
    index = torch.arange(out.shape[0], device=inp.device) % inp.shape[0]
    out.copy_(inp.index_select(0, index))


_ORIGINAL_ISEND = c10d.isend
_ORIGINAL_IRECV = c10d.irecv
