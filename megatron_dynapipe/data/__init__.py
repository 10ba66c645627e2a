"""The data pipeline for planned schedules.

``TrainingSpec`` (with ``fast_mode``) -> KV store (``torch.distributed.TCPStore`` hosted by rank
0) -> preprocessing workers (plans + micro-batches per DP rank and stage) -> every training rank
iterates a :class:`DynaPipeDataLoader` of :class:`PlannedBatch`.

* :mod:`.datasets`: variable-length samples (Megatron ``.bin/.idx``, JSONL, in memory) with a
  ``max_seq_len`` check and an explicit ``truncate`` flag.
* :mod:`.kv_store`: key names (:class:`KVStoreMetaKeys`) and a small TCPStore client.
* :mod:`.preprocess`: the poller, the workers and the micro-batch format.
* :mod:`.loader`: :class:`DataPipelineHost` (rank 0) and :class:`DynaPipeDataLoader` (every rank).
"""

from __future__ import annotations

from typing import Any

from megatron_dynapipe.data.batch import MICROBATCH_KEYS, PlannedBatch
from megatron_dynapipe.data.datasets import (
    IndexedTokenDataset,
    JsonlTokenDataset,
    SampleTooLongError,
    TokenListDataset,
    VariableLengthDataset,
    open_dataset,
)
from megatron_dynapipe.planning.spec import TrainingSpec

# The store, workers and loader need torch: imported on first use, so that importing
# ``megatron_dynapipe.data.batch`` or the datasets stays torch-free.
_LAZY = {
    "DataPipelineError": "kv_store",
    "DataPipelineTimeout": "kv_store",
    "KVStoreClient": "kv_store",
    "KVStoreMetaKeys": "kv_store",
    "DataPipelineHost": "loader",
    "DynaPipeDataLoader": "loader",
    "RankLayout": "loader",
    "from_parallel_state": "loader",
    "gpt_microbatch": "preprocess",
    "sample_ids": "preprocess",
}

__all__ = [
    "MICROBATCH_KEYS",
    "IndexedTokenDataset",
    "JsonlTokenDataset",
    "PlannedBatch",
    "SampleTooLongError",
    "TokenListDataset",
    "TrainingSpec",
    "VariableLengthDataset",
    "open_dataset",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
