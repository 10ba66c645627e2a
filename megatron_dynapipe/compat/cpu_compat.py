"""Run megatron-core on CPU over gloo.

megatron-core 0.16 assumes CUDA in a handful of places: buffers allocated with
``device=torch.cuda.current_device()`` or ``device="cuda"``, ``torch.cuda.synchronize()``
after p2p exchanges, ``tensor.cuda()``, and an RNG tracker that keeps CUDA generator states.
:func:`enable_cpu_mode` redirects exactly those spots and nothing else; :func:`disable_cpu_mode`
puts the originals back. Both are idempotent; :func:`cpu_mode` is the context-manager form.

Two kinds of redirection are used, narrowest first:

* **scope** -- the megatron function is kept as it is and only *called* inside
  :func:`cuda_as_cpu`, a scope in which ``device="cuda"`` / ``device=<int>`` arguments of torch
  functions become ``"cpu"`` (and ``pin_memory=True``, which needs CUDA, False), ``Tensor.cuda()`` returns the tensor itself, and
  ``torch.cuda.current_device()`` / ``torch.cuda.synchronize()`` answer for the CPU, and
  ``Tensor.type()`` of a CPU tensor reads ``torch.cuda.FloatTensor`` & co. (megatron asserts
  it). The device rewrite is a per-thread torch function mode; the two ``torch.cuda`` functions
  are swapped process-wide, but only while such a call runs.
* **replace** -- where the CUDA use cannot be reached by a device argument (the RNG state
  tracker reads and writes CUDA generator states), a short CPU stand-in takes its place; each
  says why in its docstring.

Every spot is a :class:`~.patching.Spot` naming the source fragments it relies on; all are
checked against the installed megatron-core before any is patched, so an upstream change fails
with :class:`~.patching.UpstreamChanged` instead of silently running CUDA code paths or stale
patches. A module-level function is re-bound in every loaded ``megatron.*`` module that imported
it by name (e.g. ``clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import inspect
import threading
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from megatron_dynapipe.compat.patching import OneOf, Patches, Spot, check_spots

__all__ = [
    "CPU_STREAM_STANDINS",
    "CpuStream",
    "SPOTS",
    "check_spot",
    "counted",
    "cpu_arguments",
    "cpu_mode",
    "cuda_as_cpu",
    "describe",
    "redirected_spots",
    "disable_cpu_mode",
    "enable_cpu_mode",
    "is_enabled",
]

REVIEW = "megatron_dynapipe/compat/cpu_compat.py"


# --------------------------------------------------------------------------------------------
# The "CUDA as CPU" scope
# --------------------------------------------------------------------------------------------


def is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare index means a CUDA ordinal
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def cpu_arguments(func, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """``(args, kwargs)`` of a torch function call with its CUDA device request turned into the
    CPU, or None when the call asks for no CUDA device. ``Tensor.cuda()`` is not handled here:
    callers answer it with the tensor itself."""
    if kwargs.get("pin_memory"):  # page-locked memory is for copies to CUDA, which CPU mode never makes
        kwargs = dict(kwargs, pin_memory=False)
        return cpu_arguments(func, args, kwargs) or (args, kwargs)
    if "device" in kwargs and is_cuda_device(kwargs["device"]):
        return args, dict(kwargs, device="cpu")
    if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
        return (args[0], "cpu", *args[2:]), kwargs
    return None


def cuda_type_name(tensor: torch.Tensor) -> str:
    """The name ``Tensor.type()`` gives a CUDA tensor of ``tensor``'s dtype: CPU and meta tensors
    standing in for CUDA ones answer it, since megatron asserts
    ``grad.type() == 'torch.cuda.FloatTensor'``."""
    return torch.empty(0, dtype=tensor.dtype).type().replace("torch.", "torch.cuda.", 1)


class _CudaAsCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch functions to CPU; ``Tensor.cuda()`` is a no-op and
    ``Tensor.type()`` names a CPU tensor's CUDA type (megatron asserts
    ``grad.type() == 'torch.cuda.FloatTensor'``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return cuda_type_name(args[0])
        args, kwargs = cpu_arguments(func, args, kwargs) or (args, kwargs)
        return func(*args, **kwargs)


class CpuStream:
    """A CUDA stream (and event) stand-in for CPU work, which is synchronous: every wait is
    already done."""

    def __init__(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return self if event is None else event

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return 0


_CPU_STREAM = CpuStream()

#: ``torch.cuda`` stream functions answered for the CPU (the launcher's Megatron-LM spots and the
#: fake rank's MoE dispatcher use them).
CPU_STREAM_STANDINS: dict[str, Callable] = {
    "Stream": CpuStream,
    "current_stream": lambda device=None: _CPU_STREAM,
    "stream": lambda stream=None: contextlib.nullcontext(),
}


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_synchronize(device: Any = None) -> None:
    """CPU ops are synchronous; gloo requests are waited on by megatron itself."""


_scope_lock = threading.RLock()
_scope_depth = 0
_scope_saved: dict[str, Any] = {}

#: ``torch.cuda`` functions a scoped spot may call, answered for the CPU while a scope is open.
_SCOPE_ANSWERS: dict[str, Callable] = {
    "current_device": _cpu_current_device,
    "synchronize": _cpu_synchronize,
    "current_stream": CPU_STREAM_STANDINS["current_stream"],
}


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """Scope in which megatron's CUDA device requests land on the CPU (re-entrant).

    Torch functions see the device rewrite through a :class:`~torch.overrides.TorchFunctionMode`
    pushed by every scope: torch pops a mode while it handles a call, so a spot reached from
    inside a handled call (e.g. activation recompute inside ``torch.autograd.backward``) needs its
    own. The ``torch.cuda`` functions of :data:`_SCOPE_ANSWERS` are swapped while the outermost
    scope is open.
    """
    global _scope_depth
    with _scope_lock:
        if _scope_depth == 0:
            for name, answer in _SCOPE_ANSWERS.items():
                _scope_saved[name] = getattr(torch.cuda, name)
                setattr(torch.cuda, name, answer)
        _scope_depth += 1
    try:
        with _CudaAsCpuMode():
            yield
    finally:
        with _scope_lock:
            _scope_depth -= 1
            if _scope_depth == 0:
                for name in _SCOPE_ANSWERS:
                    setattr(torch.cuda, name, _scope_saved.pop(name))


# label -> how often the redirected spot was entered since CPU mode was last enabled
_CALLS: collections.Counter = collections.Counter()


def _scoped(original: Callable, label: str) -> Callable:
    @functools.wraps(original)
    def run_on_cpu(*args, **kwargs):
        _CALLS[label] += 1
        with cuda_as_cpu():
            return original(*args, **kwargs)

    return run_on_cpu


def counted(replacement: Callable, label: str, calls: collections.Counter) -> Callable:
    """``replacement``, counting its calls in ``calls[label]``."""
    @functools.wraps(replacement)
    def run_replacement(*args, **kwargs):
        calls[label] += 1
        return replacement(*args, **kwargs)

    return run_replacement


# --------------------------------------------------------------------------------------------
# CPU stand-ins for the RNG tracker (kind "replace")
# --------------------------------------------------------------------------------------------


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """Replaces ``random._get_cuda_rng_state``: reads the CUDA generator, which does not exist on
    CPU; there the CPU generator is the one dropout and recompute draw from."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
    """Replaces ``random._set_cuda_rng_state`` (see :func:`_cpu_get_rng_state`)."""
    torch.set_rng_state(new_state)


