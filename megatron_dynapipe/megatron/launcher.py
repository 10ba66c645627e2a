"""``megatron-dynapipe launch``: run Megatron-LM's ``pretrain_gpt.py`` with DynaPipe, checkout untouched.

Under torchrun, one process per rank::

    torchrun --nproc-per-node 8 $(which megatron-dynapipe) launch /path/to/Megatron-LM/pretrain_gpt.py \\
        --dynapipe --dynapipe-memory-limit 36000 ... (every other pretrain_gpt.py flag as usual)
    torchrun --nproc-per-node 8 -m megatron_dynapipe.megatron.launcher /path/to/pretrain_gpt.py ...

What it does, in this order, in each process:

1. puts the script's folder first on ``sys.path`` (as ``python pretrain_gpt.py`` would, so the
   checkout's ``megatron`` package is the one imported) and the script's arguments in
   ``sys.argv``;
2. with ``--cpu``, redirects the CUDA-only spots of megatron-core
   (:mod:`~megatron_dynapipe.compat.cpu_compat`) and of Megatron-LM's training loop
   (:data:`LM_CPU_SPOTS`, each checked against the checkout's source first) and appends the
   flags a CPU run needs (:data:`CPU_FLAGS`);
3. replaces ``megatron.training.pretrain`` with a wrapper, then runs the script as
   ``__main__`` (``runpy``). When the script calls ``pretrain(...)``, the wrapper swaps in the
   hooks of :mod:`~megatron_dynapipe.megatron.pretrain_hooks` -- the datasets provider, the model
   provider (which validates DynaPipe's arguments and installs its schedule once Megatron has
   validated its own), the extra-arguments provider -- and re-binds the script's global
   ``get_batch`` (the name its ``forward_step`` calls) before handing over to Megatron's real
   ``pretrain``. The ``patches/`` file makes the same changes, explicitly, in the script.

Without ``--dynapipe`` among the script's arguments every hook falls through to the script's own
function: the run is plain Megatron-LM.

With ``--is-scaling-mode`` among the script's arguments nothing trains and the script does not run:
the launcher traces the fake rank ``--fake-current-rank-id`` of the ``--fake-*`` layout in this
one process (no torchrun needed) and writes its trace to ``--trace-dir``
(:mod:`~megatron_dynapipe.megatron.scaling_mode`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import runpy
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from megatron_dynapipe.compat.patching import Patches, Spot, UpstreamChanged, check_spots

__all__ = [
    "CPU_FLAGS",
    "LM_CPU_SPOTS",
    "LaunchError",
    "LaunchOptions",
    "add_launch_parser",
    "enable_megatron_lm_cpu_mode",
    "launch",
    "main",
    "parse_launch_args",
    "wrap_pretrain",
]

PROG = "megatron-dynapipe launch"


class LaunchError(RuntimeError):
    """The script or checkout cannot be launched; the message names the fix."""


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """What the launcher was asked: the script, its arguments (verbatim), and ``cpu``."""

    script: Path
    script_args: tuple[str, ...]
    cpu: bool = False

    @property
    def megatron_lm_dir(self) -> Path:
        return self.script.parent


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = ("Run a Megatron-LM training script (pretrain_gpt.py) with DynaPipe's data loader, "
                          "get_batch and planned pipeline schedule installed; the checkout stays unmodified. "
                          "Run it under torchrun, one process per rank.")
    parser.epilog = ("Everything after SCRIPT goes to the script unchanged (add --dynapipe "
                     "--dynapipe-memory-limit MB to switch DynaPipe on). Example: torchrun --nproc-per-node 2 "
                     "$(which megatron-dynapipe) launch Megatron-LM/pretrain_gpt.py --dynapipe ...")
    parser.add_argument("--cpu", action="store_true",
                        help="run on CPU over gloo (small smoke runs): redirect the CUDA-only spots of "
                             "megatron-core and Megatron-LM's training loop and append the CPU flags "
                             f"({' '.join(CPU_FLAGS)})")
    parser.add_argument("script", metavar="SCRIPT", help="the training script, e.g. Megatron-LM/pretrain_gpt.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="the script's arguments, passed through unchanged")
    return parser


def add_launch_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``launch`` subcommand to ``megatron-dynapipe``'s subparsers; returns its parser
    (``func`` set to :func:`run_from_namespace`)."""
    parser = subparsers.add_parser("launch", help="run Megatron-LM's pretrain_gpt.py with DynaPipe (under torchrun)")
    _configure(parser)
    parser.set_defaults(func=run_from_namespace)
    return parser


