"""What a GPT layer costs: time per micro-batch, activation memory, parameter memory.

Two sources answer the same questions (see docs/cost_model.md):

* :class:`ProfiledCostModel` reads a measured table (JSON) and interpolates it;
* :class:`AnalyticalCostModel` derives the costs from FLOP counts and the activation-memory
  formulas of Korthikanti et al. (2022).

Both answer per *layer* and per *micro-batch*; :class:`StageCosts` turns that into what one
pipeline stage costs, which is what the planner asks. Every query is vectorised: ``mbs`` and
``seqlen`` may be scalars or broadcastable arrays, and ``np.inf`` marks a micro-batch shape that
cannot run at all. Scalar queries take a pure-Python path because the planner issues many of them.
"""

from __future__ import annotations

import abc
import json
import math
import os
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from megatron_dynapipe.config.accounting import activation_bytes, layer_flops_per_token, output_flops_per_token
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.planning.types import RecomputeType

__all__ = [
    "AnalyticalCostModel",
    "CostModel",
    "CostModelError",
    "ProfiledCostModel",
    "StageCosts",
    "load_cost_model",
    "resolve_cost_model_path",
    "shipped_profiles",
]

MB = 2**20  # bytes in the "MB" every cost model speaks (the unit of the profile files)
LAYERS = ("encoder", "postprocess", "preprocess")
OPTIONAL_LAYERS = ("preprocess",)  # a profile without them prices them at nothing
PHASES = ("forward", "backward")
OVERHEAD_PER = ("stage", "layer")  # what a microbatch_overhead record is paid once per
# the keys of a calibrated model's `analytical` object: the GPT's sizes, then what was fitted
CALIBRATED = ("hidden_size", "num_heads", "ffn_hidden_size", "vocab_size",
              "peak_tflops", "mfu", "attention_mfu", "overhead_ms", "saturation_tokens", "device_memory_mb")
KINDS = ("stored", "peak")
PARAM_LAYERS = ("embedding", "encoder")
FORMAT_HINT = "see docs/cost_model.md for the format"
ANSWERS_KEPT = 256  # StageCosts.all_stages queries remembered (a plan asks a few dozen)
PROFILES_DIR = Path(__file__).with_name("profiles")  # profiles shipped with the package, by name

# The (layer, phase) times CostModel.shape_costs returns, in order, before the activation KINDS.
_TIMED = (("encoder", "forward"), ("encoder", "backward"), ("postprocess", "forward"), ("postprocess", "backward"),
          ("preprocess", "forward"), ("preprocess", "backward"))

_INF = math.inf
_SCALARS = (int, float, np.integer, np.floating)


class CostModelError(ValueError):
    """A cost model file cannot be used; the message says what to fix."""


def _recompute(value) -> RecomputeType:
    return value if isinstance(value, RecomputeType) else RecomputeType.parse(value)


def _is_scalar(x) -> bool:
    return isinstance(x, _SCALARS) or (isinstance(x, np.ndarray) and x.ndim == 0)


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}: use one of {', '.join(choices)}")


def _full_inf(mbs, seqlen):
    if _is_scalar(mbs) and _is_scalar(seqlen):
        return _INF
    return np.full(np.broadcast_shapes(np.shape(mbs), np.shape(seqlen)), _INF)


class CostModel(abc.ABC):
    """Per-layer costs of one model at one tensor-parallel size.

    ``layer_ms`` and ``activation_mb`` return a ``float`` when both ``mbs`` and ``seqlen`` are
    scalars and a float ``np.ndarray`` of their broadcast shape otherwise.
    """

    tp: int
    hidden_size: int  # activation width: p2p messages are mbs * seqlen * hidden_size elements
    name: str = ""

    @abc.abstractmethod
    def layer_ms(self, layer: str, phase: str, recompute: RecomputeType, mbs, seqlen):
        """Milliseconds of one ``layer`` ("encoder", "postprocess": final norm, LM head and loss, or
        "preprocess": the embedding) in ``phase`` ("forward" | "backward") for one micro-batch;
        backward includes recomputation."""

    @abc.abstractmethod
    def activation_mb(self, kind: str, recompute: RecomputeType, mbs, seqlen):
        """MB of one encoder layer: ``kind`` "stored" is kept from its forward until its
        backward, "peak" is the transient extra while the layer runs."""

    @abc.abstractmethod
    def param_mb(self, layer: str) -> float:
        """MB of 16-bit parameters of one "embedding" or one "encoder" layer on one TP rank."""

    def microbatch_overhead_ms(self, phase: str, mbs, seqlen, layers):
        """Milliseconds a training step adds per micro-batch, in ``phase``, to the own times of
        the parts of a stage of ``layers`` layers (GPTModel around them, the loss, DDP's gradient
        hooks, the executor): once per stage and once per layer, each ``ms + ms_per_token *
        mbs * seqlen`` as :attr:`microbatch_overhead` holds them (docs/cost_model.md)."""
        _check_choice("phase", phase, PHASES)
        tokens = _as_float(mbs) * _as_float(seqlen)
        stage_ms, stage_per_token = self.microbatch_overhead.get(("stage", phase), (0.0, 0.0))
        layer_ms, layer_per_token = self.microbatch_overhead.get(("layer", phase), (0.0, 0.0))
        return stage_ms + stage_per_token * tokens + _as_float(layers) * (layer_ms + layer_per_token * tokens)

    #: ("stage" | "layer", phase) -> (ms, ms per token) of :meth:`microbatch_overhead_ms`; none
    #: unless measured
    microbatch_overhead: Mapping[tuple[str, str], tuple[float, float]] = {}

    def shape_costs(self, types: "Sequence[RecomputeType]", mbs, seqlen) -> np.ndarray:
        """Everything a pipeline stage needs of one micro-batch shape under each recompute type
        in ``types``, in one call: a [len(types), 8, *shape] array of encoder, LM-head and
        embedding forward and backward ms, then stored and peak activation MB.
        A model may share work between them; this one asks each in turn."""
        shape = np.broadcast_shapes(np.shape(mbs), np.shape(seqlen))
        rows = [[self.layer_ms(layer, phase, rc, mbs, seqlen) for layer, phase in _TIMED]
                + [self.activation_mb(kind, rc, mbs, seqlen) for kind in KINDS] for rc in types]
        return np.array([[np.broadcast_to(np.asarray(v, dtype=float), shape) for v in row] for row in rows])


