"""Datasets of variable-length token sequences, one sample per item, no packing.

Three implementations of :class:`VariableLengthDataset`:

* :class:`IndexedTokenDataset`: Megatron's indexed dataset (``<prefix>.bin`` / ``<prefix>.idx``,
  as written by megatron-core's ``IndexedDatasetBuilder`` and Megatron-LM's
  ``tools/preprocess_data.py``), read through megatron-core's own ``IndexedDataset``. A sample is
  a *document* by default (the unit Megatron's GPT datasets sample from; with
  ``--split-sentences`` a document spans several sequences, which are concatenated) or, with
  ``unit="sequence"``, one stored sequence.
* :class:`JsonlTokenDataset`: one sample per non-blank line, either a JSON list of token ids
  (``[12, 7, 99]``) or an object holding that list under ``key`` (``{"input_ids": [...]}``).
* :class:`TokenListDataset`: token arrays held in memory (small experiments, tests).

Length limit. Every dataset is built with ``max_seq_len``: the longest sample a micro-batch may
hold (it must not exceed the model's position-embedding table; note that the planner pads
micro-batches to a multiple of ``TrainingSpec.seqlen_round``, so choose ``max_seq_len`` as a
multiple of it). A sample longer than that is an error (:class:`SampleTooLongError`, raised when
the dataset is built, naming the sample and the ``truncate`` flag) unless ``truncate=True``, which
keeps the *first* ``max_seq_len`` tokens of each long sample and drops the rest; the number of
truncated samples is logged as a warning and kept in ``num_truncated``. Truncation happens in
``__getitem__`` and ``lengths``, so the planner and the tensors always agree.

Empty samples (documents without tokens, empty lists) carry nothing to train on: they are left
out of the dataset's index (``len`` does not count them), counted in ``num_empty`` and logged.
Dataset index ``i`` therefore means "the i-th non-empty sample".

Datasets pickle without their data, so the preprocessing workers reopen them: an
:class:`IndexedTokenDataset` as its path and options (the receiver memory-maps the index again
and checks it still holds as many samples), a :class:`JsonlTokenDataset` with its per-line
offsets and lengths (24 bytes a line, so the file is not scanned again). A
dataset may define ``warm_up()``: the poller calls it once before it forks the workers, to import
what reading needs (megatron-core, for :class:`IndexedTokenDataset`) once for all of them.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = [
    "IndexedTokenDataset",
    "JsonlTokenDataset",
    "SampleTooLongError",
    "TokenListDataset",
    "VariableLengthDataset",
    "open_dataset",
]

logger = logging.getLogger(__name__)


class SampleTooLongError(ValueError):
    """A sample exceeds ``max_seq_len`` and truncation was not asked for."""


@runtime_checkable
class VariableLengthDataset(Protocol):
    """What the data pipeline needs of a dataset.

    ``dataset[i]`` is the 1-D integer array of token ids of sample ``i`` (``0 <= i < len``),
    at most ``max_seq_len`` long and never empty; ``lengths[i] == len(dataset[i])``. Instances
    must pickle (the preprocessing workers receive them through the KV store).
    """

    max_seq_len: int

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...

    @property
    def lengths(self) -> np.ndarray: ...


class _TokenDataset:
    """Shared part: the index of non-empty samples, the length limit and truncation."""

    max_seq_len: int
    truncate: bool
    num_truncated: int
    num_empty: int

    def _init_limits(self, raw_lengths: np.ndarray, max_seq_len: int, truncate: bool, source: str,
                     describe=None, quiet: bool = False) -> None:
        if isinstance(max_seq_len, bool) or int(max_seq_len) != max_seq_len or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        self.max_seq_len = int(max_seq_len)
        self.truncate = bool(truncate)
        raw = np.asarray(raw_lengths, dtype=np.int64)
        self._ids = np.flatnonzero(raw > 0)  # dataset index -> raw sample number
        self.num_empty = int(len(raw) - len(self._ids))
        kept = raw[self._ids]
        too_long = np.flatnonzero(kept > self.max_seq_len)
        self.num_truncated = int(len(too_long))
        if self.num_empty and not quiet:
            logger.warning("%s: left out %d empty sample(s)", source, self.num_empty)
        if len(too_long) and not self.truncate:
            first = int(too_long[0])
            where = describe(int(self._ids[first])) if describe else f"raw sample {int(self._ids[first])}"
            raise SampleTooLongError(
                f"{source}: sample {first} ({where}) has {int(kept[first])} tokens, more than "
                f"max_seq_len={self.max_seq_len} ({len(too_long)} of {len(kept)} samples are too long, "
                f"the longest has {int(kept.max())} tokens). Pass truncate=True to keep the first "
                f"{self.max_seq_len} tokens of each, raise max_seq_len, or filter the data."
            )
        if len(too_long) and not quiet:
            logger.warning(
                "%s: truncating %d of %d samples to their first max_seq_len=%d tokens (truncate=True)",
                source, len(too_long), len(kept), self.max_seq_len,
            )
        self._lengths = np.minimum(kept, self.max_seq_len)
        self._lengths.setflags(write=False)

    def __len__(self) -> int:
        return int(len(self._ids))

    @property
    def lengths(self) -> np.ndarray:
        """Token count of each sample, after truncation (read-only int64 array)."""
        return self._lengths

    def _raw_index(self, index: int) -> int:
        i = int(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {index} is out of range for a dataset of {len(self)} samples")
        return int(self._ids[i])

    def __getitem__(self, index: int) -> np.ndarray:
        tokens = np.asarray(self._read(self._raw_index(index)))
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"sample {index}: expected a 1-D integer array of token ids, got "
                             f"{tokens.dtype} of shape {tokens.shape}")
        return tokens[: self.max_seq_len]  # the limit was checked at construction

    def _read(self, raw_index: int) -> np.ndarray:
        raise NotImplementedError


class IndexedTokenDataset(_TokenDataset):
    """A Megatron indexed dataset (``path_prefix`` + ``.bin``/``.idx``) through megatron-core.

    ``unit="document"`` (default): a sample is a document (its sequences concatenated);
    ``unit="sequence"``: a sample is one stored sequence. See the module docstring for
    ``max_seq_len`` / ``truncate``.
    """

    def __init__(self, path_prefix: "str | os.PathLike", max_seq_len: int, *, truncate: bool = False,
                 unit: str = "document", mmap: bool = True):
        if unit not in ("document", "sequence"):
            raise ValueError(f"unit must be 'document' or 'sequence', got {unit!r}")
        self.path_prefix = os.fspath(path_prefix)
        self.unit = unit
        self.mmap = bool(mmap)
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(self.path_prefix + suffix):
                raise FileNotFoundError(
                    f"no Megatron indexed dataset at {self.path_prefix!r}: {self.path_prefix + suffix} is "
                    "missing (give the path prefix, without .bin/.idx)"
                )
        self._load(max_seq_len, truncate, quiet=False)

    def _load(self, max_seq_len: int, truncate: bool, quiet: bool) -> None:
        self._dataset = None
        index = self._open()
        seq_lengths = np.asarray(index.sequence_lengths, dtype=np.int64)
        if self.unit == "sequence":
            raw = seq_lengths
            self._doc_bounds = None
        else:
            bounds = np.asarray(index.document_indices, dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(seq_lengths)])
            raw = starts[bounds[1:]] - starts[bounds[:-1]]
            self._doc_bounds = bounds
        unit = self.unit
        self._init_limits(raw, max_seq_len, truncate, f"indexed dataset {self.path_prefix!r}",
                          describe=lambda r: f"{unit} {r}", quiet=quiet)

    def _open(self):
        if self._dataset is None:
            from megatron.core.datasets.indexed_dataset import IndexedDataset  # heavy: import lazily

            self._dataset = IndexedDataset(self.path_prefix, mmap=self.mmap)
        return self._dataset

    def warm_up(self) -> None:
        """Import megatron-core's reader (the poller calls this once before forking workers)."""
        import megatron.core.datasets.indexed_dataset  # noqa: F401

    def _read(self, raw_index: int) -> np.ndarray:
        dataset = self._open()
        if self._doc_bounds is None:
            return dataset.get(raw_index, 0, int(min(dataset.sequence_lengths[raw_index], self.max_seq_len)))
        first, last = int(self._doc_bounds[raw_index]), int(self._doc_bounds[raw_index + 1])
        if last - first == 1:
            length = int(min(dataset.sequence_lengths[first], self.max_seq_len))
            return dataset.get(first, 0, length)
        return np.concatenate(dataset[first:last])

    def __getstate__(self):
        # Only the path and options travel (the index of a large corpus is big); the receiver
        # memory-maps the files again and rebuilds the lengths from them.
        return {"path_prefix": self.path_prefix, "unit": self.unit, "mmap": self.mmap,
                "max_seq_len": self.max_seq_len, "truncate": self.truncate, "num_samples": len(self)}

    def __setstate__(self, state) -> None:
        self.path_prefix, self.unit, self.mmap = state["path_prefix"], state["unit"], state["mmap"]
        self._load(state["max_seq_len"], state["truncate"], quiet=True)
        if len(self) != state["num_samples"]:
            raise RuntimeError(f"the indexed dataset at {self.path_prefix!r} has {len(self)} samples here but had "
                               f"{state['num_samples']} where it was opened: it changed, or another copy is read")

    def __repr__(self) -> str:
        return (f"IndexedTokenDataset({self.path_prefix!r}, max_seq_len={self.max_seq_len}, "
                f"truncate={self.truncate}, unit={self.unit!r}, samples={len(self)})")