def build_parser() -> argparse.ArgumentParser:
    return _configure(argparse.ArgumentParser(prog=PROG))


def _options(ns: argparse.Namespace) -> LaunchOptions:
    script = Path(ns.script)
    if not script.is_file():
        raise LaunchError(f"{ns.script}: no such script; pass the path of Megatron-LM's pretrain_gpt.py "
                          "(e.g. $MEGATRON_LM_DIR/pretrain_gpt.py)")
    if script.suffix != ".py":
        raise LaunchError(f"{ns.script} is not a Python script: pass Megatron-LM's pretrain_gpt.py")
    args = list(ns.script_args or ())
    if args and args[0] == "--":
        args = args[1:]
    half = [flag for flag in ("--bf16", "--fp16") if flag in args]
    if ns.cpu and half:
        raise LaunchError(f"--cpu runs in fp32 only: with {half[0]} megatron-core's optimizer and grad scaler "
                          f"keep their state on CUDA; drop {half[0]} for a CPU smoke run")
    return LaunchOptions(script=script.resolve(), script_args=tuple(args), cpu=bool(ns.cpu))


def parse_launch_args(argv: Sequence[str]) -> LaunchOptions:
    """Parse ``[--cpu] SCRIPT ARGS...`` (launcher options come before SCRIPT; everything after it
    is the script's). Raises :class:`LaunchError` for a missing script."""
    return _options(build_parser().parse_args(list(argv)))


