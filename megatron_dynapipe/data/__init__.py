"""The data pipeline for planned schedules.

``TrainingSpec`` (with ``fast_mode``) -> KV store (``torch.distributed.TCPStore`` hosted by rank
0, every value authenticated) -> preprocessing workers (plans and sample ids per DP rank and
stage) -> every training rank iterates a :class:`DynaPipeDataLoader` of :class:`PlannedBatch`,
reading its samples from its own copy of the dataset.

* :mod:`.datasets`: variable-length samples (Megatron ``.bin/.idx``, JSONL, token files, in
  memory, mock) with a ``max_seq_len`` and a policy for longer ones; descriptors.
* :mod:`.blend`: weighted blends of datasets and ``--split`` ranges; :mod:`.sft`: Megatron's SFT
  conversations.
* :mod:`.sampling`: which samples each iteration trains (epochs, ramp-up).
* :mod:`.kv_store`: key names and the authenticated TCPStore client; :mod:`.liveness`: watches.
* :mod:`.preprocess`: the poller and the workers; :mod:`.microbatches`: ids and GPT arrays.
* :mod:`.loader`: :class:`DataPipelineHost` (rank 0) and :class:`DynaPipeDataLoader` (every rank).
"""

from __future__ import annotations

from typing import Any

from megatron_dynapipe.data.batch import MICROBATCH_KEYS, PlannedBatch
from megatron_dynapipe.data.blend import BlendedDataset, SplitDataset, split_dataset
from megatron_dynapipe.data.datasets import (
    LONG_SAMPLES,
    IndexedTokenDataset,
    JsonlTokenDataset,
    MockDataset,
    SampleTooLongError,
    TokenFileDataset,
    TokenListDataset,
    VariableLengthDataset,
    open_dataset,
    open_descriptor,
)
from megatron_dynapipe.data.sampling import BatchSchedule
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
    "job_secret": "loader",
}

__all__ = [
    "LONG_SAMPLES",
    "MICROBATCH_KEYS",
    "BatchSchedule",
    "BlendedDataset",
    "IndexedTokenDataset",
    "JsonlTokenDataset",
    "MockDataset",
    "PlannedBatch",
    "SampleTooLongError",
    "SplitDataset",
    "TokenFileDataset",
    "TokenListDataset",
    "TrainingSpec",
    "VariableLengthDataset",
    "open_dataset",
    "open_descriptor",
    "split_dataset",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
