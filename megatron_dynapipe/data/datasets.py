"""Datasets of variable-length token sequences, one sample per item, no packing.

* :class:`IndexedTokenDataset`: Megatron's indexed dataset (``<prefix>.bin`` / ``<prefix>.idx``,
  as written by megatron-core's ``IndexedDatasetBuilder`` and Megatron-LM's
  ``tools/preprocess_data.py``), read through megatron-core's own ``IndexedDataset``. A raw sample
  is a *document* by default (the unit Megatron's GPT datasets sample from; with
  ``--split-sentences`` a document spans several sequences, which are concatenated) or, with
  ``unit="sequence"``, one stored sequence.
* :class:`JsonlTokenDataset`: one raw sample per non-blank line, a JSON list of token ids
  (``[12, 7, 99]``) or an object holding that list under ``key`` (``{"input_ids": [...]}``).
* :class:`TokenFileDataset`: token arrays in a directory of ``.npy`` files (memory-mapped), with
  an optional per-token target mask (SFT: prompt tokens are not predicted); what
  :meth:`TokenListDataset.save` and :func:`~.sft.tokenize_conversations` write.
* :class:`TokenListDataset`: token arrays held in memory (small experiments, tests).
* :class:`MockDataset`: counting sequences of random lengths, made from a seed on every rank
  (Megatron's ``--mock-data``).

Long samples. Every dataset has ``max_seq_len``, the longest sample a micro-batch may hold (at
most the model's position table; the planner pads to a multiple of ``TrainingSpec.seqlen_round``,
so choose a multiple of it). A longer raw sample is handled as ``long_samples`` says:

* ``"split"`` (default): cut into windows of ``max_seq_len`` tokens that overlap by one token,
  so every token after a document's first is a prediction target exactly once (the last token
  of a window is the first of the next: an input there, the target of the window before);
* ``"truncate"``: keep the first ``max_seq_len`` tokens, drop the rest;
* ``"refuse"``: :class:`SampleTooLongError` when the dataset is opened, naming the sample.

Empty raw samples carry nothing to train on: they are left out (``num_empty`` counts them).
Dataset index ``i`` is the i-th sample after that.

Each dataset describes itself as JSON (:meth:`descriptor`: kind, paths, options, and the sample
count and a fingerprint of the lengths) and :func:`open_descriptor` opens a description again,
checking the count and fingerprint: that is how the preprocessing workers and every training rank
read the same samples without anything executable crossing the network. An in-memory
:class:`TokenListDataset` has no description until saved to a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = [
    "LONG_SAMPLES",
    "IndexedTokenDataset",
    "JsonlTokenDataset",
    "MockDataset",
    "SampleTooLongError",
    "TokenFileDataset",
    "TokenListDataset",
    "VariableLengthDataset",
    "fingerprint",
    "open_dataset",
    "open_descriptor",
    "register_kind",
]

logger = logging.getLogger(__name__)

LONG_SAMPLES = ("split", "truncate", "refuse")


class SampleTooLongError(ValueError):
    """A sample exceeds ``max_seq_len`` and ``long_samples="refuse"``."""


@runtime_checkable
class VariableLengthDataset(Protocol):
    """What the data pipeline needs of a dataset.

    ``dataset[i]`` is the 1-D integer array of token ids of sample ``i`` (``0 <= i < len``), at
    most ``max_seq_len`` long and never empty; ``lengths[i] == len(dataset[i])``;
    ``target_mask(i)`` is None when every token after the first is a prediction target, else a
    boolean array over the sample's tokens; ``descriptor()`` is the JSON :func:`open_descriptor`
    opens again.
    """

    max_seq_len: int

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...

    @property
    def lengths(self) -> np.ndarray: ...

    def target_mask(self, index: int) -> "np.ndarray | None": ...

    def descriptor(self) -> dict: ...


def fingerprint(lengths: np.ndarray) -> str:
    """A short hash of a dataset's sample lengths: two copies that differ almost surely differ here."""
    return hashlib.blake2b(np.ascontiguousarray(lengths, dtype="<i8").tobytes(), digest_size=12).hexdigest()


