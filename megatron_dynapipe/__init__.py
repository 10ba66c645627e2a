"""megatron-dynapipe: dynamic micro-batching and pipeline schedules for Megatron-LM.

Megatron integration, imported on first use (``import megatron_dynapipe`` pulls in neither torch
nor megatron)::

    from megatron_dynapipe import add_arguments, validate_dynapipe_args, install
    pretrain(..., extra_args_provider=add_arguments)   # or chain_providers(other, add_arguments)
    validate_dynapipe_args(args); install(args)         # after Megatron's own validation
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_MEGATRON_EXPORTS = ("add_arguments", "chain_providers", "validate_dynapipe_args", "install")

__all__ = ["__version__", *_MEGATRON_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _MEGATRON_EXPORTS:
        from megatron_dynapipe import megatron

        value = getattr(megatron, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
