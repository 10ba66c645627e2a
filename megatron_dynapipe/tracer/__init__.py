"""The fake-rank tracer: topology, representative ranks, recorder, trace files, batch configs.

``RankTrace`` (:mod:`.trace_format`) and ``trace_fake_rank`` (:mod:`.fake_rank`) are re-exported
lazily: importing this package imports neither torch nor megatron; the first use of
``trace_fake_rank`` does.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RankTrace", "trace_fake_rank"]

_LAZY = {"RankTrace": ".trace_format", "trace_fake_rank": ".fake_rank"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
