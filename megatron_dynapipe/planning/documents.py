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

__all__ = ["DOCUMENTS", "Pieces", "cut_documents"]

#: how a plan holds the samples: whole, or cut at Megatron-LM's --seq-length windows
DOCUMENTS = ("whole", "cut")


@dataclass(frozen=True)
class Pieces:
    """The pieces of a batch's samples, in stream order: piece ``i`` is the ``tokens[i]`` tokens
    of sample ``sample[i]`` from its token ``start[i]``, in Megatron's window ``window[i]``; a row
    holds it as ``length[i]`` tokens (padded, where a context-parallel row needs it:
    :func:`cut_documents`)."""

    sample: np.ndarray
    start: np.ndarray
    tokens: np.ndarray
    length: np.ndarray
    window: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    def windows(self) -> list[list[int]]:
        """Each window's piece indices, in order."""
        bounds = np.flatnonzero(np.diff(self.window)) + 1
        return [part.tolist() for part in np.split(np.arange(len(self)), bounds)] if len(self) else []


def cut_documents(lengths: Sequence[int], seq_length: int, multiple: int = 1) -> Pieces:
    """The samples back to back, cut at every ``seq_length`` tokens, as Megatron-LM's GPT data
    path cuts documents into its windows; each piece then padded to a ``multiple`` of tokens
    (under context parallelism a packed sample splits into 2 x CP equal chunks, Megatron's
    ``cu_seqlens_padded``), so a window's row may hold a little more than ``seq_length``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    firsts, total = ends - lengths, int(ends[-1]) if len(ends) else 0
    edges = np.arange(seq_length, total, seq_length, dtype=np.int64)
    cuts = np.union1d(firsts[firsts < ends], edges)  # every piece's first token in the stream
    sample = np.searchsorted(ends, cuts, side="right")  # past empty samples, which end where they start
    tokens = np.diff(cuts, append=total)
    return Pieces(sample, cuts - firsts[sample], tokens, -(-tokens // multiple) * multiple, cuts // seq_length)