_TRACKER_CLASS_CACHE: dict[type, type] = {}


def _cpu_tracker_class(cuda_tracker_cls: type) -> type:
    """Return a subclass of megatron's ``CudaRNGStatesTracker`` whose named states are states of
    the CPU generator.

    Upstream ``add`` seeds through ``torch.cuda.manual_seed`` and ``fork`` warns whenever the CPU
    generator moves inside a fork, which on CPU is exactly what a fork is for; so both are
    re-stated here (bookkeeping kept identical: unique seeds, unique names, ``get_states`` /
    ``set_states`` inherited)."""
    if cuda_tracker_cls in _TRACKER_CLASS_CACHE:
        return _TRACKER_CLASS_CACHE[cuda_tracker_cls]
    default_fork_name = inspect.signature(cuda_tracker_cls.fork).parameters["name"].default

    class CpuRNGStatesTracker(cuda_tracker_cls):
        def __init__(self, *args, **kwargs):
            _CALLS[getattr(type(self), "__cpu_compat_spot__", "")] += 1
            super().__init__(*args, **kwargs)

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=default_fork_name):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state, outer_name = torch.get_rng_state(), self._current_state_name
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    CpuRNGStatesTracker.__qualname__ = CpuRNGStatesTracker.__name__
    CpuRNGStatesTracker.__module__ = __name__
    _TRACKER_CLASS_CACHE[cuda_tracker_cls] = CpuRNGStatesTracker
    return CpuRNGStatesTracker