# ---------------------------------------------------------------------------------------------
# Profiled costs


class _Grid:
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
            return _INF
        i, w = self._seq_segment(s)
        if not m <= self._maxl[i]:
            return _INF
        a = self._row(i, m)
        if w == 0.0:
            return a
        if not m <= self._maxl[i + 1]:
            return _INF
        return (1.0 - w) * a + w * self._row(i + 1, m)

    # -- array paths ----------------------------------------------------------------------------
    def at_seqlen(self, m: np.ndarray, s: float) -> np.ndarray:
        """Many micro-batch sizes at one sequence length: one np.interp over a blended row."""
        if not s <= self._Sl[-1]:
            return np.full(m.shape, _INF)
        i, w = self._seq_segment(s)
        if w == 0.0:
            row, limit = self._V[i], self._maxl[i]
        else:
            row = (1.0 - w) * self._V[i] + w * self._V[i + 1]
            limit = min(self._maxl[i], self._maxl[i + 1])
        out = np.interp(m, self._M, row)
        np.copyto(out, _INF, where=~(m <= limit))
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
        if _is_scalar(seqlen):
            if _is_scalar(mbs):
                return self.scalar(float(mbs), float(seqlen))
            return self.at_seqlen(np.asarray(mbs, dtype=float), float(seqlen))
        return self.general(np.asarray(mbs, dtype=float), np.asarray(seqlen, dtype=float))


def _blend(V: np.ndarray, maxm: np.ndarray, longest: float, located: tuple) -> np.ndarray:
    """Bilinear interpolation of the values ``V`` ([S, M], or [q, S, M] for q grids on the same
    axes) at located points; inf where a bracketing row was not profiled that far."""
    m, s, i, ws, j, wm = located
    lo = (1.0 - wm) * V[..., i, j] + wm * V[..., i, j + 1]
    hi = (1.0 - wm) * V[..., i + 1, j] + wm * V[..., i + 1, j + 1]
    out = (1.0 - ws) * lo + ws * hi
    ok = (s <= longest) & ((ws >= 1.0) | (m <= maxm[..., i])) & ((ws <= 0.0) | (m <= maxm[..., i + 1]))
    np.copyto(out, _INF, where=~ok)
    return out


class _GridStack:
    """Grids on the same axes interpolated together: the cells are located once for all."""

    def __init__(self, grids: "Sequence[_Grid]"):
        self.axes = grids[0]
        self.V = np.stack([g._V for g in grids])
        self.maxm = np.stack([g._maxm for g in grids])

    @classmethod
    def of(cls, grids: "Sequence[_Grid | None]") -> "_GridStack | None":
        """A stack of ``grids``, or None when one is missing or their axes differ."""
        if any(g is None for g in grids):
            return None
        first = grids[0]
        same = all(np.array_equal(g._S, first._S) and np.array_equal(g._M, first._M) for g in grids)
        return cls(grids) if same else None

    def general(self, m: np.ndarray, s: np.ndarray) -> np.ndarray:
        """[q, *shape]: every grid at the broadcast points (m, s)."""
        return _blend(self.V, self.maxm, self.axes._S[-1], self.axes.locate(m, s))


