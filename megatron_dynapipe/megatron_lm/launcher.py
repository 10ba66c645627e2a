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
3. replaces ``megatron.training.pretrain`` (and, where the script parses its own arguments --
   core_v0.18 and later -- ``megatron.training.arguments.parse_and_validate_args``) with a
   wrapper, then runs the script as ``__main__`` (``runpy``). DynaPipe's flags join Megatron's
   parse, and DynaPipe's arguments are validated and its schedule installed right after Megatron
   validated its own (in ``parse_and_validate_args``, else in the model provider). When the script
   calls ``pretrain(...)``, the wrapper swaps in the hooks of
   :mod:`~megatron_dynapipe.megatron_lm.pretrain_hooks` -- the datasets provider, the model
   provider or the model config's layers, the extra-arguments provider -- and re-binds the
   script's global ``get_batch`` (the name its ``forward_step`` calls) before handing over to
   Megatron's real ``pretrain``. Which of them a tag has is read from its code
   (:mod:`~megatron_dynapipe.compat.megatron_lm_script`). The ``patches/`` files make the same
   changes, explicitly, in the script.

Without ``--dynapipe`` among the script's arguments every hook falls through to the script's own
function: the run is plain Megatron-LM.

With ``--is-scaling-mode`` among the script's arguments nothing trains and the script does not run:
the launcher traces the fake rank ``--fake-current-rank-id`` of the ``--fake-*`` layout in this
one process (no torchrun needed) and writes its trace to ``--trace-dir``
(:mod:`~megatron_dynapipe.megatron_lm.scaling_mode`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import runpy
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from megatron_dynapipe.compat import megatron_lm_script as script
from megatron_dynapipe.compat import upstream
from megatron_dynapipe.compat.patching import Patches, UpstreamChanged
from megatron_dynapipe.megatron_lm import pretrain_hooks as hooks
from megatron_dynapipe.megatron_lm import scaling_mode
from megatron_dynapipe.megatron_lm.arguments import DynapipeArgumentError

__all__ = [
    "CPU_FLAGS",
    "LaunchError",
    "LaunchOptions",
    "add_launch_parser",
    "launch",
    "main",
    "parse_launch_args",
    "wrap_pretrain",
]

PROG = "megatron-dynapipe launch"

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
    # Ctrl-C and SIGTERM stay as Megatron-LM's script and torchrun take them (its --exit-signal-handler)
    parser.set_defaults(func=run_from_namespace, leaves_signals_alone=True)
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
        return launch(parse_launch_args(sys.argv[1:] if argv is None else argv))
    except (LaunchError, UpstreamChanged) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


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

    The call is bound by ``pretrain``'s own signature (:func:`~megatron_dynapipe.compat.megatron_lm_script.bind_pretrain`),
    so each hook goes in by parameter name whatever the tag: the datasets provider always, the
    model provider and ``extra_args_provider`` where ``pretrain`` takes them (before core_v0.19 and
    core_v0.18), the SDPA core through the config container's ``GPTModelConfig`` where the model is
    built from it (core_v0.19); and the ``get_batch`` global of the module ``forward_step_func``
    was defined in is re-bound, returning what the script's own returns. Each hook falls through
    to the script's own without ``--dynapipe``.
    """
    installed = installed if installed is not None else _Installed()

    def dynapipe_pretrain(*args, **kwargs):
        installed.called = True
        bound = script.bind_pretrain(pretrain, args, kwargs)
        call = bound.arguments
        if hooks.is_hook(call["train_valid_test_dataset_provider"]):
            installed.patched = []  # a patched script (patches/): it calls the hooks itself
            _print_rank0("> megatron-dynapipe launch: the script calls megatron_dynapipe's pretrain hooks itself "
                         "(patched); nothing to install")
            return pretrain(*bound.args, **bound.kwargs)
        forward_step_func = call["forward_step_func"]
        script_globals = getattr(forward_step_func, "__globals__", None)
        if script_globals is None or not callable(script_globals.get("get_batch")):
            raise LaunchError(
                f"{getattr(forward_step_func, '__qualname__', forward_step_func)!r} is not defined next to a "
                "get_batch function: the launcher supports pretrain_gpt.py-style scripts (forward_step calls "
                "the module's get_batch); apply one of the patches in patches/ instead")
        if not hooks.is_hook(script_globals["get_batch"]):
            script_globals["get_batch"] = hooks.make_get_batch(script_globals["get_batch"],
                                                               script.batch_keys(script_globals))
        installed.patched = ["get_batch", "train_valid_test_datasets_provider"]
        call["train_valid_test_dataset_provider"] = hooks.datasets_provider(call["train_valid_test_dataset_provider"])
        if call.get("model_provider") is not None:
            call["model_provider"] = hooks.model_provider(call["model_provider"])
            installed.patched.append("model_provider")
        if "extra_args_provider" in call and not hooks.is_hook(call["extra_args_provider"]):
            call["extra_args_provider"] = hooks.extra_args_provider(call["extra_args_provider"])
            installed.patched.append("extra_args_provider")
        model_config = script.model_config(bound)
        if model_config is not None:
            hooks.configure_model(model_config)
            installed.patched.append("the model config's layers")
        _print_rank0(f"> megatron-dynapipe launch: hooked the script's {', '.join(installed.patched)}")
        return pretrain(*bound.args, **bound.kwargs)

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


def _check_supported(options: LaunchOptions) -> None:
    """The megatron-core the script will import (the checkout's own, first on ``sys.path``) is one
    this package supports: checked before anything runs."""
    try:
        upstream.check_supported()
    except upstream.UnsupportedUpstream as error:
        raise LaunchError(f"{options.script}: {error}") from None


def launch(options: LaunchOptions) -> int:
    """Run ``options.script`` as ``__main__`` with DynaPipe's hooks installed (see the module
    docstring). Returns 0 when the script returns (``SystemExit`` passes through)."""
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
            _check_supported(options)
            try:
                scaling_mode.run_from_argv(argv[1:])
            except DynapipeArgumentError as error:
                raise LaunchError(str(error)) from None
        return 0
    installed = _Installed()
    with _script_environment(options) as argv:
        _check_megatron_is_the_checkouts(options)
        _check_supported(options)
        try:
            import megatron.training as training_package
        except ImportError as exc:
            raise LaunchError(
                f"cannot import megatron.training from {options.megatron_lm_dir} ({exc}): the script must sit in a "
                "Megatron-LM checkout (core_v0.16.1) whose training dependencies are installed") from exc
        if options.cpu:
            from megatron_dynapipe.compat import megatron_lm_cpu  # torch and megatron: only for a CPU run

            megatron_lm_cpu.enable_megatron_lm_cpu_mode()
            # asked of TP and CP jobs before Blackwell; it orders CUDA kernel launches: nothing to order here
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
            _print_rank0(f"> megatron-dynapipe launch --cpu: appended {' '.join(CPU_FLAGS)}")
        patches = Patches()
        patches.set(training_package, "pretrain", wrap_pretrain(training_package.pretrain, installed))
        parser = script.argument_parser()  # the script parses the arguments itself (core_v0.18 and later)
        if parser is not None:
            owner, name, original = parser
            patches.replace(owner, name, hooks.parse_and_validate_args(original))
        try:
            runpy.run_path(argv[0], run_name="__main__")
        finally:
            patches.undo()
            hooks.close_loaders()
            if options.cpu:
                counts = megatron_lm_cpu.cpu_spot_calls()
                _print_rank0("> megatron-dynapipe launch --cpu: redirected "
                             + (", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "nothing"))
                megatron_lm_cpu.disable_megatron_lm_cpu_mode()
    if not installed.called:
        raise LaunchError(f"{options.script} never called megatron.training.pretrain: the launcher installs DynaPipe "
                          "through that call (run pretrain_gpt.py, or a script that calls pretrain the same way)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
