"""Samples kept whole, or cut where Megatron-LM's GPT data path cuts them.

Megatron-LM's data path lays the documents back to back and cuts the stream into windows of
``--seq-length`` tokens; THD packing then keeps each window's pieces from attending to each other.
A document that crosses a window's end is trained as two (or more) pieces, each attending only to
itself. That is cheaper (attention grows with the square of a piece's length, and every window is
full), and it changes what the model sees. DynaPipe keeps samples whole by default
(``TrainingSpec.documents = "whole"``); ``"cut"`` plans the very pieces Megatron's data path makes
(:func:`cut_documents`), so its search holds THD packing's own windows as a candidate and trains
what a THD-packing job trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["DOCUMENTS", "Pieces", "cut_documents", "consecutive_windows"]

#: how a plan holds the samples: whole, or cut at Megatron-LM's --seq-length windows
DOCUMENTS = ("whole", "cut")


@dataclass(frozen=True)
class Pieces:
    """The pieces of a batch's samples, in stream order: piece ``i`` is tokens
    ``start[i] : start[i] + length[i]`` of sample ``sample[i]`` (padding included where the samples
    were padded before the cut: :func:`cut_documents`)."""

    sample: np.ndarray
    start: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    def real_tokens(self, lengths: Sequence[int]) -> np.ndarray:
        """Each piece's tokens of its sample, without the padding: ``lengths`` are the samples'."""
        own = np.asarray(lengths, dtype=np.int64)[self.sample] - self.start
        return np.clip(own, 0, self.length)


def cut_documents(lengths: Sequence[int], seq_length: int, multiple: int = 1) -> Pieces:
    """The samples back to back, each padded to a ``multiple`` of tokens (under context
    parallelism a packed sample splits into 2 x CP equal chunks, Megatron's ``cu_seqlens_padded``),
    cut at every multiple of ``seq_length`` tokens, as Megatron-LM's GPT data path cuts documents
    into its windows. Each piece is a whole number of ``multiple``s, so holds a real token."""
    if seq_length % multiple:
        raise ValueError(f"--seq-length {seq_length} is not a multiple of {multiple} (2 x the context-parallel size), "
                         "as Megatron-LM requires")
    padded = -(-np.asarray(lengths, dtype=np.int64) // multiple) * multiple
    ends = np.cumsum(padded)
    firsts, total = ends - padded, int(ends[-1]) if len(ends) else 0
    edges = np.arange(seq_length, total, seq_length, dtype=np.int64)
    cuts = np.union1d(firsts[padded > 0], edges)  # every piece's first token in the stream
    sample = np.searchsorted(ends, cuts, side="right")  # past empty samples, which end where they start
    return Pieces(sample, cuts - firsts[sample], np.diff(cuts, append=total))


def consecutive_windows(lengths: Sequence[int], seq_length: int) -> list[list[int]]:
    """Pieces laid back to back (``lengths``, as :func:`cut_documents` made them) grouped into the
    windows of ``seq_length`` tokens they fill, each a list of piece indices; the last window may be
    short."""
    firsts = np.cumsum(lengths) - np.asarray(lengths)
    window = firsts // seq_length
    bounds = np.flatnonzero(np.diff(window)) + 1
    return [part.tolist() for part in np.split(np.arange(len(firsts)), bounds)] if len(firsts) else []
