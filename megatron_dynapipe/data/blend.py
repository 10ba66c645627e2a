"""Datasets made of datasets: a weighted blend (multi-task mixing), and a contiguous split.

:class:`BlendedDataset` draws ``size`` samples from its parts in proportion to their weights, in
the order megatron-core's own blending index gives (``helpers_cpp.build_blending_indices``: the
part furthest behind its share goes next), each part's samples in turn, a part that runs out
starting over (an epoch of that part). The loader's batch schedule shuffles the blend.
:class:`SplitDataset` is samples ``begin .. end - 1`` of a dataset (Megatron's ``--split``).
Both describe themselves with their parts' descriptors.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_dynapipe.data.datasets import (check_dataset_files, fingerprint, open_dataset, open_descriptor,
                                             register_kind)

__all__ = ["BlendedDataset", "SplitDataset", "split_dataset", "blend_lengths"]


class BlendedDataset:
    """``size`` samples of ``parts`` mixed by ``weights`` (normalised; module docstring)."""

    def __init__(self, parts: Sequence, weights: Sequence[float], size: "int | None" = None):
        weights = np.asarray(weights, dtype=np.float64)
        if len(parts) == 0 or len(parts) != len(weights) or np.any(weights < 0) or weights.sum() <= 0:
            raise ValueError(f"a blend needs one non-negative weight per dataset and a positive total, got "
                             f"{len(parts)} datasets and weights {weights.tolist()}")
        if len({p.max_seq_len for p in parts}) != 1:
            raise ValueError("every dataset of a blend needs the same max_seq_len")
        if any(len(p) == 0 for p in parts):
            raise ValueError("a dataset of the blend has no samples")
        self.parts, self.weights = list(parts), weights / weights.sum()
        self.size = int(sum(len(p) for p in parts) if size is None else size)
        self.max_seq_len = self.parts[0].max_seq_len
        from megatron.core.datasets.helpers_cpp import build_blending_indices  # megatron-core's C++ helper

        self._part = np.zeros(self.size, dtype=np.int16)
        self._sample = np.zeros(self.size, dtype=np.int64)
        build_blending_indices(self._part, self._sample, self.weights, len(self.parts), self.size, False)
        sizes = np.array([len(p) for p in self.parts], dtype=np.int64)
        self._sample %= sizes[self._part]
        part_lengths = [np.asarray(p.lengths) for p in self.parts]
        self._lengths = np.empty(self.size, dtype=np.int64)
        for k, lengths in enumerate(part_lengths):
            mask = self._part == k
            self._lengths[mask] = lengths[self._sample[mask]]
        self._lengths.setflags(write=False)

    def __len__(self) -> int:
        return self.size

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def source(self, index: int) -> tuple[int, int]:
        """(part, sample of that part) of blend sample ``index``."""
        if not 0 <= int(index) < self.size:
            raise IndexError(f"sample {index} is out of range for a blend of {self.size} samples")
        return int(self._part[index]), int(self._sample[index])

    def __getitem__(self, index: int) -> np.ndarray:
        part, sample = self.source(index)
        return self.parts[part][sample]

    def target_mask(self, index: int) -> "np.ndarray | None":
        part, sample = self.source(index)
        return self.parts[part].target_mask(sample)

    def descriptor(self) -> dict:
        return dict(kind="blend", parts=[p.descriptor() for p in self.parts], weights=self.weights.tolist(),
                    size=self.size, max_seq_len=self.max_seq_len, num_samples=self.size,
                    fingerprint=fingerprint(self._lengths))

    @classmethod
    def from_descriptor(cls, d: dict) -> "BlendedDataset":
        return cls([open_descriptor(p) for p in d["parts"]], d["weights"], d["size"])

    def __repr__(self) -> str:
        weights = np.round(self.weights, 4).tolist()
        return f"BlendedDataset({len(self.parts)} datasets, weights {weights}, {self.size} samples)"


class SplitDataset:
    """Samples ``begin .. end - 1`` of a variable-length dataset (a train/valid/test split)."""

    def __init__(self, parent, begin: int, end: int):
        if not 0 <= begin <= end <= len(parent):
            raise ValueError(f"split [{begin}, {end}) is outside a dataset of {len(parent)} samples")
        self.parent, self.begin, self.end = parent, int(begin), int(end)
        self.max_seq_len = parent.max_seq_len

    def __len__(self) -> int:
        return self.end - self.begin

    def _index(self, index: int) -> int:
        i = int(index)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {index} is out of range for a split of {len(self)} samples")
        return self.begin + i

    def __getitem__(self, index: int) -> np.ndarray:
        return self.parent[self._index(index)]

    def target_mask(self, index: int) -> "np.ndarray | None":
        return self.parent.target_mask(self._index(index))

    @property
    def lengths(self) -> np.ndarray:
        return self.parent.lengths[self.begin:self.end]

    def descriptor(self) -> dict:
        return dict(kind="split", parent=self.parent.descriptor(), begin=self.begin, end=self.end,
                    max_seq_len=self.max_seq_len, num_samples=len(self), fingerprint=fingerprint(self.lengths))

    @classmethod
    def from_descriptor(cls, d: dict) -> "SplitDataset":
        return cls(open_descriptor(d["parent"]), d["begin"], d["end"])

    def __repr__(self) -> str:
        return f"SplitDataset({self.parent!r}, {self.begin}, {self.end})"


def split_dataset(dataset, split: "str | None") -> list[SplitDataset]:
    """Megatron's ``--split`` ("969,30,1", weights normalised) as three contiguous
    :class:`SplitDataset` ranges (train, valid, test), cut between documents as Megatron cuts
    them: split i takes documents ``round(a_i N)`` to ``round(b_i N)`` of the ``N``, where
    ``a_i, b_i`` are the cumulative shares before and after it; a long document's windows all go
    with their document."""
    weights = [float(w) for w in (split or "1,0,0").replace("/", ",").split(",") if w.strip()]
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r} needs three non-negative weights, e.g. 969,30,1")
    shares = np.cumsum([0.0] + [w / sum(weights) for w in weights])
    documents = [int(round(share * dataset.num_documents)) for share in shares]
    bounds = np.searchsorted(dataset.documents, documents)  # each bound's first sample
    return [SplitDataset(dataset, int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


register_kind("blend", BlendedDataset)
register_kind("split", SplitDataset)


def blend_lengths(data_path: Sequence[str], max_seq_len: int, long_samples: str = "split"
                  ) -> tuple[list[np.ndarray], list[float]]:
    """The sample lengths of each dataset of Megatron's ``--data-path`` (one path, or a blend
    ``W1 P1 W2 P2 ...`` as megatron-core reads it), samples longer than ``max_seq_len`` handled
    as ``long_samples`` says, and each dataset's weight: the blend's, else its size (Megatron
    then takes every sample once)."""
    for word in data_path:  # before megatron-core's import (seconds): a path missing is said at once
        if not _is_number(word):
            check_dataset_files(word)
    from megatron.core.datasets.utils import get_blend_from_list  # megatron-core's reading of the flag

    paths, weights = get_blend_from_list(list(data_path))
    datasets = [open_dataset(path, max_seq_len, long_samples=long_samples) for path in paths]
    empty = [path for path, dataset in zip(paths, datasets) if not len(dataset)]
    if empty:
        raise ValueError(f"--data-path {empty[0]} holds no samples: give a dataset with documents in it")
    return [np.asarray(d.lengths) for d in datasets], list(weights) if weights else [float(len(d)) for d in datasets]


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True
