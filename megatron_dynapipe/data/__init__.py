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

from ..planning.spec import TrainingSpec
from .batch import MICROBATCH_KEYS, PlannedBatch
from .datasets import (
    IndexedTokenDataset,
    JsonlTokenDataset,
    SampleTooLongError,
    TokenListDataset,
    VariableLengthDataset,
    open_dataset,
)
from .kv_store import DataPipelineError, DataPipelineTimeout, KVStoreClient, KVStoreMetaKeys
from .loader import DataPipelineHost, DynaPipeDataLoader, RankLayout, from_parallel_state
from .preprocess import gpt_microbatch, sample_ids

__all__ = [
    "MICROBATCH_KEYS",
    "DataPipelineError",
    "DataPipelineHost",
    "DataPipelineTimeout",
    "DynaPipeDataLoader",
    "IndexedTokenDataset",
    "JsonlTokenDataset",
    "KVStoreClient",
    "KVStoreMetaKeys",
    "PlannedBatch",
    "RankLayout",
    "SampleTooLongError",
    "TokenListDataset",
    "TrainingSpec",
    "VariableLengthDataset",
    "from_parallel_state",
    "gpt_microbatch",
    "open_dataset",
    "sample_ids",
]