class _TokenDataset:
    """Shared part: the index of samples over raw samples (windows of long ones), the length limit."""

    max_seq_len: int
    long_samples: str
    num_split: int  # raw samples cut into windows
    num_truncated: int
    num_empty: int

    def _init_index(self, raw_lengths: np.ndarray, max_seq_len: int, long_samples: str, source: str,
                    describe=None, quiet: bool = False) -> None:
        if isinstance(max_seq_len, bool) or int(max_seq_len) != max_seq_len or max_seq_len < 2:
            raise ValueError(f"max_seq_len must be an integer of at least 2, got {max_seq_len!r}")
        if long_samples not in LONG_SAMPLES:
            raise ValueError(f"long_samples must be one of {', '.join(LONG_SAMPLES)}, got {long_samples!r}")
        self.max_seq_len, self.long_samples = int(max_seq_len), long_samples
        raw = np.asarray(raw_lengths, dtype=np.int64)
        self.num_documents = int(len(raw))
        kept = np.flatnonzero(raw > 0)
        self.num_empty = int(len(raw) - len(kept))
        too_long = kept[raw[kept] > self.max_seq_len]
        self.num_split = self.num_truncated = 0
        if len(too_long) and long_samples == "refuse":
            first = int(too_long[0])
            where = describe(first) if describe else f"raw sample {first}"
            raise SampleTooLongError(
                f"{source}: {where} has {int(raw[first])} tokens, more than max_seq_len={self.max_seq_len} "
                f"({len(too_long)} of {len(kept)} samples are longer, the longest {int(raw.max())} tokens): split "
                f"them into windows (long_samples='split', --dynapipe-long-samples split), truncate them, or raise "
                "the sequence length")
        if long_samples == "split":
            step = self.max_seq_len - 1  # windows overlap by one token
            windows = np.where(raw[kept] > self.max_seq_len, -(-(raw[kept] - 1) // step), 1)
            self._raw = np.repeat(kept, windows)
            first_window = np.repeat(np.cumsum(windows) - windows, windows)
            self._start = (np.arange(len(self._raw)) - first_window) * step
            self._lengths = np.minimum(raw[self._raw] - self._start, self.max_seq_len)
            self.num_split = len(too_long)
        else:
            self._raw, self._start = kept, np.zeros(len(kept), dtype=np.int64)
            self._lengths = np.minimum(raw[kept], self.max_seq_len)
            self.num_truncated = len(too_long)
        if not quiet and (self.num_empty or len(too_long)):
            logger.info("%s: %d samples from %d raw ones (%d empty left out, %d longer than %d %s)", source,
                        len(self._raw), len(raw), self.num_empty, len(too_long), self.max_seq_len,
                        "split into windows" if long_samples == "split" else "truncated")
        for array in (self._raw, self._start, self._lengths):
            array.setflags(write=False)

    def __len__(self) -> int:
        return int(len(self._raw))

    @property
    def lengths(self) -> np.ndarray:
        """Token count of each sample (read-only int64 array)."""
        return self._lengths

    @property
    def documents(self) -> np.ndarray:
        """The raw document (0 .. ``num_documents`` - 1) each sample comes from, ascending: a long
        document's windows are consecutive samples of one document (read-only int64 array)."""
        return self._raw

    def _where(self, index: int) -> tuple[int, int, int]:
        i = int(index)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {index} is out of range for a dataset of {len(self)} samples")
        return int(self._raw[i]), int(self._start[i]), int(self._lengths[i])

    def __getitem__(self, index: int) -> np.ndarray:
        raw, start, length = self._where(index)
        tokens = np.asarray(self._read(raw, start, length))
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or len(tokens) != length:
            raise ValueError(f"sample {index}: expected {length} integer token ids, got {tokens.dtype} of shape "
                             f"{tokens.shape}")
        return tokens

    def target_mask(self, index: int) -> "np.ndarray | None":
        return None

    def _read(self, raw: int, start: int, length: int) -> np.ndarray:
        raise NotImplementedError

    def _described(self, kind: str, **options) -> dict:
        return dict(kind=kind, max_seq_len=self.max_seq_len, long_samples=self.long_samples,
                    num_samples=len(self), fingerprint=fingerprint(self.lengths), **options)



def check_dataset_files(path_prefix: "str | os.PathLike") -> str:
    """The absolute prefix of a Megatron indexed dataset; FileNotFoundError naming the file that is missing."""
    prefix = os.path.abspath(os.fspath(path_prefix))
    for suffix in (".bin", ".idx"):
        if not os.path.isfile(prefix + suffix):
            raise FileNotFoundError(f"no Megatron indexed dataset at {prefix!r}: {prefix + suffix} is missing (give "
                                    "the path prefix, without .bin/.idx)")
    return prefix


class IndexedTokenDataset(_TokenDataset):
    """A Megatron indexed dataset (``path_prefix`` + ``.bin``/``.idx``) through megatron-core.

    ``unit="document"`` (default): a raw sample is a document (its sequences concatenated);
    ``unit="sequence"``: one stored sequence. ``long_samples``: see the module docstring.
    """

    def __init__(self, path_prefix: "str | os.PathLike", max_seq_len: int, *, long_samples: str = "split",
                 unit: str = "document", mmap: bool = True, quiet: bool = False):
        if unit not in ("document", "sequence"):
            raise ValueError(f"unit must be 'document' or 'sequence', got {unit!r}")
        self.path_prefix = check_dataset_files(path_prefix)
        self.unit, self.mmap = unit, bool(mmap)
        from megatron.core.datasets.indexed_dataset import IndexedDataset  # heavy: imported when one is opened

        self._dataset = IndexedDataset(self.path_prefix, mmap=self.mmap)
        sequences = np.asarray(self._dataset.sequence_lengths, dtype=np.int64)
        if unit == "sequence":
            raw, self._documents = sequences, None
        else:
            self._documents = np.asarray(self._dataset.document_indices, dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(sequences)])
            raw = starts[self._documents[1:]] - starts[self._documents[:-1]]
        self._init_index(raw, max_seq_len, long_samples, f"indexed dataset {self.path_prefix!r}",
                         describe=lambda r: f"{unit} {r}", quiet=quiet)

    def _read(self, raw: int, start: int, length: int) -> np.ndarray:
        if self._documents is None:
            return self._dataset.get(raw, start, length)
        first, last = int(self._documents[raw]), int(self._documents[raw + 1])
        if last - first == 1:
            return self._dataset.get(first, start, length)
        return np.concatenate(self._dataset[first:last])[start:start + length]

    def descriptor(self) -> dict:
        return self._described("indexed", path_prefix=self.path_prefix, unit=self.unit, mmap=self.mmap)

    @classmethod
    def from_descriptor(cls, d: dict) -> "IndexedTokenDataset":
        return cls(d["path_prefix"], d["max_seq_len"], long_samples=d["long_samples"], unit=d["unit"], mmap=d["mmap"],
                   quiet=True)

    def __repr__(self) -> str:
        return (f"IndexedTokenDataset({self.path_prefix!r}, max_seq_len={self.max_seq_len}, "
                f"long_samples={self.long_samples!r}, unit={self.unit!r}, samples={len(self)})")


class JsonlTokenDataset(_TokenDataset):
    """Token ids in a JSON-lines file: a list per line, or an object with the list under ``key``.

    Opening reads the file once (each sample's offset and length); blank lines are skipped.
    Lines are re-read and parsed on access.
    """

    def __init__(self, path: "str | os.PathLike", max_seq_len: int, *, long_samples: str = "split",
                 key: str = "input_ids", quiet: bool = False):
        self.path, self.key = os.path.abspath(os.fspath(path)), key
        offsets, raw, line_numbers = [], [], []
        with open(self.path, "rb") as f:
            offset = 0
            for number, line in enumerate(f, start=1):
                if line.strip():
                    offsets.append(offset)
                    raw.append(len(self._parse(line, number)))
                    line_numbers.append(number)
                offset += len(line)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._line_numbers = np.asarray(line_numbers, dtype=np.int64)
        self._file, self._pid = None, None
        self._init_index(np.asarray(raw, dtype=np.int64), max_seq_len, long_samples, f"JSONL file {self.path!r}",
                         describe=lambda r: f"line {int(self._line_numbers[r])}", quiet=quiet)

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

    def _read(self, raw: int, start: int, length: int) -> np.ndarray:
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = open(self.path, "rb"), os.getpid()
        self._file.seek(int(self._offsets[raw]))
        tokens = self._parse(self._file.readline(), int(self._line_numbers[raw]))
        return np.asarray(tokens[start:start + length], dtype=np.int64)

    def descriptor(self) -> dict:
        return self._described("jsonl", path=self.path, key=self.key)

    @classmethod
    def from_descriptor(cls, d: dict) -> "JsonlTokenDataset":
        return cls(d["path"], d["max_seq_len"], long_samples=d["long_samples"], key=d["key"], quiet=True)

    def __repr__(self) -> str:
        return (f"JsonlTokenDataset({self.path!r}, max_seq_len={self.max_seq_len}, "
                f"long_samples={self.long_samples!r}, samples={len(self)})")


class TokenFileDataset(_TokenDataset):
    """Samples in a directory written by :meth:`write`: ``tokens.npy`` (every sample's tokens,
    concatenated), ``offsets.npy`` (where each starts, and the end) and, optionally,
    ``targets.npy`` (a per-token bool: whether the token is a prediction target)."""

    def __init__(self, directory: "str | os.PathLike", max_seq_len: int, *, long_samples: str = "split",
                 quiet: bool = False):
        self.directory = os.path.abspath(os.fspath(directory))
        try:
            self._tokens = np.load(os.path.join(self.directory, "tokens.npy"), mmap_mode="r")
            self._offsets = np.load(os.path.join(self.directory, "offsets.npy"))
        except FileNotFoundError:
            raise FileNotFoundError(f"no token file at {self.directory!r} (tokens.npy and offsets.npy): write one with "
                                    "TokenFileDataset.write or TokenListDataset.save") from None
        targets = os.path.join(self.directory, "targets.npy")
        self._targets = np.load(targets, mmap_mode="r") if os.path.exists(targets) else None
        self._init_index(np.diff(self._offsets), max_seq_len, long_samples, f"token file {self.directory!r}",
                         quiet=quiet)

    @staticmethod
    def write(directory: "str | os.PathLike", samples: Sequence, targets: "Sequence | None" = None) -> None:
        """Write ``samples`` (and per-token ``targets``) to ``directory`` atomically: a reader
        sees all of it or nothing."""
        directory = os.path.abspath(os.fspath(directory))
        arrays = [np.asarray(s, dtype=np.int64) for s in samples]
        if any(a.ndim != 1 for a in arrays):
            raise ValueError("every sample must be a 1-D array of token ids")
        staging = tempfile.mkdtemp(prefix=".writing-", dir=os.path.dirname(directory) or ".")
        try:
            tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
            dtype = np.int32 if not tokens.size or (tokens.min() >= 0 and tokens.max() < 2**31) else np.int64
            np.save(os.path.join(staging, "tokens.npy"), tokens.astype(dtype))
            np.save(os.path.join(staging, "offsets.npy"), np.concatenate([[0], np.cumsum([len(a) for a in arrays])]))
            if targets is not None:
                masks = [np.asarray(t, dtype=bool) for t in targets]
                if [len(m) for m in masks] != [len(a) for a in arrays]:
                    raise ValueError("every sample needs one target flag per token")
                np.save(os.path.join(staging, "targets.npy"), np.concatenate(masks) if masks else np.zeros(0, bool))
            if os.path.exists(directory):
                shutil.rmtree(directory)
            os.replace(staging, directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _read(self, raw: int, start: int, length: int) -> np.ndarray:
        begin = int(self._offsets[raw]) + start
        return np.asarray(self._tokens[begin:begin + length], dtype=np.int64)

    def target_mask(self, index: int) -> "np.ndarray | None":
        if self._targets is None:
            return None
        raw, start, length = self._where(index)
        begin = int(self._offsets[raw]) + start
        return np.asarray(self._targets[begin:begin + length], dtype=bool)

    def descriptor(self) -> dict:
        return self._described("token_file", directory=self.directory)

    @classmethod
    def from_descriptor(cls, d: dict) -> "TokenFileDataset":
        return cls(d["directory"], d["max_seq_len"], long_samples=d["long_samples"], quiet=True)

    def __repr__(self) -> str:
        return (f"TokenFileDataset({self.directory!r}, max_seq_len={self.max_seq_len}, "
                f"long_samples={self.long_samples!r}, samples={len(self)})")


class TokenListDataset(_TokenDataset):
    """Samples held in memory: a sequence of 1-D integer arrays or lists (``targets``: optional
    per-token bool arrays, as :class:`TokenFileDataset` has them)."""

    def __init__(self, samples: Sequence, max_seq_len: int, *, long_samples: str = "split",
                 targets: "Sequence | None" = None):
        self._samples = [np.asarray(s, dtype=np.int64) for s in samples]
        for i, s in enumerate(self._samples):
            if s.ndim != 1:
                raise ValueError(f"sample {i}: expected a 1-D array of token ids, got shape {s.shape}")
        self._targets = None if targets is None else [np.asarray(t, dtype=bool) for t in targets]
        self._init_index(np.array([len(s) for s in self._samples], dtype=np.int64), max_seq_len, long_samples,
                         "token list")

    def _read(self, raw: int, start: int, length: int) -> np.ndarray:
        return self._samples[raw][start:start + length]

    def target_mask(self, index: int) -> "np.ndarray | None":
        if self._targets is None:
            return None
        raw, start, length = self._where(index)
        return self._targets[raw][start:start + length]

    def save(self, directory: "str | os.PathLike") -> TokenFileDataset:
        """The same samples as a :class:`TokenFileDataset` in ``directory`` (which every rank
        that reads them must see)."""
        TokenFileDataset.write(directory, self._samples, self._targets)
        return TokenFileDataset(directory, self.max_seq_len, long_samples=self.long_samples, quiet=True)

    def descriptor(self) -> dict:
        raise TypeError("an in-memory TokenListDataset has no description other processes can open: save it "
                        "(dataset.save(directory)) where every rank sees the directory")


class MockDataset(_TokenDataset):
    """``num_samples`` samples of random length in ``[max(2, max_seq_len // 8), max_seq_len]``;
    sample ``k`` counts up from a random start, modulo ``vocab_size`` (a model can learn it: the
    loss falls). Made from the seed wherever it is opened."""

    def __init__(self, num_samples: int, max_seq_len: int, vocab_size: int, seed: int = 0):
        rng = np.random.default_rng([int(seed), 0x6D6F636B])
        low = max(2, int(max_seq_len) // 8)
        raw = rng.integers(low, int(max_seq_len) + 1, size=int(num_samples))
        self._starts = rng.integers(0, int(vocab_size), size=int(num_samples))
        self.num_samples_, self.vocab_size, self.seed = int(num_samples), int(vocab_size), int(seed)
        self._init_index(raw, max_seq_len, "split", "mock data", quiet=True)

    def _read(self, raw: int, start: int, length: int) -> np.ndarray:
        return (self._starts[raw] + start + np.arange(length, dtype=np.int64)) % self.vocab_size

    def descriptor(self) -> dict:
        return self._described("mock", raw_samples=self.num_samples_, vocab_size=self.vocab_size, seed=self.seed)

    @classmethod
    def from_descriptor(cls, d: dict) -> "MockDataset":
        return cls(d["raw_samples"], d["max_seq_len"], d["vocab_size"], d["seed"])


_KINDS: dict[str, type] = {"indexed": IndexedTokenDataset, "jsonl": JsonlTokenDataset,
                           "token_file": TokenFileDataset, "mock": MockDataset}


def register_kind(kind: str, cls: type) -> None:
    """Make ``open_descriptor`` open descriptors of ``kind`` with ``cls.from_descriptor``."""
    _KINDS[kind] = cls


def open_descriptor(descriptor: dict) -> VariableLengthDataset:
    """The dataset a :meth:`descriptor` describes, opened here; ValueError (one line naming the
    fix) when it is not the same data as where it was described."""
    kind = descriptor.get("kind") if isinstance(descriptor, dict) else None
    if kind not in _KINDS:
        raise ValueError(f"unknown dataset kind {kind!r} in a data pipeline descriptor: this version reads "
                         f"{', '.join(sorted(_KINDS))}")
    try:
        dataset = _KINDS[kind].from_descriptor(descriptor)
    except FileNotFoundError as error:
        raise ValueError(f"{error}: every rank must see the dataset's files (a shared file system, or the same "
                         "path on every machine)") from None
    if len(dataset) != descriptor["num_samples"] or fingerprint(dataset.lengths) != descriptor["fingerprint"]:
        raise ValueError(
            f"the {kind} dataset opened here ({len(dataset)} samples) is not the one rank 0 described "
            f"({descriptor['num_samples']} samples, other lengths): the files changed, or this machine reads "
            "another copy; every rank must read the same files")
    return dataset


def open_dataset(path: "str | os.PathLike", max_seq_len: int, *, long_samples: str = "split",
                 **options) -> VariableLengthDataset:
    """A ``.jsonl``/``.json`` file as :class:`JsonlTokenDataset`, a directory of ``tokens.npy``
    as :class:`TokenFileDataset`, anything else as the prefix of a Megatron indexed dataset."""
    path = os.fspath(path)
    if path.endswith((".jsonl", ".json")):
        return JsonlTokenDataset(path, max_seq_len, long_samples=long_samples, **options)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "tokens.npy")):
        return TokenFileDataset(path, max_seq_len, long_samples=long_samples, **options)
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return IndexedTokenDataset(path, max_seq_len, long_samples=long_samples, **options)
