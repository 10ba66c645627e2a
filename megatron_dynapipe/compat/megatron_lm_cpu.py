"""Megatron-LM's training loop (``megatron.training``, not megatron-core) on the CPU, for the
launcher's ``--cpu`` smoke runs.

Its CUDA uses sit in a few functions of the training loop (initialisation, timers, logging,
evaluation).  Each is a :class:`~.patching.Spot`, checked against the checkout's source before any
is patched, of one of two kinds:

* ``"replace"`` -- a short CPU stand-in takes its place (``initialize_megatron`` may run without
  CUDA; the fused-kernel build and the JIT warm-up are skipped);
* ``"body"`` -- CUDA device requests made directly in the function's own body (not in what it
  calls) land on the CPU, and the ``torch.cuda`` functions its spot names answer for the CPU there,
  so a CUDA use anywhere else still fails loudly.

megatron-core's own spots are :mod:`.cpu_compat`'s, enabled with these.
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import sys
import threading
from typing import Any, Callable, Sequence

from megatron_dynapipe.compat import cpu_compat
from megatron_dynapipe.compat.cpu_compat import CPU_STREAM_STANDINS, cpu_arguments
from megatron_dynapipe.compat.patching import OneOf, Patches, Spot, check_spots

__all__ = ["LM_CPU_SPOTS", "enable_megatron_lm_cpu_mode", "disable_megatron_lm_cpu_mode",
           "cpu_spot_calls"]

REVIEW = "LM_CPU_SPOTS in megatron_dynapipe/compat/megatron_lm_cpu.py (written for Megatron-LM core_v0.16.1 to core_v0.19.0)"


def _body(module: str, qualname: str, expects: tuple[str, ...], why: str, cuda: tuple[str, ...] = ()) -> Spot:
    """A Megatron-LM function (not megatron-core: that is :mod:`.cpu_compat`) whose own
    body -- and nothing it calls -- gets ``device="cuda"`` arguments of torch functions turned into
    ``"cpu"``, ``Tensor.cuda()`` as a no-op, and CPU answers from the ``torch.cuda`` functions
    named in ``cuda`` (see ``_cpu_answers``), so a CUDA use anywhere else still fails loudly."""
    return Spot(module, qualname, expects, why, kind="body", cuda=cuda)


def _replace(module: str, qualname: str, expects: tuple[str, ...], why: str, replacement) -> Spot:
    return Spot(module, qualname, expects, why, kind="replace", replacement=replacement)


def _allow_no_cuda(original: Callable) -> Callable:
    @functools.wraps(original)  # later checks of the spot read the original's source
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron


def _skip_fused_kernels(original: Callable) -> Callable:
    def load(*args, **kwargs):
        """CPU run: these are CUDA kernels, built with nvcc (and --cpu turns their use off)."""

    return load


def _skip_jit_warmup(original: Callable) -> Callable:
    def _warmup_jit_function(*args, **kwargs):  # core_v0.19 passes tp_size
        """CPU run: the fused kernels it warms up are CUDA kernels (and --cpu turns them off)."""

    return _warmup_jit_function


def _no_gpu_architecture(original: Callable) -> Callable:
    def get_device_arch_version():
        """CPU run: no GPU, so no architecture (0, before any); Megatron-LM then asks TP and CP jobs
        for CUDA_DEVICE_MAX_CONNECTIONS=1, which the launcher sets on the CPU, where it means nothing."""
        return 0

    return get_device_arch_version


LM_CPU_SPOTS: tuple["Spot | OneOf", ...] = (
    _replace("megatron.training.initialize", "initialize_megatron",
             ('assert torch.cuda.is_available(), "Megatron requires CUDA."', "allow_no_cuda"),
             "asserts CUDA is available unless allow_no_cuda", _allow_no_cuda),
    _body("megatron.training.initialize", "_initialize_distributed",
          ("device_count = torch.cuda.device_count()", "torch.cuda.set_device(args.local_rank)",
           "if device_count > 0:"),
          "sets up model parallelism only when it sees a CUDA device (and binds the rank to it)",
          cuda=("device_count", "set_device")),
    _body("megatron.training.initialize", "_set_random_seed",
          ("if torch.cuda.device_count() > 0:", "model_parallel_cuda_manual_seed"),
          "seeds megatron's RNG tracker only when it sees a CUDA device", cuda=("device_count",)),
    OneOf(_replace("megatron.legacy.fused_kernels", "load",
                   ("_get_cuda_bare_metal_version(", "cpp_extension.CUDA_HOME"),
                   "builds Megatron's fused CUDA kernels with nvcc at start-up",
                   _skip_fused_kernels),
          Spot("megatron.training.initialize", "_compile_dependencies", (),
               "builds no fused CUDA kernels at start-up (core_v0.17 and later)", lacks=("fused_kernels",))),
    OneOf(*(_replace(module, "get_device_arch_version",
                     ('torch.cuda.get_device_properties(torch.device("cuda:0")).major',),
                     "reads the GPU's architecture (validate_args does, for TP or CP jobs)", _no_gpu_architecture)
            for module in ("megatron.training.utils.common_utils", "megatron.training.utils"))),
    _replace("megatron.training.initialize", "_warmup_jit_function",
             ('device="cuda"',), "warms up fused CUDA kernels", _skip_jit_warmup),
    _body("megatron.core.timers", "Timer.start", ("torch.cuda.synchronize()",),
          "synchronizes CUDA before reading the clock", cuda=("synchronize",)),
    _body("megatron.core.timers", "Timer.stop", ("torch.cuda.synchronize()",),
          "synchronizes CUDA before reading the clock", cuda=("synchronize",)),
    _body("megatron.core.timers", "Timers._get_elapsed_time_all_ranks",
          ("device=torch.cuda.current_device()",), "gathers the timings in a CUDA tensor",
          cuda=("current_device",)),
    _body("megatron.training.training", "pretrain",
          ("device='cuda')",),
          "all-reduces the start-up timestamps in CUDA tensors"),
    _body("megatron.training.training", "get_model",
          ("model_module.cuda(torch.cuda.current_device())", "torch.cuda.Stream()"),
          "moves the model to the current CUDA device; builds DDP on a side CUDA stream",
          cuda=("current_device", "Stream", "current_stream", "stream")),
    OneOf(_body("megatron.training.models.dist_utils", "_ddp_wrap", ("torch.cuda.Stream()",),
                "builds DDP on a side CUDA stream (core_v0.19: models built from the config container)",
                cuda=("Stream", "current_stream", "stream")),
          Spot("megatron.training.training", "get_model", ("torch.cuda.Stream()",),
               "builds DDP itself, on a side CUDA stream (before core_v0.19): its own spot covers it")),
    _body("megatron.training.training", "build_train_valid_test_data_loaders",
          ("device='cuda'",), "broadcasts the do-train/valid/test flags in a CUDA tensor"),
    _body("megatron.training.training", "training_log",
          ("device='cuda')",), "accumulates the logged losses in CUDA tensors"),
    _body("megatron.training.training", "post_training_step_callbacks",
          ("torch.cuda.synchronize()",), "synchronizes CUDA every --train-sync-interval iterations",
          cuda=("synchronize",)),
    _body("megatron.training.training", "checkpoint_and_decide_exit",
          ("device='cuda'",), "all-reduces the --exit-duration-in-mins decision in a CUDA tensor"),
    _body("megatron.training.training", "evaluate",
          ("device='cuda'",), "sums the validation losses in CUDA tensors"),
    _body("megatron.training.training", "evaluate_and_print_results",
          ("device='cuda'",), "broadcasts --full-validation's iteration count in a CUDA tensor"),
    _body("megatron.training.utils", "reduce_max_stat_across_model_parallel_group",
          ("device=torch.cuda.current_device()",), "reduces the grad norm in a CUDA tensor",
          cuda=("current_device",)),
    _body("megatron.training.utils", "logical_and_across_model_parallel_group",
          ("device=torch.cuda.current_device()",), "reduces the update-successful flag in a CUDA tensor",
          cuda=("current_device",)),
    OneOf(_body("megatron.training.utils.common_utils", "_compute_norm_2",
                ("device='cuda'",), "computes --log-params-norm in CUDA tensors (core_v0.19)"),
          _body("megatron.training.utils", "calc_params_l2_norm",
                ("device='cuda'",), "computes --log-params-norm in CUDA tensors")),
)


def _cpu_answers() -> dict[str, Callable]:
    import torch

    
    return {
        "device_count": lambda: 1,  # one device: the CPU
        "set_device": lambda device: None,
        "current_device": lambda: torch.device("cpu"),
        "synchronize": lambda device=None: None,
        **CPU_STREAM_STANDINS,
    }


class _CpuState:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.body_codes: dict[Any, str] = {}  # code object -> spot label
        self.cuda_codes: dict[str, dict[Any, str]] = {}  # torch.cuda name -> {code: label}
        self.patches = Patches()
        self.calls: collections.Counter = collections.Counter()
        self.mode = None


_cpu = _CpuState()
_HERE = os.path.abspath(__file__)


_TORCH_DIR: list[str] = []


def _torch_dir() -> str:
    if not _TORCH_DIR:
        import torch

        _TORCH_DIR.append(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    return _TORCH_DIR[0]


def _caller_code(start):
    """The code object of the first frame at or above ``start`` outside torch and this module."""
    torch_dir = _torch_dir()
    frame = start
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(torch_dir) or os.path.abspath(filename) == _HERE
                or filename.startswith("<frozen") or filename.endswith(f"{os.sep}contextlib.py")):
            return frame.f_code
        frame = frame.f_back
    return None


def _body_mode_class():
    import torch
    from torch.overrides import TorchFunctionMode

    class BodyCudaAsCpu(TorchFunctionMode):
        """CUDA device requests made directly by a ``"body"`` spot land on the CPU."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            label = _cpu.body_codes.get(_caller_code(sys._getframe(1)))
            if label is None:
                return func(*args, **kwargs)
            if func is torch.Tensor.cuda:
                _cpu.calls[label] += 1
                return args[0]
            redirected = cpu_arguments(func, args, kwargs)
            if redirected is not None:
                _cpu.calls[label] += 1
                args, kwargs = redirected
            return func(*args, **kwargs)

    return BodyCudaAsCpu