class ProfiledCostModel(CostModel):
    """Costs interpolated from a profile (docs/cost_model.md).

    Within a profiled sequence length, cost is linear in the micro-batch size between profiled
    sizes; between two profiled sequence lengths it is linear in the sequence length. Shorter
    sequences than the shortest profiled cost as much as the shortest; longer sequences than the
    longest profiled, and micro-batches larger than a bracketing row profiled, are ``inf``.
    A recompute type absent from the profile is ``inf`` everywhere.
    """

    def __init__(
        self,
        *,
        tp: int,
        hidden_size: int,
        times: dict[tuple[str, str, RecomputeType], _Grid],
        memory: dict[tuple[str, RecomputeType], _Grid],
        params_mb: dict[str, float],
        name: str = "",
        metadata: dict | None = None,
        microbatch_overhead: Mapping[tuple[str, str], tuple[float, float]] | None = None,
    ):
        self.tp = int(tp)
        self.hidden_size = int(hidden_size)
        self.name = name
        self.metadata = dict(metadata or {})  # what `megatron-dynapipe profile` records: model, dtype, device
        self._times = dict(times)
        self._memory = dict(memory)
        self._params = dict(params_mb)
        self.microbatch_overhead = dict(microbatch_overhead or {})
        self.recompute_types = tuple(sorted({rc for _, _, rc in self._times}))
        self._stacks: dict[tuple, _GridStack | None] = {}  # by tuple of recompute types, built on first use

    def __repr__(self) -> str:
        kinds = ", ".join(rc.label for rc in self.recompute_types)
        return f"ProfiledCostModel({self.name!r}, tp={self.tp}, recompute: {kinds})"

    def shape_costs(self, types, mbs, seqlen):
        types = tuple(types)
        if types not in self._stacks:  # grids in the returned order: per type, 6 times then 2 memories
            self._stacks[types] = _GridStack.of([grid for rc in types for grid in (
                *(self._times.get((layer, phase, rc)) for layer, phase in _TIMED),
                *(self._memory.get((kind, rc)) for kind in KINDS))])
        stack = self._stacks[types]
        if stack is None or _is_scalar(seqlen):  # scalar sequence lengths take the grids' own fast paths
            return super().shape_costs(types, mbs, seqlen)
        values = stack.general(np.asarray(mbs, dtype=float), np.asarray(seqlen, dtype=float))
        return values.reshape((len(types), len(_TIMED) + len(KINDS)) + values.shape[1:])

    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        rc = _recompute(recompute)
        grid = self._times.get((layer, phase, rc))
        if grid is None:
            _check_choice("layer", layer, LAYERS)
            _check_choice("phase", phase, PHASES)
            return _full_inf(mbs, seqlen)
        return grid(mbs, seqlen)

    def activation_mb(self, kind, recompute, mbs, seqlen):
        rc = _recompute(recompute)
        grid = self._memory.get((kind, rc))
        if grid is None:
            _check_choice("activation kind", kind, KINDS)
            return _full_inf(mbs, seqlen)
        return grid(mbs, seqlen)

    def param_mb(self, layer):
        try:
            return self._params[layer]
        except KeyError:
            _check_choice("parameter layer", layer, PARAM_LAYERS)
            raise

    @classmethod
    def from_json(cls, path, tp: int, *, hidden_size: int | None = None) -> "ProfiledCostModel":
        """Load the profile of tensor-parallel size ``tp`` from a JSON file.

        ``hidden_size`` (for p2p message sizes) comes from this argument, else from the file's
        optional ``hidden_size`` key, else it is estimated from the encoder parameter memory.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise CostModelError(
                f"cost model file {path} not found: pass --cost-model PATH to a JSON file in the "
                "format of docs/cost_model.md"
            )
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except json.JSONDecodeError as e:
            raise CostModelError(
                f"cost model file {path} is not valid JSON ({e.msg} at line {e.lineno} column "
                f"{e.colno}): {FORMAT_HINT}"
            ) from None
        except (OSError, UnicodeDecodeError) as e:
            raise CostModelError(f"cost model file {path} cannot be read ({e}): {FORMAT_HINT}") from None
        return cls._from_document(doc, tp, source=path, hidden_size=hidden_size)

    @classmethod
    def _from_document(cls, doc, tp: int, *, source: str, hidden_size: int | None = None):
        if isinstance(doc, dict) and "analytical" in doc:
            return AnalyticalCostModel.calibrated(doc, tp, source=source)
        reader = _ProfileReader(doc, source)
        tp = int(tp)
        available = reader.tps()
        if tp not in available:
            listed = ", ".join(str(t) for t in sorted(available)) or "none"
            raise CostModelError(
                f"cost model {source} has no profile for tp={tp} (profiled: {listed}): choose one "
                "of those tensor-parallel sizes or profile this one"
            )
        times, memory, params = reader.tables(tp)
        if hidden_size is None:
            hidden_size = reader.hidden_size()
        if hidden_size is None:
            hidden_size = _estimate_hidden_size(params["encoder"], tp)
        return cls(
            tp=tp,
            hidden_size=hidden_size,
            times={k: _Grid(v) for k, v in times.items()},
            memory={k: _Grid(v) for k, v in memory.items()},
            params_mb=params,
            name=str(doc.get("name", os.path.basename(source))),
            metadata=doc.get("metadata") if isinstance(doc.get("metadata"), dict) else None,
            microbatch_overhead=_ProfileReader.overhead_of(doc, tp, reader.fail),
        )


def _estimate_hidden_size(encoder_param_mb: float, tp: int) -> int:
    """Hidden size of a GPT layer with a 4h FFN (about 12 h^2 parameters) from its 16-bit
    parameter MB at ``tp``, rounded to a multiple of 256."""
    params = encoder_param_mb * MB / 2 * tp
    return max(256, int(round(math.sqrt(params / 12) / 256)) * 256)


class _ProfileReader:
    """Validates a profile document and cuts out the tables of one tensor-parallel size."""

    FIELDS = {
        "layer_time": (("tp", "recompute", "layer", "phase", "seqlen", "mbs"), "ms"),
        "activation_memory": (("tp", "recompute", "layer", "kind", "seqlen", "mbs"), "mb"),
        "model_state_memory": (("tp", "recompute", "layer"), "mb"),
    }
    CHOICES = {
        ("layer_time", "layer"): LAYERS,
        ("layer_time", "phase"): PHASES,
        ("activation_memory", "layer"): ("encoder",),
        ("activation_memory", "kind"): KINDS,
        ("model_state_memory", "layer"): PARAM_LAYERS,
    }

    def __init__(self, doc, source: str):
        self.source = source
        if not isinstance(doc, dict):
            self.fail(f"holds a JSON {type(doc).__name__}, not an object")
        self.doc = doc
        self.records = {}
        for table in self.FIELDS:
            if table not in doc:
                self.fail(f"lacks the key {table!r}")
            if not isinstance(doc[table], list):
                self.fail(f"key {table!r} is not a list of records")
            self.records[table] = [self.record(table, n, r) for n, r in enumerate(doc[table])]

    def fail(self, what: str):
        raise CostModelError(f"cost model file {self.source} {what}: {FORMAT_HINT}")

    def record(self, table: str, n: int, rec) -> tuple:
        where = f"{table} record {n}"
        if not isinstance(rec, dict):
            self.fail(f"has a {where} that is not an object")
        keys, value_key = self.FIELDS[table]
        out = []
        for key in (*keys, value_key):
            if key not in rec:
                self.fail(f"has a {where} without {key!r}")
            v = rec[key]
            if key == "recompute":
                if not isinstance(v, str):
                    self.fail(f"has a {where} whose 'recompute' is not a string")
                try:
                    v = RecomputeType.parse(v)
                except ValueError:
                    self.fail(f"has a {where} with unknown recompute {v!r} (use none, selective, full)")
            elif key in ("layer", "phase", "kind"):
                choices = self.CHOICES[(table, key)]
                if v not in choices:
                    self.fail(f"has a {where} with {key} {v!r} (use {', '.join(choices)})")
            elif key in ("tp", "seqlen", "mbs"):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 1:
                    self.fail(f"has a {where} whose {key!r} is not a positive integer")
                v = int(v)
            else:  # the measured value
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    self.fail(f"has a {where} whose {key!r} is not a finite number >= 0")
                v = float(v)
            out.append(v)
        return tuple(out)

    def tps(self) -> set[int]:
        return {r[0] for r in self.records["layer_time"]}

    def hidden_size(self) -> int | None:
        h = self.doc.get("hidden_size")
        if h is None:
            return None
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            self.fail("has a 'hidden_size' that is not a positive integer")
        return h

    def tables(self, tp: int):
        times: dict = {}
        for t, rc, layer, phase, s, m, v in self.records["layer_time"]:
            if t == tp:
                self.put(times.setdefault((layer, phase, rc), {}), (s, m), v, "layer_time")
        memory: dict = {}
        for t, rc, _layer, kind, s, m, v in self.records["activation_memory"]:
            if t == tp:
                self.put(memory.setdefault((kind, rc), {}), (s, m), v, "activation_memory")
        params: dict[str, float] = {}
        for t, _rc, layer, v in self.records["model_state_memory"]:
            if t == tp:  # one value per recompute type, equal up to noise: keep the largest
                params[layer] = max(params.get(layer, 0.0), v)
        for rc in sorted({rc for _, _, rc in times}):
            for layer in LAYERS:
                for phase in PHASES:
                    if (layer, phase, rc) in times:
                        continue
                    if layer not in OPTIONAL_LAYERS:
                        self.fail(f"has no {layer} {phase} times for tp={tp} recompute={rc.label}")
                    times[layer, phase, rc] = dict.fromkeys(times["encoder", phase, rc], 0.0)
            for kind in KINDS:
                if (kind, rc) not in memory:
                    self.fail(f"has no {kind} activation memory for tp={tp} recompute={rc.label}")
        for layer in PARAM_LAYERS:
            if layer not in params:
                self.fail(f"has no model_state_memory of the {layer} for tp={tp}")
        return times, memory, params

    @staticmethod
    def overhead_of(doc: dict, tp: int, fail) -> dict[tuple[str, str], tuple[float, float]]:
        """The optional ``microbatch_overhead`` records of ``tp``: (per, phase) -> (ms, ms_per_token)."""
        records = doc.get("microbatch_overhead", [])
        if not isinstance(records, list):
            fail("key 'microbatch_overhead' is not a list of records")
        out = {}
        for n, rec in enumerate(records):
            where = f"microbatch_overhead record {n}"
            if not isinstance(rec, dict) or rec.get("phase") not in PHASES or rec.get("per") not in OVERHEAD_PER:
                fail(f"has a {where} that is not an object with a phase of {', '.join(PHASES)} and a per "
                     f"of {', '.join(OVERHEAD_PER)}")
            values = [rec.get(key) for key in ("tp", "ms", "ms_per_token")]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                       for v in values):
                fail(f"has a {where} whose tp, ms or ms_per_token is not a finite number >= 0")
            if values[0] == tp:
                out[rec["per"], rec["phase"]] = (float(values[1]), float(values[2]))
        return out

    def put(self, grid: dict, point: tuple[int, int], value: float, table: str) -> None:
        if point in grid and grid[point] != value:
            self.fail(
                f"has conflicting {table} records for seqlen={point[0]} mbs={point[1]} "
                f"({grid[point]} and {value})"
            )
        grid[point] = value


# ---------------------------------------------------------------------------------------------
# Analytical costs


class AnalyticalCostModel(CostModel):
    """GPT layer costs from FLOP counts and activation-memory formulas (docs/cost_model.md).

    Time is ``FLOPs / (peak_tflops * mfu)`` plus ``overhead_ms`` per layer and phase, where the
    attention core's FLOPs (scores and their weighted sum, quadratic in the sequence) run at
    ``attention_mfu`` (default: ``mfu``) and the matmuls at ``mfu``; a layer on
    fewer than ``saturation_tokens`` tokens takes as long as on that many, because small kernels
    leave the GPU under-used (the A100 profile flattens below about 1k tokens per layer). Memory is
    16-bit activations without sequence parallelism (Korthikanti et al. 2022). A micro-batch whose
    single encoder layer (its stored and peak activations plus the 16-byte-per-parameter model
    state of that layer) exceeds ``device_memory_mb`` is infeasible (``inf``).
    """

    def __init__(
        self,
        hidden_size: int = 4096,
        num_heads: int = 32,
        ffn_hidden_size: int | None = None,
        vocab_size: int = 50257,
        tp: int = 1,
        peak_tflops: float = 312.0,
        mfu: float = 0.5,
        attention_mfu: float | None = None,
        device_memory_mb: float = 40960,
        overhead_ms: float = 0.0,
        saturation_tokens: int = 1024,
        microbatch_overhead: Mapping[tuple[str, str], tuple[float, float]] | None = None,
        metadata: dict | None = None,
    ):
        ffn = 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size
        for what, v in (("hidden_size", hidden_size), ("num_heads", num_heads),
                        ("ffn_hidden_size", ffn), ("vocab_size", vocab_size), ("tp", tp)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{what} must be a positive integer, got {v!r}")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        if num_heads % tp:
            raise ValueError(f"num_heads {num_heads} is not divisible by tp {tp}")
        if not (peak_tflops > 0 and 0 < mfu <= 1 and device_memory_mb > 0 and overhead_ms >= 0
                and saturation_tokens >= 0):
            raise ValueError("need peak_tflops > 0, 0 < mfu <= 1, device_memory_mb > 0, overhead_ms >= 0, "
                             "saturation_tokens >= 0")
        self.hidden_size = int(hidden_size)
        self.num_heads = int(num_heads)
        self.ffn_hidden_size = int(ffn)
        self.vocab_size = int(vocab_size)
        self.tp = int(tp)
        self.peak_tflops = float(peak_tflops)
        self.mfu = float(mfu)
        self.attention_mfu = self.mfu if attention_mfu is None else float(attention_mfu)
        if not self.attention_mfu > 0:
            raise ValueError(f"need attention_mfu > 0, got {attention_mfu}")
        self.device_memory_mb = float(device_memory_mb)
        self.overhead_ms = float(overhead_ms)
        self.saturation_tokens = int(saturation_tokens)
        self.microbatch_overhead = dict(microbatch_overhead or {})
        self.metadata = dict(metadata or {})  # a calibrated model's: what `profile --calibrate` recorded
        self.name = f"analytical(h={hidden_size}, heads={num_heads}, ffn={ffn}, vocab={vocab_size})"
        self._flop_per_ms = self.peak_tflops * 1e9 * self.mfu  # TFLOP/s -> FLOP/ms
        h, t = self.hidden_size, self.tp
        layer = layer_flops_per_token(ModelSpec(num_layers=1, hidden_size=h, num_attention_heads=self.num_heads,
                                                ffn_hidden_size=self.ffn_hidden_size, vocab_size=self.vocab_size),
                                      1, causal=False)  # an unfused attention core computes the whole square
        self._matmul_flop_per_token = layer.linear / t
        self._attention_flop = layer.attention / t  # times b * s^2
        self._head_flop_per_token = output_flops_per_token(h, self.vocab_size) / t
        self._encoder_state_mb = 8.0 * self.param_mb("encoder")

    def __repr__(self) -> str:
        return (f"AnalyticalCostModel(hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, vocab_size={self.vocab_size}, tp={self.tp}, "
                f"peak_tflops={self.peak_tflops}, mfu={self.mfu}, attention_mfu={self.attention_mfu}, "
                f"device_memory_mb={self.device_memory_mb}, overhead_ms={self.overhead_ms}, "
                f"saturation_tokens={self.saturation_tokens})")

    @classmethod
    def calibrated(cls, doc: dict, tp: int, *, source: str) -> "AnalyticalCostModel":
        """The model ``megatron-dynapipe profile --calibrate`` wrote (docs/cost_model.md): the
        GPT sizes and fitted settings of its ``analytical`` object, at any ``tp``."""
        def fail(what: str):
            raise CostModelError(f"cost model file {source} {what}: {FORMAT_HINT}")

        settings = doc["analytical"]
        missing = [key for key in CALIBRATED if not isinstance(settings, dict) or key not in settings]
        if missing:
            fail(f"has an 'analytical' object without {', '.join(map(repr, missing))}")
        try:
            return cls(tp=tp, **{key: settings[key] for key in CALIBRATED},
                       metadata=doc.get("metadata") if isinstance(doc.get("metadata"), dict) else None,
                       microbatch_overhead=_ProfileReader.overhead_of(doc, tp, fail))
        except (TypeError, ValueError) as error:
            fail(f"has an 'analytical' object no model can be built from ({error})")

    # -- FLOPs -----------------------------------------------------------------------------------
    def encoder_flops(self, phase: str, recompute, mbs, seqlen):
        """FLOPs of one encoder layer on one TP rank (MAC = 2 FLOPs)."""
        matmul, attention = self.encoder_flop_parts(phase, recompute, mbs, seqlen)
        return matmul + attention

    def encoder_flop_parts(self, phase: str, recompute, mbs, seqlen):
        """:meth:`encoder_flops` as (linear layers', attention core's)."""
        _check_choice("phase", phase, PHASES)
        rc = _recompute(recompute)
        b, s = _as_float(mbs), _as_float(seqlen)
        matmul, attention = self._matmul_flop_per_token * b * s, self._attention_flop * b * s * s
        if phase == "forward":
            return matmul, attention
        if rc == RecomputeType.NONE:
            return 2.0 * matmul, 2.0 * attention
        if rc == RecomputeType.SELECTIVE:
            return 2.0 * matmul, 3.0 * attention
        return 3.0 * matmul, 3.0 * attention

    def postprocess_flops(self, phase: str, mbs, seqlen):
        """FLOPs of the LM head (logits) on one TP rank; recomputation does not touch it."""
        _check_choice("phase", phase, PHASES)
        forward = self._head_flop_per_token * _as_float(mbs) * _as_float(seqlen)
        return forward if phase == "forward" else 2.0 * forward

    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        _check_choice("layer", layer, LAYERS)
        if layer == "preprocess":  # a lookup: no FLOPs to price
            return self._mask(0.0 * _as_float(mbs) * _as_float(seqlen), mbs, seqlen)
        if layer == "encoder":
            matmul, attention = self.encoder_flop_parts(phase, recompute, mbs, seqlen)
            flops = matmul + attention * (self.mfu / self.attention_mfu)  # as matmul FLOPs at mfu
        else:
            flops = self.postprocess_flops(phase, mbs, seqlen)
        tokens = _as_float(mbs) * _as_float(seqlen)
        under_used = np.maximum(1.0, self.saturation_tokens / tokens)
        return self._mask(flops * under_used / self._flop_per_ms + self.overhead_ms, mbs, seqlen)

    # -- memory ----------------------------------------------------------------------------------
    def _activation_bytes(self, rc: RecomputeType, b, s):
        return activation_bytes(s, b, self.hidden_size, self.num_heads, self.tp, recompute=rc.label)

    def activation_mb(self, kind, recompute, mbs, seqlen):
        _check_choice("activation kind", kind, KINDS)
        rc = _recompute(recompute)
        b, s = _as_float(mbs), _as_float(seqlen)
        stored = self._activation_bytes(rc, b, s)
        if kind == "stored":
            value = stored
        else:  # backward materialises the whole layer plus as much again in gradients
            value = 2.0 * self._activation_bytes(RecomputeType.NONE, b, s) - stored
        return self._mask(value / MB, mbs, seqlen)

    def param_mb(self, layer):
        _check_choice("parameter layer", layer, PARAM_LAYERS)
        h, f, t = self.hidden_size, self.ffn_hidden_size, self.tp
        if layer == "embedding":
            params = self.vocab_size * h / t
        else:  # TP-split QKV, projection, FFN weights and split biases; replicated biases + 2 LNs
            params = (4 * h * h + 2 * h * f + 3 * h + f) / t + 6 * h
        return 2.0 * params / MB

    def fits(self, mbs, seqlen):
        """Whether one micro-batch can run one encoder layer on the device at all."""
        b, s = _as_float(mbs), _as_float(seqlen)
        need = 2.0 * self._activation_bytes(RecomputeType.NONE, b, s) / MB + self._encoder_state_mb
        return need <= self.device_memory_mb

    def _mask(self, value, mbs, seqlen):
        ok = self.fits(mbs, seqlen)
        if isinstance(value, np.ndarray) or isinstance(ok, np.ndarray):
            return np.where(ok, value, _INF)
        return float(value) if ok else _INF


def _as_float(x):
    return float(x) if _is_scalar(x) else np.asarray(x, dtype=float)


# ---------------------------------------------------------------------------------------------
# One pipeline layout


@dataclass(frozen=True)
class StageCosts:
    """A :class:`CostModel` seen from one pipeline layout: what each stage costs.

    Layers are split as evenly as possible, earlier stages taking the remainder. Stage 0 also
    holds the embedding, the last stage the LM head (its time is ``postprocess``) and, when
    ``pp > 1``, a tied copy of the embedding. Every stage pays the model's per-micro-batch
    overhead (:meth:`CostModel.microbatch_overhead_ms`) on top of its layers: each runs its own
    executor, DDP hooks and model wrapper.
    """

    model: CostModel
    num_layers: int
    pp: int
    dp: int = 1
    zero_stage: int = 0  # 0..3; Megatron's distributed optimizer is ZeRO-1
    p2p_gbps: float = 100.0  # GB/s (1e9 bytes) between neighbouring stages
    # all_stages answers by query: one plan asks the same micro-batch shapes several times
    # (recompute choice, candidate orders, work tables), and interpolation dominates small plans.
    _answers: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.pp < 1 or self.dp < 1:
            raise ValueError(f"pp and dp must be >= 1, got pp={self.pp} dp={self.dp}")
        if self.num_layers < self.pp:
            raise ValueError(
                f"{self.num_layers} layers cannot fill {self.pp} pipeline stages: use pp <= num_layers"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if not self.p2p_gbps > 0:
            raise ValueError(f"p2p_gbps must be > 0, got {self.p2p_gbps}")

    def layers_on(self, stage: int) -> int:
        if not 0 <= stage < self.pp:
            raise ValueError(f"stage {stage} is outside 0..{self.pp - 1}")
        base, extra = divmod(self.num_layers, self.pp)
        return base + (stage < extra)

    def _time(self, phase: str, stage: int, mbs, seqlen, recompute):
        ms = self.layers_on(stage) * self.model.layer_ms("encoder", phase, recompute, mbs, seqlen)
        if stage == 0:
            ms = ms + self.model.layer_ms("preprocess", phase, recompute, mbs, seqlen)
        if stage == self.pp - 1:
            ms = ms + self.model.layer_ms("postprocess", phase, recompute, mbs, seqlen)
        return ms + self.model.microbatch_overhead_ms(phase, mbs, seqlen, self.layers_on(stage))

    def forward_ms(self, stage: int, mbs, seqlen, recompute):
        """Forward of one micro-batch through the stage's layers (+ LM head on the last)."""
        return self._time("forward", stage, mbs, seqlen, recompute)

    def backward_ms(self, stage: int, mbs, seqlen, recompute):
        """Backward (including recomputation) of one micro-batch through the stage."""
        return self._time("backward", stage, mbs, seqlen, recompute)

    def stored_mb(self, stage: int, mbs, seqlen, recompute):
        """Activations one micro-batch keeps on the stage from its forward to its backward."""
        return self.layers_on(stage) * self.model.activation_mb("stored", recompute, mbs, seqlen)

    def peak_mb(self, stage: int, mbs, seqlen, recompute):
        """Transient memory on top of the stored activations while one of its layers runs."""
        self.layers_on(stage)  # validates the stage
        return self.model.activation_mb("peak", recompute, mbs, seqlen)

    def all_stages(self, mbs, seqlen, recompute) -> dict[str, np.ndarray]:
        """forward/backward ms and stored/peak MB of every stage at once, as read-only
        [pp, *shape] arrays, evaluating each per-layer quantity once instead of once per stage
        (the planner's hot path); a query asked before is answered from memory."""
        return {name: array[0] for name, array in self.by_recompute(mbs, seqlen, (recompute,)).items()}

    def by_recompute(self, mbs, seqlen, types) -> dict[str, np.ndarray]:
        """:meth:`all_stages` under each recompute type of ``types`` in one evaluation, as
        read-only [len(types), pp, *shape] arrays."""
        mbs, seqlen = np.asarray(mbs), np.asarray(seqlen)
        types = tuple(_recompute(rc) for rc in types)
        key = (types, mbs.dtype.str, mbs.shape, mbs.tobytes(), seqlen.dtype.str, seqlen.shape, seqlen.tobytes())
        answer = self._answers.get(key)
        if answer is None:
            if len(self._answers) >= ANSWERS_KEPT:
                self._answers.clear()
            answer = self._answers[key] = self._by_recompute(mbs, seqlen, types)
        return answer

    def _by_recompute(self, mbs: np.ndarray, seqlen: np.ndarray, types: tuple) -> dict[str, np.ndarray]:
        shape = np.broadcast_shapes(mbs.shape, seqlen.shape)
        column = (1, self.pp) + (1,) * len(shape)
        layers = np.array([self.layers_on(s) for s in range(self.pp)], dtype=float).reshape(column)
        is_last = (np.arange(self.pp) == self.pp - 1).reshape(column)
        is_first = (np.arange(self.pp) == 0).reshape(column)
        costs = np.asarray(self.model.shape_costs(types, mbs, seqlen), dtype=float)[:, :, None]  # [T, 8, 1, *shape]
        encoder_fwd, encoder_bwd, head_fwd, head_bwd, embed_fwd, embed_bwd, stored, peak = (costs[:, k] for k in range(8))
        overhead = {phase: self.model.microbatch_overhead_ms(phase, mbs, seqlen, layers) for phase in PHASES}
        out = {
            "forward": layers * encoder_fwd + np.where(is_last, head_fwd, 0.0) + np.where(is_first, embed_fwd, 0.0)
            + overhead["forward"],
            "backward": layers * encoder_bwd + np.where(is_last, head_bwd, 0.0) + np.where(is_first, embed_bwd, 0.0)
            + overhead["backward"],
            "stored": layers * stored,
            "peak": np.broadcast_to(peak, (len(types), self.pp) + shape),
        }
        for array in out.values():
            array.flags.writeable = False
        return out

    def param_mb(self, stage: int) -> float:
        """16-bit parameter MB on one rank of the stage."""
        mb = self.layers_on(stage) * self.model.param_mb("encoder")
        embeddings = (stage == 0) + (stage == self.pp - 1 and self.pp > 1)
        return mb + embeddings * self.model.param_mb("embedding")

    def model_state_mb(self, stage: int) -> float:
        """Parameters, gradients and Adam states of one rank of the stage.

        Per parameter: 2 B 16-bit weight, 2 B gradient, 12 B fp32 master weight + two moments.
        ZeRO-1 shards the 12 B over dp, ZeRO-2 also the gradient, ZeRO-3 all 16 B.
        """
        p, dp = self.param_mb(stage), self.dp  # p MB holds 2 B per parameter
        if self.zero_stage == 0:
            return 8.0 * p
        if self.zero_stage == 1:
            return p * (2.0 + 6.0 / dp)
        if self.zero_stage == 2:
            return p * (1.0 + 7.0 / dp)
        return 8.0 * p / dp

    def p2p_ms(self, mbs, seqlen):
        """Time to send one micro-batch's 16-bit activation (or its gradient) to the next stage."""
        nbytes = 2.0 * _as_float(mbs) * _as_float(seqlen) * self.model.hidden_size
        return nbytes / (self.p2p_gbps * 1e6)  # GB/s = 1e6 bytes per ms


