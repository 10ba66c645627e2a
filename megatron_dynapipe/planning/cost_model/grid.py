"""Measured values on a (sequence length x micro-batch size) grid, interpolated bilinearly; what
a profiled cost model is made of."""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

import numpy as np

from megatron_dynapipe.planning.cost_model.base import INF, is_scalar

__all__ = ["Grid", "GridStack"]


class Grid:
    """One measured quantity on a (seqlen x mbs) grid, interpolated bilinearly.

    Rows are profiled sequence lengths, columns the union of profiled micro-batch sizes. A row
    need not cover every column: gaps inside a row are filled by linear interpolation within the
    row, columns before its first point take its first value, and columns past its last point
    (``max_mbs``) hold a finite filler that feasibility masks always exclude (so a zero
    interpolation weight never meets an inf or NaN).
    """

    __slots__ = ("S", "M", "V", "max_mbs", "_S", "_M", "_V", "_maxm", "_dS", "_dM", "_Sl", "_Ml",
                 "_Vl", "_maxl")

    def __init__(self, points: dict[tuple[int, int], float]):
        seqlens = sorted({s for s, _ in points})
        mbs = sorted({m for _, m in points})
        self.S = np.array(seqlens, dtype=float)
        self.M = np.array(mbs, dtype=float)
        self.V = np.empty((len(seqlens), len(mbs)))
        self.max_mbs = np.empty(len(seqlens))
        for i, s in enumerate(seqlens):
            row = sorted((m, v) for (ss, m), v in points.items() if ss == s)
            xs = np.array([m for m, _ in row], dtype=float)
            self.V[i] = np.interp(self.M, xs, [v for _, v in row])
            self.max_mbs[i] = xs[-1]
        # Padded copies so that one row or one column still has a segment [k, k + 1].
        self._S, self._V, self._maxm = self.S, self.V, self.max_mbs
        if len(seqlens) == 1:
            self._S = np.repeat(self.S, 2)
            self._V = np.repeat(self.V, 2, axis=0)
            self._maxm = np.repeat(self.max_mbs, 2)
        self._M = self.M
        if len(mbs) == 1:
            self._M = np.repeat(self.M, 2)
            self._V = np.repeat(self._V, 2, axis=1)
        self._dS = np.diff(self._S)
        self._dS[self._dS == 0] = 1.0
        self._dM = np.diff(self._M)
        self._dM[self._dM == 0] = 1.0
        self._Sl = self._S.tolist()
        self._Ml = self._M.tolist()
        self._Vl = self._V.tolist()
        self._maxl = self._maxm.tolist()

    # -- scalar path: plain Python, a few microseconds ------------------------------------------
    def _row(self, i: int, m: float) -> float:
        M, row = self._Ml, self._Vl[i]
        if m <= M[0]:
            return row[0]
        j = bisect_left(M, m) - 1  # M[j] < m <= M[j + 1]
        hi = M[j + 1]
        if m == hi:
            return row[j + 1]
        w = (m - M[j]) / (hi - M[j])
        return (1.0 - w) * row[j] + w * row[j + 1]

    def _seq_segment(self, s: float) -> tuple[int, float]:
        """(i, w): seqlen s sits at weight w between rows i and i + 1 (w == 0: row i alone)."""
        S = self._Sl
        if s <= S[0]:
            return 0, 0.0
        i = bisect_left(S, s) - 1  # S[i] < s <= S[i + 1]
        if s == S[i + 1]:
            return i + 1, 0.0
        return i, (s - S[i]) / (S[i + 1] - S[i])

    def scalar(self, m: float, s: float) -> float:
        if not s <= self._Sl[-1]:
            return INF
        i, w = self._seq_segment(s)
        if not m <= self._maxl[i]:
            return INF
        a = self._row(i, m)
        if w == 0.0:
            return a
        if not m <= self._maxl[i + 1]:
            return INF
        return (1.0 - w) * a + w * self._row(i + 1, m)

    # -- array paths ----------------------------------------------------------------------------
    def at_seqlen(self, m: np.ndarray, s: float) -> np.ndarray:
        """Many micro-batch sizes at one sequence length: one np.interp over a blended row."""
        if not s <= self._Sl[-1]:
            return np.full(m.shape, INF)
        i, w = self._seq_segment(s)
        if w == 0.0:
            row, limit = self._V[i], self._maxl[i]
        else:
            row = (1.0 - w) * self._V[i] + w * self._V[i + 1]
            limit = min(self._maxl[i], self._maxl[i + 1])
        out = np.interp(m, self._M, row)
        np.copyto(out, INF, where=~(m <= limit))
        return out

    def general(self, m: np.ndarray, s: np.ndarray) -> np.ndarray:
        return _blend(self._V, self._maxm, self._S[-1], self.locate(m, s))

    def locate(self, m: np.ndarray, s: np.ndarray) -> tuple:
        """The grid cells of (m, s) and the weights within them, for :func:`_blend`."""
        m, s = np.broadcast_arrays(m, s)
        S, M = self._S, self._M
        sc = np.maximum(s, S[0])
        i = np.clip(np.searchsorted(S, sc, side="left") - 1, 0, len(S) - 2)
        ws = (sc - S[i]) / self._dS[i]
        mc = np.maximum(m, M[0])
        j = np.clip(np.searchsorted(M, mc, side="left") - 1, 0, len(M) - 2)
        wm = (mc - M[j]) / self._dM[j]
        return m, s, i, ws, j, wm

    def __call__(self, mbs, seqlen):
        if is_scalar(seqlen):
            if is_scalar(mbs):
                return self.scalar(float(mbs), float(seqlen))
            return self.at_seqlen(np.asarray(mbs, dtype=float), float(seqlen))
        return self.general(np.asarray(mbs, dtype=float), np.asarray(seqlen, dtype=float))


