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
See :class:`~.activation_meter.ActivationMeter` and :meth:`Recorder.memory`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_dynapipe.compat.patching import Patches
from megatron_dynapipe.tracer.activation_meter import ActivationMeter
from megatron_dynapipe.tracer.collectives import (
    REQUEST_KINDS,
    WRAPPED_COLLECTIVES,
    CollectiveSpec,
    DoneCoalesced,
    RecordedRequest,
    describe,
    dry_result,
    fill,
)
from megatron_dynapipe.tracer.trace_format import TraceOp

__all__ = ["Recorder"]


# ---------------------------------------------------------------------------------------------
# small helpers


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
        self._next_handle = 0
        self._waited: set[int] = set()  # request handles whose wait is recorded
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
            if op.cat == "compute":  # under context parallelism: what each ring transfer runs beside
                block = self.cost_fn(f"{op.kind} ring block", op.microbatch, op.chunk)
                op.ring_block_us = float(block) * 1e3 if block else None
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

    def _wrap_collective(self, api: str, spec: CollectiveSpec, original: Callable) -> Callable:
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
                op = self._new_op("comm", spec.kind, name=_call_site(), **describe(spec, a, self._group_info))
                timer = self._begin(op)
            self._local.depth = self._depth() + 1
            try:
                if self.execute:
                    result = original(*args, **kwargs)
                else:
                    result = dry_result(spec, a)
                if self.fill:
                    fill(spec, a, self._generator)
            finally:
                self._local.depth -= 1
            if op is not None:
                self._end(op, timer)
                if spec.kind in REQUEST_KINDS:
                    result = self._requests(op, result)
            return result

        return wrapper

    def _requests(self, op: TraceOp, result):
        """``result`` (a p2p op's request, or a batch's list of them) with its waits recorded:
        the op gets a ``handle``, and the first wait on any of its requests is a ``wait`` op
        carrying it, so that a replay knows when the rank blocked on the transfer."""
        with self._lock:
            op.handle = handle = self._next_handle
            self._next_handle += 1

        def waited(wait: Callable[[], Any]):
            with self._lock:
                first = self.recording and handle not in self._waited
                self._waited.add(handle)
            if not first:
                return wait()
            record = self._new_op("comm", "wait", name=_call_site(), handle=handle)
            timer = self._begin(record)
            try:
                return wait()
            finally:
                self._end(record, timer)

        if isinstance(result, list):
            return [RecordedRequest(work, waited) if work is not None else work for work in result]
        return RecordedRequest(result, waited) if result is not None else result

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
                    yield DoneCoalesced()
            finally:
                self._coalesce_stack.pop()

        functools.update_wrapper(coalescing_manager, original)
        return coalescing_manager

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
        ``peak_in_flight_microbatches``, and ``activation_probe_bytes`` where the meter probed
        modules (:meth:`ActivationMeter.probe`); ``process_max_rss_bytes`` is the process's resident-set
        high-water mark (``getrusage``), for the whole process: when one process traces several
        ranks in turn it covers all of them so far.
        """
        out: dict[str, Any] = {
            "model_state_bytes": int(static_bytes),
            "activation_peak_bytes": int(self.meter.peak_bytes),
            "peak_in_flight_microbatches": int(self.meter.peak_in_flight),
        }
        if self.meter.probes:
            out["activation_probe_bytes"] = dict(self.meter.probes)
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