def shipped_profiles() -> dict[str, Path]:
    """Profiles that come with the package, by name (the file name without ``.json``)."""
    return {p.stem: p for p in sorted(PROFILES_DIR.glob("*.json"))}


def resolve_cost_model_path(name_or_path: str | os.PathLike, flag: str = "--cost-model") -> Path:
    """An existing file as given, else the shipped profile of that name (``gpt-6.7b-a100``,
    with or without ``.json``); a path that is neither raises CostModelError naming both and
    the ``flag`` that takes them."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_profiles()
    name = path.name[:-len(".json")] if path.name.endswith(".json") else path.name
    if path.parent == Path(".") and name in shipped:
        return shipped[name]
    raise CostModelError(
        f"cost model file {os.fspath(name_or_path)} not found: pass {flag} PATH to a JSON file in the "
        f"format of docs/cost_model.md, or a shipped profile ({', '.join(shipped) or 'none'})"
    )


#: The model fields a layer's time and memory depend on (num_layers does not: a profile is per layer).
#: Dropout is one: drawing and applying its masks is work of its own.
ARCHITECTURE_FIELDS = ("hidden_size", "num_attention_heads", "query_groups", "ffn_hidden_size", "vocab_size",
                       "swiglu", "normalization", "position_embedding_type", "hidden_dropout", "attention_dropout")


def profile_mismatch(metadata: Mapping, *, model: "Mapping | None" = None, dtype: "str | None" = None) -> "str | None":
    """How a profile's recorded model and dtype differ from a job's (``model``: ModelSpec fields),
    in words; None when they agree or the profile records neither (as the shipped A100 one)."""
    differences = []
    profiled = metadata.get("model")
    if model is not None and isinstance(profiled, Mapping):
        mine, theirs = _architecture(model), _architecture(profiled)
        differences += [f"{k} {theirs[k]} (job: {mine[k]})" for k in ARCHITECTURE_FIELDS if mine[k] != theirs[k]]
    if dtype is not None and metadata.get("dtype") not in (None, dtype):
        differences.append(f"dtype {metadata['dtype']} (job: {dtype})")
    return "; ".join(differences) or None


def _architecture(fields: Mapping) -> dict:
    defaults = dict(vocab_size=None, swiglu=False, normalization="LayerNorm",
                    position_embedding_type="learned_absolute", hidden_dropout=0.1, attention_dropout=0.1)
    arch = {k: fields.get(k, defaults.get(k)) for k in ARCHITECTURE_FIELDS}
    arch["ffn_hidden_size"] = arch["ffn_hidden_size"] or 4 * arch["hidden_size"]
    arch["query_groups"] = fields.get("num_query_groups") or fields.get("num_attention_heads")
    return arch


def load_cost_model(path: str | os.PathLike | None, tp: int, **analytical_kwargs) -> CostModel:
    """The profiled model in ``path`` (a file or a shipped profile's name), or the analytical
    model when ``path`` is None.

    With a path, only ``hidden_size`` among the keyword arguments is used (for p2p sizes).
    """
    if path is None:
        return AnalyticalCostModel(tp=tp, **analytical_kwargs)
    return ProfiledCostModel.from_json(resolve_cost_model_path(path), tp,
                                       hidden_size=analytical_kwargs.get("hidden_size"))


def load_job_cost_model(path: "str | os.PathLike | None", model: Mapping, *, tp: int, dtype: str,
                        flag: str = "--cost-model") -> CostModel:
    """The cost model a job of ``model`` (ModelSpec fields) in ``dtype`` plans with: the profile
    ``path`` (a file or a shipped profile's name), or the analytical model of that GPT when
    ``path`` is None. A profile made for another model or dtype raises CostModelError, one line
    naming the difference and the fix."""
    kwargs = dict(hidden_size=model["hidden_size"])
    if path is None:
        kwargs.update(num_heads=model["num_attention_heads"], ffn_hidden_size=model.get("ffn_hidden_size"),
                      vocab_size=model.get("vocab_size") or 50257)
    cost_model = load_cost_model(path, tp=tp, **kwargs)
    mismatch = path is not None and profile_mismatch(cost_model.metadata, model=model, dtype=dtype)
    if mismatch:
        raise CostModelError(f"{flag} {os.fspath(path)} was profiled with another model or dtype: {mismatch}; "
                             "profile this job's model (megatron-dynapipe profile with its flags) or drop the flag")
    return cost_model


def as_stage_costs(cost_model: "CostModel | StageCosts | str | os.PathLike | None", *, tp: int, num_layers: int,
                   pp: int, dp: int, zero_stage: int = 0, **analytical_kwargs) -> StageCosts:
    """What a caller holds -- per-stage costs, a cost model, a profile's path or name, or None
    for the analytical model (``analytical_kwargs`` describe its GPT) -- as the per-stage costs
    of ``num_layers`` layers over ``pp`` stages."""
    if isinstance(cost_model, StageCosts):
        return cost_model
    if cost_model is None or isinstance(cost_model, (str, os.PathLike)):
        cost_model = load_cost_model(cost_model, tp, **analytical_kwargs)
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel, StageCosts, path or None, got {cost_model!r}")
    return StageCosts(cost_model, num_layers=num_layers, pp=pp, dp=dp, zero_stage=zero_stage)
