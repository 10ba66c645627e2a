"""Everything that trains with Megatron: arguments, the schedule provider, the plan executor and
its point-to-point layer, the launcher and a tiny GPT for tests (running megatron-core on the CPU
lives below this package, in :mod:`megatron_dynapipe.compat`).

The names below are imported on first use, so ``import megatron_dynapipe.megatron`` (and the
argument helpers) stay free of torch and megatron-core.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "add_arguments": "arguments",
    "add_dynapipe_arguments": "arguments",
    "add_tracer_arguments": "arguments",
    "chain_providers": "arguments",
    "validate_dynapipe_args": "arguments",
    "training_spec_from_args": "arguments",
    "DynapipeArgumentError": "arguments",
    "install": "provider",
    "uninstall": "provider",
    "configure": "provider",
    "is_enabled": "provider",
    "get_forward_backward_func": "provider",
    "forward_backward_dynapipe": "provider",
    "InstallReport": "provider",
    "run_plan": "executor",
    "ExecutorOptions": "executor",
    "RecomputeSwitch": "executor",
    "PlanMismatchError": "executor",
    "PipelineCommError": "p2p",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