def run_from_namespace(ns: argparse.Namespace) -> int:
    """``func`` of the ``launch`` subcommand (a :class:`LaunchError` is a ValueError-like,
    one-line error: the CLI prints it and exits with 2)."""
    try:
        return launch(_options(ns))
    except (LaunchError, UpstreamChanged) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m megatron_dynapipe.megatron.launcher [--cpu] SCRIPT ARGS...``."""
    try:
        options = parse_launch_args(sys.argv[1:] if argv is None else argv)
    except (LaunchError, UpstreamChanged) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    try:
        return launch(options)
    except (LaunchError, UpstreamChanged) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------------------------
# CPU mode for Megatron-LM's training loop
# --------------------------------------------------------------------------------------------

# Flags a CPU run needs: gloo instead of NCCL, weights made on the CPU, megatron-core's local
# (non-Transformer-Engine) layers, none of the fused CUDA kernels, and no rerun state machine.
CPU_FLAGS: tuple[str, ...] = (
    "--distributed-backend", "gloo",
    "--use-cpu-initialization",
    "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-persist-layer-norm",
    "--no-rope-fusion",
    "--rerun-mode", "disabled",  # its result validation saves and compares CUDA RNG state
)


REVIEW = "LM_CPU_SPOTS in megatron_dynapipe/megatron/launcher.py (written for Megatron-LM core_v0.16.1)"


def _body(module: str, qualname: str, expects: tuple[str, ...], why: str, cuda: tuple[str, ...] = ()) -> Spot:
    """A Megatron-LM function (not megatron-core: that is :mod:`~..compat.cpu_compat`) whose own
    body -- and nothing it calls -- gets ``device="cuda"`` arguments of torch functions turned into
    ``"cpu"``, ``Tensor.cuda()`` as a no-op, and CPU answers from the ``torch.cuda`` functions
    named in ``cuda`` (see ``_cpu_answers``), so a CUDA use anywhere else still fails loudly."""
    return Spot(module, qualname, expects, why, kind="body", cuda=cuda)


def _replace(module: str, qualname: str, expects: tuple[str, ...], why: str, replacement) -> Spot:
    return Spot(module, qualname, expects, why, kind="replace", replacement=replacement)


def _allow_no_cuda(original: Callable) -> Callable:
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron


def _skip_fused_kernels(original: Callable) -> Callable:
    def load(args):
        """CPU run: these are CUDA kernels, built with nvcc (and --cpu turns their use off)."""

    return load


def _skip_jit_warmup(original: Callable) -> Callable:
    def _warmup_jit_function():
        """CPU run: the fused kernels it warms up are CUDA kernels (and --cpu turns them off)."""

    return _warmup_jit_function


LM_CPU_SPOTS: tuple[Spot, ...] = (
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
    _replace("megatron.legacy.fused_kernels", "load",
             ("_get_cuda_bare_metal_version(", "cpp_extension.CUDA_HOME"),
             "builds Megatron's fused CUDA kernels with nvcc at start-up",
             _skip_fused_kernels),
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
          (").cuda()", "device='cuda'"), "sums the validation losses in CUDA tensors"),
    _body("megatron.training.training", "evaluate_and_print_results",
          ("device='cuda'",), "broadcasts --full-validation's iteration count in a CUDA tensor"),
    _body("megatron.training.utils", "reduce_max_stat_across_model_parallel_group",
          ("device=torch.cuda.current_device()",), "reduces the grad norm in a CUDA tensor",
          cuda=("current_device",)),
    _body("megatron.training.utils", "logical_and_across_model_parallel_group",
          ("device=torch.cuda.current_device()",), "reduces the update-successful flag in a CUDA tensor",
          cuda=("current_device",)),
    _body("megatron.training.utils", "calc_params_l2_norm",
          ("device='cuda'",), "computes --log-params-norm in CUDA tensors"),
)


def _cpu_answers() -> dict[str, Callable]:
    import torch

    from megatron_dynapipe.compat.cpu_compat import CPU_STREAM_STANDINS

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

    from megatron_dynapipe.compat.cpu_compat import cpu_arguments

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


def enable_megatron_lm_cpu_mode(spots: Sequence[Spot] = LM_CPU_SPOTS) -> None:
    """Redirect megatron-core's (:func:`.cpu_compat.enable_cpu_mode`) and Megatron-LM's
    (``spots``) CUDA-only places to the CPU; idempotent. Every spot is checked before any is
    patched. The ``"body"`` redirection is a torch function mode pushed for the calling thread
    (the launcher's main thread), active until :func:`disable_megatron_lm_cpu_mode`."""
    import inspect

    import torch

    from megatron_dynapipe.compat import cpu_compat

    with _cpu.lock:
        if _cpu.mode is not None:
            return
        resolved = check_spots(spots, REVIEW)
        answers = _cpu_answers()
        unanswered = sorted({name for spot in spots for name in spot.cuda} - set(answers))
        if unanswered:
            raise LaunchError(f"no CPU answer for torch.cuda.{unanswered[0]}: add it to _cpu_answers")
        cpu_compat.enable_cpu_mode()
        for spot, owner, name, original in resolved:
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
    from megatron_dynapipe.compat import cpu_compat

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


# --------------------------------------------------------------------------------------------
# The pretrain wrapper and the launch
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Installed:
    """What :func:`wrap_pretrain`'s wrapper swapped in when the script called ``pretrain``."""

    called: bool = False
    patched: list = dataclasses.field(default_factory=list)


def _print_rank0(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def wrap_pretrain(pretrain: Callable, installed: Optional[_Installed] = None) -> Callable:
    """A ``pretrain`` that installs :mod:`.pretrain_hooks` before calling ``pretrain``.

    Replaces its datasets provider, model provider and ``extra_args_provider`` with the hooks'
    wrappers (each falls through to the script's own without ``--dynapipe``), and re-binds the
    ``get_batch`` global of the module ``forward_step_func`` was defined in.
    """
    from megatron_dynapipe.megatron import pretrain_hooks as hooks

    installed = installed if installed is not None else _Installed()

    def dynapipe_pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                          *args, extra_args_provider=None, **kwargs):
        installed.called = True
        if hooks.is_hook(train_valid_test_dataset_provider) and hooks.is_hook(model_provider):
            installed.patched = []  # a patched script (patches/): it calls the hooks itself
            _print_rank0("> megatron-dynapipe launch: the script calls megatron_dynapipe's pretrain hooks itself "
                         "(patched); nothing to install")
            return pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                            *args, extra_args_provider=extra_args_provider, **kwargs)
        script_globals = getattr(forward_step_func, "__globals__", None)
        if script_globals is None or not callable(script_globals.get("get_batch")):
            raise LaunchError(
                f"{getattr(forward_step_func, '__qualname__', forward_step_func)!r} is not defined next to a "
                "get_batch function: the launcher supports pretrain_gpt.py-style scripts (forward_step calls "
                "the module's get_batch); apply patches/pretrain_gpt_core_v0.16.1.patch-style changes instead")
        if not hooks.is_hook(script_globals["get_batch"]):
            script_globals["get_batch"] = hooks.make_get_batch(script_globals["get_batch"])
        installed.patched = ["get_batch", "train_valid_test_datasets_provider", "model_provider",
                             "extra_args_provider"]
        _print_rank0(f"> megatron-dynapipe launch: hooked the script's {', '.join(installed.patched)}")
        return pretrain(
            hooks.datasets_provider(train_valid_test_dataset_provider),
            hooks.model_provider(model_provider),
            model_type,
            forward_step_func,
            *args,
            extra_args_provider=hooks.extra_args_provider(extra_args_provider),
            **kwargs,
        )

    dynapipe_pretrain.__wrapped__ = pretrain  # type: ignore[attr-defined]
    return dynapipe_pretrain