def _blend(V: np.ndarray, maxm: np.ndarray, longest: float, located: tuple) -> np.ndarray:
    """Bilinear interpolation of the values ``V`` ([S, M], or [q, S, M] for q grids on the same
    axes) at located points; inf where a bracketing row was not profiled that far."""
    m, s, i, ws, j, wm = located
    # The packed planner blends millions of points on a stack of grids: each corner is gathered by
    # one flat index (take) and the corners are combined in place, computing (1 - w) a + w b with
    # the same products and sums as written out, in about half the time of fancy indexing.
    columns = V.shape[-1]
    flat = V.reshape(*V.shape[:-2], -1)
    cell = i * columns + j
    low, low_next, high, high_next = (flat.take(cell + step, axis=-1) for step in (0, 1, columns, columns + 1))
    keep_m, keep_s = 1.0 - wm, 1.0 - ws
    low *= keep_m
    low_next *= wm
    low += low_next
    high *= keep_m
    high_next *= wm
    high += high_next
    low *= keep_s
    high *= ws
    low += high
    ok = ((s <= longest) & ((ws >= 1.0) | (m <= maxm.take(i, axis=-1)))
          & ((ws <= 0.0) | (m <= maxm.take(i + 1, axis=-1))))
    np.copyto(low, INF, where=~ok)
    return low


class GridStack:
    """Grids on the same axes interpolated together: the cells are located once for all."""

    def __init__(self, grids: "Sequence[Grid]"):
        self.axes = grids[0]
        self.V = np.stack([g._V for g in grids])
        self.maxm = np.stack([g._maxm for g in grids])

    @classmethod
    def of(cls, grids: "Sequence[Grid | None]") -> "GridStack | None":
        """A stack of ``grids``, or None when one is missing or their axes differ."""
        if any(g is None for g in grids):
            return None
        first = grids[0]
        same = all(np.array_equal(g._S, first._S) and np.array_equal(g._M, first._M) for g in grids)
        return cls(grids) if same else None

    def general(self, m: np.ndarray, s: np.ndarray) -> np.ndarray:
        """[q, *shape]: every grid at the broadcast points (m, s)."""
        return _blend(self.V, self.maxm, self.axes._S[-1], self.axes.locate(m, s))


