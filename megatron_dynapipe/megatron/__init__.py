"""The face Megatron-LM users import: ``megatron_dynapipe.megatron``.

What trains lives in :mod:`megatron_dynapipe.runtime` (the plan executor, its point-to-point
layer, the schedule provider) and :mod:`megatron_dynapipe.megatron_lm` (Megatron-LM's flags, the
launcher, the pretrain hooks); this package only names them, so that the ``patches/`` file
(``from megatron_dynapipe.megatron import pretrain_hooks``), ``python -m
megatron_dynapipe.megatron.launcher`` and users' imports keep working.  Everything is imported
on first use: ``import megatron_dynapipe.megatron`` stays free of torch and megatron-core.
"""

from __future__ import annotations

import importlib
from typing import Any

_RUNTIME, _MEGATRON_LM = "megatron_dynapipe.runtime", "megatron_dynapipe.megatron_lm"
#: public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(("add_arguments", "add_dynapipe_arguments", "add_tracer_arguments", "chain_providers",
                     "validate_dynapipe_args", "training_spec_from_args", "DynapipeArgumentError"),
                    f"{_MEGATRON_LM}.arguments"),
    **dict.fromkeys(("install", "uninstall", "configure", "is_enabled", "get_forward_backward_func",
                     "forward_backward_dynapipe", "InstallReport"), f"{_RUNTIME}.provider"),
    **dict.fromkeys(("run_plan", "ExecutorOptions", "RecomputeSwitch", "PlanMismatchError"), f"{_RUNTIME}.executor"),
    "PipelineCommError": f"{_RUNTIME}.p2p",
}
#: the modules this face names as its own submodules
_MODULES = {
    "arguments": f"{_MEGATRON_LM}.arguments",
    "launcher": f"{_MEGATRON_LM}.launcher",
    "pretrain_hooks": f"{_MEGATRON_LM}.pretrain_hooks",
    "provider": f"{_RUNTIME}.provider",
    "executor": f"{_RUNTIME}.executor",
    "p2p": f"{_RUNTIME}.p2p",
    "scaling_mode": "megatron_dynapipe.megatron_lm.scaling_mode",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_MODULES))