@contextlib.contextmanager
def _script_environment(options: LaunchOptions) -> Iterator[list[str]]:
    """sys.path[0] = the script's folder, sys.argv = [script, *args] (plus the CPU flags);
    restored afterwards."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    argv = [str(options.script), *options.script_args]
    if options.cpu:
        argv += list(CPU_FLAGS)
    sys.argv = argv
    sys.path.insert(0, str(options.megatron_lm_dir))
    try:
        yield argv
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def _check_megatron_is_the_checkouts(options: LaunchOptions) -> None:
    loaded = sys.modules.get("megatron")
    if loaded is None:
        return
    where = Path(getattr(loaded, "__path__", [""])[0]).resolve()
    if options.megatron_lm_dir.resolve() not in where.parents:
        raise LaunchError(
            f"megatron was imported from {where} before the launcher could put {options.megatron_lm_dir} first "
            "on sys.path: launch in a fresh process (torchrun ... megatron-dynapipe launch SCRIPT ...)")


def launch(options: LaunchOptions) -> int:
    """Run ``options.script`` as ``__main__`` with DynaPipe's hooks installed (see the module
    docstring). Returns 0 when the script returns (``SystemExit`` passes through)."""
    from megatron_dynapipe.megatron import pretrain_hooks, scaling_mode
    from megatron_dynapipe.megatron.arguments import DynapipeArgumentError

    if options.cpu:
        import torch

        if torch.cuda.is_available():
            raise LaunchError("--cpu is for machines without CUDA (it answers Megatron-LM's CUDA calls for the "
                              "CPU, which would mix devices here): drop --cpu")
    if scaling_mode.requested(options.script_args):
        # Before the script runs: Megatron's pretrain would initialise a real distributed job,
        # and the fake-rank tracer opens its own fake process group (see scaling_mode).
        with _script_environment(options) as argv:
            _check_megatron_is_the_checkouts(options)
            try:
                scaling_mode.run_from_argv(argv[1:])
            except DynapipeArgumentError as error:
                raise LaunchError(str(error)) from None
        return 0
    installed = _Installed()
    with _script_environment(options) as argv:
        _check_megatron_is_the_checkouts(options)
        try:
            import megatron.training as training_package
        except ImportError as exc:
            raise LaunchError(
                f"cannot import megatron.training from {options.megatron_lm_dir} ({exc}): the script must sit in a "
                "Megatron-LM checkout (core_v0.16.1) whose training dependencies are installed") from exc
        if options.cpu:
            enable_megatron_lm_cpu_mode()
            _print_rank0(f"> megatron-dynapipe launch --cpu: appended {' '.join(CPU_FLAGS)}")
        original = training_package.pretrain
        training_package.pretrain = wrap_pretrain(original, installed)
        try:
            runpy.run_path(argv[0], run_name="__main__")
        finally:
            training_package.pretrain = original
            pretrain_hooks.close_loaders()
            if options.cpu:
                counts = cpu_spot_calls()
                _print_rank0("> megatron-dynapipe launch --cpu: redirected "
                             + (", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "nothing"))
                disable_megatron_lm_cpu_mode()
    if not installed.called:
        raise LaunchError(f"{options.script} never called megatron.training.pretrain: the launcher installs DynaPipe "
                          "through that call (run pretrain_gpt.py, or a script that calls pretrain the same way)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