def _cuda_swap(name: str, original: Callable, cpu: Callable) -> Callable:
    def answer(*args, **kwargs):
        label = _cpu.cuda_codes.get(name, {}).get(_caller_code(sys._getframe(1)))
        if label is None:
            return original(*args, **kwargs)
        _cpu.calls[label] += 1
        return cpu(*args, **kwargs)

    answer.__name__ = getattr(original, "__name__", name)
    answer.__launcher_cpu_spot__ = name  # type: ignore[attr-defined]
    return answer


def enable_megatron_lm_cpu_mode(spots: "Sequence[Spot | OneOf]" = LM_CPU_SPOTS) -> None:
    """Redirect megatron-core's (:func:`.cpu_compat.enable_cpu_mode`) and Megatron-LM's
    (``spots``) CUDA-only places to the CPU; idempotent. Every spot is checked before any is
    patched. The ``"body"`` redirection is a torch function mode pushed for the calling thread
    (the launcher's main thread), active until :func:`disable_megatron_lm_cpu_mode`."""
    import torch

    with _cpu.lock:
        if _cpu.mode is not None:
            return
        resolved = check_spots(spots, REVIEW)
        answers = _cpu_answers()
        unanswered = sorted({name for spot, *_ in resolved for name in spot.cuda} - set(answers))
        if unanswered:
            raise ValueError(f"no CPU answer for torch.cuda.{unanswered[0]}: add it to _cpu_answers")
        cpu_compat.enable_cpu_mode()
        for spot, owner, name, original in resolved:
            if spot.kind == "check":  # this version needs nothing here
                continue
            if spot.kind == "replace":
                _cpu.patches.replace(owner, name, cpu_compat.counted(spot.replacement(original), spot.label,
                                                                     _cpu.calls))
                continue
            code = inspect.unwrap(original).__code__
            _cpu.body_codes[code] = spot.label
            for cuda_name in spot.cuda:
                _cpu.cuda_codes.setdefault(cuda_name, {})[code] = spot.label
        for cuda_name in _cpu.cuda_codes:
            _cpu.patches.set(torch.cuda, cuda_name,
                             _cuda_swap(cuda_name, getattr(torch.cuda, cuda_name), answers[cuda_name]))
        _cpu.calls.clear()
        _cpu.mode = _body_mode_class()()
        _cpu.mode.__enter__()


def disable_megatron_lm_cpu_mode() -> None:
    """Undo :func:`enable_megatron_lm_cpu_mode` (call from the thread that enabled it)."""
    with _cpu.lock:
        if _cpu.mode is None:
            return
        _cpu.mode.__exit__(None, None, None)
        _cpu.mode = None
        _cpu.patches.undo()
        _cpu.body_codes.clear()
        _cpu.cuda_codes.clear()
        cpu_compat.disable_cpu_mode()


def cpu_spot_calls() -> dict[str, int]:
    """How often each Megatron-LM spot redirected something since CPU mode was enabled."""
    return dict(_cpu.calls)