class JsonlTokenDataset(_TokenDataset):
    """Token ids in a JSON-lines file: a list per line, or an object with the list under ``key``.

    Building it reads the file once (to find each sample's offset and length); blank lines are
    skipped. Lines are re-read and parsed on access.
    """

    def __init__(self, path: "str | os.PathLike", max_seq_len: int, *, truncate: bool = False,
                 key: str = "input_ids"):
        self.path = os.fspath(path)
        self.key = key
        offsets, raw, line_numbers = [], [], []
        with open(self.path, "rb") as f:
            offset = 0
            for number, line in enumerate(f, start=1):
                if line.strip():
                    tokens = self._parse(line, number)
                    offsets.append(offset)
                    raw.append(len(tokens))
                    line_numbers.append(number)
                offset += len(line)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._line_numbers = np.asarray(line_numbers, dtype=np.int64)
        self._file = None
        self._pid = None
        self._init_limits(np.asarray(raw, dtype=np.int64), max_seq_len, truncate, f"JSONL file {self.path!r}",
                          describe=lambda r: f"line {int(self._line_numbers[r])}")

    def _parse(self, line: bytes, number: int) -> list:
        try:
            value = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{self.path}, line {number}: not valid JSON ({error})") from None
        if isinstance(value, dict):
            if self.key not in value:
                raise ValueError(f"{self.path}, line {number}: the object has no {self.key!r} key "
                                 f"(keys: {', '.join(map(str, value)) or 'none'}); pass key=...")
            value = value[self.key]
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                  for t in value):
            raise ValueError(f"{self.path}, line {number}: expected a list of non-negative integer "
                             f"token ids (or an object with one under {self.key!r})")
        return value

    def _read(self, raw_index: int) -> np.ndarray:
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = open(self.path, "rb"), os.getpid()
        self._file.seek(int(self._offsets[raw_index]))
        line = self._file.readline()
        return np.asarray(self._parse(line, int(self._line_numbers[raw_index])), dtype=np.int64)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_file"] = state["_pid"] = None
        return state

    def __repr__(self) -> str:
        return (f"JsonlTokenDataset({self.path!r}, max_seq_len={self.max_seq_len}, "
                f"truncate={self.truncate}, samples={len(self)})")


class TokenListDataset(_TokenDataset):
    """Samples held in memory, as a sequence of 1-D integer arrays or lists."""

    def __init__(self, samples: Sequence, max_seq_len: int, *, truncate: bool = False):
        self._samples = [np.asarray(s, dtype=np.int64) for s in samples]
        for i, s in enumerate(self._samples):
            if s.ndim != 1:
                raise ValueError(f"sample {i}: expected a 1-D array of token ids, got shape {s.shape}")
        self._init_limits(np.array([len(s) for s in self._samples], dtype=np.int64), max_seq_len, truncate,
                          "token list")

    def _read(self, raw_index: int) -> np.ndarray:
        return self._samples[raw_index]


def open_dataset(path: "str | os.PathLike", max_seq_len: int, *, truncate: bool = False,
                 **options) -> VariableLengthDataset:
    """A ``.jsonl``/``.json`` file as :class:`JsonlTokenDataset`, anything else as the prefix of
    a Megatron indexed dataset (:class:`IndexedTokenDataset`)."""
    path = os.fspath(path)
    if path.endswith((".jsonl", ".json")):
        return JsonlTokenDataset(path, max_seq_len, truncate=truncate, **options)
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return IndexedTokenDataset(path, max_seq_len, truncate=truncate, **options)