def _reset_rng_tracker() -> None:
    """Rebuild megatron's tracker with the class now in effect (a CUDA tracker cannot work on
    CPU; a CPU one must not outlive CPU mode). Seeded states are dropped: re-seed afterwards."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(force_reset=True)


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------


def _scope(module: str, qualname: str, expects: tuple[str, ...], why: str) -> Spot:
    return Spot(module, qualname, expects, why, kind="scope")


SPOTS: tuple["Spot | OneOf", ...] = (
    _scope(
        "megatron.core.utils",
        "GlobalMemoryBuffer.get_tensor",
        ("device=torch.cuda.current_device()",),
        "allocates the shared scratch buffer on the current CUDA device",
    ),
    _scope(
        "megatron.core.utils",
        "local_multi_tensor_l2_norm",
        ('device="cuda"',),
        "returns the grad norm as a CUDA tensor (bound as clip_grads.l2_norm_impl)",
    ),
    _scope(
        "megatron.core.models.common.embeddings.rope_utils",
        "get_pos_emb_on_this_cp_rank",
        ('pin_memory=True', '.cuda(non_blocking=True)'),
        "picks this context-parallel rank's rotary positions by an index tensor made in pinned memory and moved "
        "to CUDA",
    ),
    _scope(
        "megatron.core.transformer.utils",
        "get_default_causal_mask",
        ('device="cuda"',),
        "builds the causal mask on CUDA when the caller passes attention_mask=None",
    ),
    _scope(
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule.setup_embeddings_and_output_layer",
        ("weight.data.cuda()",),
        "moves the tied output weight to CUDA before the embedding-group all-reduce (PP>1)",
    ),
    _scope(
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_no_pipelining",
        ('total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")',),
        "counts tokens in a CUDA tensor",
    ),
    _scope(
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_pipelining_without_interleaving",
        ('total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")',),
        "counts tokens in a CUDA tensor (1F1B)",
    ),
    _scope(
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_pipelining_with_interleaving",
        ('total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")',),
        "counts tokens in a CUDA tensor (interleaved 1F1B)",
    ),
    _scope(
        "megatron.core.pipeline_parallel.p2p_communication",
        "P2PCommunicator._communicate",
        ("device=torch.cuda.current_device()", "torch.cuda.synchronize()"),
        "allocates receive buffers on CUDA; synchronizes CUDA after batched isend/irecv",
    ),
    _scope(
        "megatron.core.pipeline_parallel.p2p_communication",
        "P2PCommunicator._communicate_shapes",
        ("device=torch.cuda.current_device()", "torch.cuda.synchronize()"),
        "exchanges shapes (variable_seq_lengths) in CUDA tensors; synchronizes CUDA",
    ),
    Spot(
        "megatron.core.tensor_parallel.random",
        "_get_cuda_rng_state",
        ("torch.cuda.random.get_rng_state",),
        "reads the CUDA generator (RNG tracker forks, activation recompute)",
        kind="replace",
        replacement=lambda original: _cpu_get_rng_state,
    ),
    Spot(
        "megatron.core.tensor_parallel.random",
        "_set_cuda_rng_state",
        ("_cuda_setRNGState",),
        "writes the CUDA generator (RNG tracker forks, activation recompute)",
        kind="replace",
        replacement=lambda original: _cpu_set_rng_state,
    ),
    Spot(
        "megatron.core.tensor_parallel.random",
        "CudaRNGStatesTracker",
        ("torch.cuda.manual_seed(seed)", "base_tracker = CudaRNGStatesTracker"),
        "tracker seeds CUDA generators; initialize_rng_tracker instantiates this name",
        kind="replace",
        replacement=_cpu_tracker_class,
        also_reads=(("megatron.core.tensor_parallel.random", "initialize_rng_tracker"),),
    ),
    _scope(
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBuffer.__init__",
        ("device=torch.cuda.current_device()",),
        "DDP grad (and param) buffers are allocated on the current CUDA device",
    ),
    OneOf(
        _scope(
            "megatron.core.distributed.param_and_grad_buffer",
            "_ParamAndGradBucketGroup.start_grad_sync",
            ("torch.cuda.current_stream()",),
            "waits on the current CUDA stream: on every grad sync for CUDA-graph gradient events (0.19), and "
            "with several distributed-optimizer instances before their reduction (0.17 on)",
        ),
        Spot(
            "megatron.core.distributed.param_and_grad_buffer",
            "_ParamAndGradBucketGroup.start_grad_sync",
            (),
            "asks for no CUDA stream on a grad sync (before 0.17)",
            lacks=("torch.cuda.current_stream()",),
        ),
    ),
    _scope(
        "megatron.core.optimizer.optimizer",
        "FP32Optimizer.__init__",
        ("device='cuda'",),
        "the constant loss scale is a CUDA tensor",
    ),
    _scope(
        "megatron.core.optimizer.optimizer",
        "MixedPrecisionOptimizer.__init__",
        ("device='cuda'",),
        "the found-inf flag and the multi-tensor-apply overflow buffer are CUDA tensors "
        "(16-bit optimizers, the distributed optimizer)",
    ),
    _scope(
        "megatron.core.optimizer.grad_scaler",
        "MegatronGradScaler.__init__",
        ("device='cuda'",),
        "the loss scale is a CUDA tensor (fp16)",
    ),
    _scope(
        "megatron.core.optimizer.grad_scaler",
        "DynamicGradScaler.__init__",
        ("device='cuda'",),
        "the dynamic loss scale's bounds and factors are CUDA tensors (fp16)",
    ),
    _scope(
        "megatron.core.optimizer.optimizer",
        "Float16OptimizerWithFloat16Params.__init__",
        ("param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']",),
        "tells 16-bit from fp32 parameters by their CUDA type names (16-bit weights, plain optimizer)",
    ),
    _scope(
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer.__init__",
        ("param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']",),
        "tells 16-bit from fp32 parameters by their CUDA type names",
    ),
    OneOf(
        _scope(
            "megatron.core.optimizer.optimizer",
            "MegatronOptimizer.has_grad_norm_group",
            ("device='cuda'",),
            "reduces whether a separate grad-norm group exists in a CUDA tensor (0.19; clip_grad > 0)",
        ),
        Spot(
            "megatron.core.optimizer.optimizer",
            "MegatronOptimizer.clip_grad_norm",
            (),
            "computes no separate grad-norm groups (before 0.19)",
            lacks=("has_grad_norm_group",),
        ),
    ),
    _scope(
        "megatron.core.optimizer.clip_grads",
        "get_grad_norm_fp32",
        ("device='cuda'",),
        "grad-norm accumulators are CUDA tensors (clip_grad > 0, grad-norm logging)",
    ),
    _scope(
        "megatron.core.optimizer.clip_grads",
        "clip_grad_by_total_norm_fp32",
        ("param.grad.type() == 'torch.cuda.FloatTensor'", "device='cuda'"),
        "asserts grads are CUDA tensors; the multi-tensor-scale flag is a CUDA tensor",
    ),
    _scope(
        "megatron.core.optimizer.clip_grads",
        "count_zeros_fp32",
        ("device='cuda'",),
        "zero counter is a CUDA tensor (log_num_zeros_in_grad)",
    ),
)

# label -> the upstream object; and every binding patched
_ORIGINALS: dict[str, Any] = {}
_PATCHES = Patches()
_state_lock = threading.RLock()


def check_spot(spot: Spot) -> Any:
    """Check that ``spot`` still looks as expected upstream (while enabled: what upstream had);
    return the original object. Raises :class:`~.patching.UpstreamChanged` otherwise."""
    return check_spots([spot], REVIEW, _ORIGINALS)[0][3]


def is_enabled() -> bool:
    return bool(_PATCHES)


def enable_cpu_mode() -> None:
    """Redirect megatron-core's CUDA-only spots to the CPU (idempotent).

    All spots are checked before any is patched, so a failed check leaves nothing half-applied.
    """
    with _state_lock:
        if _PATCHES:
            return
        # Load the modules that bind spot functions by name, so those bindings are patched too.
        for module in (
            "megatron.core.optimizer",
            "megatron.core.pipeline_parallel",
            "megatron.core.fusions.fused_softmax",
        ):
            importlib.import_module(module)
        for spot, owner, name, original in check_spots(SPOTS, REVIEW):
            if spot.kind == "check":  # this version needs nothing here
                continue
            if spot.kind == "scope":
                new = _scoped(original, spot.label)
            else:
                new = spot.replacement(original)
                if inspect.isfunction(new):
                    new = counted(new, spot.label, _CALLS)
                else:  # the tracker class counts the trackers it builds
                    new.__cpu_compat_spot__ = spot.label
            _ORIGINALS[spot.label] = original
            _PATCHES.replace(owner, name, new)
        _CALLS.clear()
        _reset_rng_tracker()


def disable_cpu_mode() -> None:
    """Put every original back (idempotent)."""
    with _state_lock:
        if not _PATCHES:
            return
        _PATCHES.undo()
        _ORIGINALS.clear()
        _reset_rng_tracker()


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """Context manager form; leaves CPU mode as it found it."""
    was_enabled = is_enabled()
    enable_cpu_mode()
    try:
        yield
    finally:
        if not was_enabled:
            disable_cpu_mode()


def redirected_spots() -> list[Spot]:
    """The spots this megatron-core needs redirected: each entry of :data:`SPOTS`, for a
    :class:`~.patching.OneOf` the alternative its code matches, less those that change nothing."""
    with _state_lock:
        return [spot for spot, *_ in check_spots(SPOTS, REVIEW, _ORIGINALS) if spot.kind != "check"]


def describe() -> list[dict[str, Any]]:
    """The redirection: one entry per :func:`redirected_spots` spot with its label
    (``file:qualname``), kind, reason, whether it is active, how often it was entered since CPU
    mode was enabled (for the tracker class: how many trackers were built) and every binding
    patched for it."""
    with _state_lock:
        return [
            {
                "spot": spot.label,
                "kind": spot.kind,
                "why": spot.why,
                "active": spot.label in _ORIGINALS,
                "calls": _CALLS[spot.label],
                "bindings": sorted(
                    f"{getattr(owner, '__name__', owner)}.{name}"
                    for owner, name, previous, _new in _PATCHES.bindings
                    if previous is _ORIGINALS.get(spot.label)
                ),
            }
            for spot in redirected_spots()
        ]
