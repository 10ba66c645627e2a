"""The cost-model file (docs/cost_model.md), read and written here and nowhere else.

A file is one JSON object.  A *measured* profile holds records: ``layer_time`` (ms of a layer in
a phase at a (seqlen, mbs) point), ``activation_memory`` (MB an encoder layer stores and peaks at),
``model_state_memory`` (16-bit parameter MB of the embedding and of an encoder layer),
``infeasible`` (points that ran out of memory), ``microbatch_overhead`` (what a whole training
step adds per micro-batch, once per stage and once per layer) and, optionally,
``attention_core_time`` (ms of the layer's attention core alone without a mask, the kernel of the
blocks context parallelism's ring adds).  An encoder's ``layer_time`` and ``activation_memory``
records with ``"layout": "thd"`` (format version 2) measure packed rows: ``mbs`` samples of
``seqlen`` tokens each, back to back in one row, each attending to itself alone.  An encoder's
``layer_time`` records with ``"cp": n`` (format version 3) measure the layer on one rank of a real
context-parallel group of ``n`` ranks, the row's ``seqlen`` whole tokens split as Megatron splits
them (the slowest rank's time, the ring's transfers and waits included), and its
``activation_memory`` records with ``"cp": n`` (format version 4) what one rank of it stores and
peaks at (the ring's keys and values included).  A *calibrated*
file holds instead an ``analytical`` object: the GPT's sizes and the rates ``profile --calibrate``
fitted.  Both may carry ``name``, ``source``, ``hidden_size`` and ``metadata`` (device, dtype,
versions, model).

:class:`ProfileRecords` is a measured profile keyed as its records are (what the profiler fills in
and resumes, what :class:`~.profiled.ProfiledCostModel` interpolates); :func:`calibrated_settings`
and :func:`calibrated_document` are the calibrated file's two directions.  Every reader failure is a
:class:`~.base.CostModelError` that names the file and the broken record.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from megatron_dynapipe.planning.cost_model.base import KINDS, LAYERS, PARAM_LAYERS, PHASES, CostModelError
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["ProfileRecords", "read_document", "read_complete_document", "to_text", "is_calibrated",
           "calibrated_settings",
           "calibrated_document", "FORMAT_VERSION", "FORMAT_HINT", "CALIBRATED", "CALIBRATED_SHAPE", "OVERHEAD_PER"]

FORMAT_VERSION = 4  # metadata.format_version of the files megatron-dynapipe profile writes
#: 2 added the packed (``"layout": "thd"``) records, 3 the ``"cp"`` layer times, 4 the ``"cp"`` memory
READABLE_VERSIONS = (1, 2, 3, 4)
LAYOUTS = ("padded", "thd")  # a record's optional ``layout``: padded rows (the default) or packed ones
FORMAT_HINT = "see docs/cost_model.md for the format"
OPTIONAL_LAYERS = ("preprocess",)  # a profile without them prices them at nothing
OVERHEAD_PER = ("stage", "layer")  # what a microbatch_overhead record is paid once per
#: the keys of a calibrated model's ``analytical`` object: the GPT's sizes, then what was fitted
CALIBRATED = ("hidden_size", "num_heads", "ffn_hidden_size", "vocab_size",
              "peak_tflops", "mfu", "attention_mfu", "overhead_ms", "saturation_tokens", "device_memory_mb")
#: the optional keys of an ``analytical`` object: the GPT's shape beyond its widths (absent: a
#: GPT-3-style layer, one key/value head per query head, GeLU MLP, megatron-core's unfused core)
CALIBRATED_SHAPE = ("num_query_groups", "swiglu", "fused_attention")

#: per record table: the fields that key a record, and the one that holds its value
_FIELDS = {
    "layer_time": (("tp", "recompute", "layer", "phase", "seqlen", "mbs"), "ms"),
    "activation_memory": (("tp", "recompute", "layer", "kind", "seqlen", "mbs"), "mb"),
    "model_state_memory": (("tp", "recompute", "layer"), "mb"),
    "attention_core_time": (("tp", "phase", "seqlen", "mbs"), "ms"),
}
OPTIONAL_TABLES = ("attention_core_time",)  # files without them read as before
_CHOICES = {
    ("layer_time", "layer"): LAYERS,
    ("layer_time", "phase"): PHASES,
    ("activation_memory", "layer"): ("encoder",),
    ("activation_memory", "kind"): KINDS,
    ("model_state_memory", "layer"): PARAM_LAYERS,
    ("attention_core_time", "phase"): PHASES,
}


def read_document(path: "str | os.PathLike") -> dict:
    """The JSON object of a cost-model file (CostModelError, naming the fix, when there is none)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CostModelError(f"cost model file {path} not found: pass --cost-model PATH to a JSON file in the "
                             "format of docs/cost_model.md")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise CostModelError(f"cost model file {path} is not valid JSON ({e.msg} at line {e.lineno} column "
                             f"{e.colno}): {FORMAT_HINT}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CostModelError(f"cost model file {path} cannot be read ({e}): {FORMAT_HINT}") from None
    if not isinstance(doc, dict):
        raise CostModelError(f"cost model file {path} holds a JSON {type(doc).__name__}, not an object: {FORMAT_HINT}")
    _check_format_version(doc, path)
    return doc


def read_complete_document(path: "str | os.PathLike") -> dict:
    """:func:`read_document` of a file every consumer may price with: an interrupted profile
    (``"complete": false``: some lengths or recompute types never measured) is refused, naming the
    fix, rather than planned with as if it were whole."""
    doc = read_document(path)
    if isinstance(doc, dict) and (metadata_of(doc) or {}).get("complete") is False:
        raise CostModelError(f"cost model file {os.fspath(path)} is an interrupted profile (\"complete\": false): "
                             "finish it with `megatron-dynapipe profile` with its flags, -o it and --resume, or pass a "
                             "complete profile")
    return doc


def _check_format_version(doc: Any, path: str) -> None:
    """A file of a format this package does not know is refused, not read as if it were its own
    (files without ``metadata.format_version``, such as hand-made ones, are read as version 1)."""
    version = (metadata_of(doc) or {}).get("format_version", 1)
    if version not in READABLE_VERSIONS:
        *earlier, last = map(str, READABLE_VERSIONS)
        readable = f"{', '.join(earlier)} and {last}" if earlier else last
        raise CostModelError(f"cost model file {path} has format_version {version!r}; this megatron-dynapipe reads "
                             f"versions {readable}: re-profile with this version, or use the megatron-dynapipe "
                             "that wrote it")


def to_text(doc: Mapping) -> str:
    """A document as the package writes its files: indented JSON, one record a line or so."""
    return json.dumps(doc, indent=1) + "\n"


def is_calibrated(doc: Any) -> bool:
    return isinstance(doc, dict) and "analytical" in doc


def metadata_of(doc: Mapping) -> "dict | None":
    return doc.get("metadata") if isinstance(doc.get("metadata"), dict) else None


class _Source:
    """Failures that name the file."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, what: str):
        raise CostModelError(f"cost model file {self.source} {what}: {FORMAT_HINT}")


@dataclass
class ProfileRecords:
    """A measured profile, each record table keyed as its records are (recompute by label)."""

    times: dict[tuple, float] = field(default_factory=dict)  # (tp, recompute, layer, phase, seqlen, mbs) -> ms
    spread: dict[tuple, float] = field(default_factory=dict)  # same keys as times -> ms
    memory: dict[tuple, float] = field(default_factory=dict)  # (tp, recompute, kind, seqlen, mbs) -> MB
    params: dict[tuple, float] = field(default_factory=dict)  # (tp, recompute, layer) -> MB
    infeasible: set[tuple] = field(default_factory=set)  # (tp, recompute, seqlen, mbs)
    overhead: dict[int, dict] = field(default_factory=dict)  # tp -> {(per, phase): (ms, ms_per_token)}
    overhead_points: dict[int, int] = field(default_factory=dict)  # tp -> shapes the overhead was fitted to
    # the encoder on packed rows (layout "thd"), keyed as times and memory are, layer and phase
    # or kind included
    packed_times: dict[tuple, float] = field(default_factory=dict)
    packed_spread: dict[tuple, float] = field(default_factory=dict)
    packed_memory: dict[tuple, float] = field(default_factory=dict)
    core_times: dict[tuple, float] = field(default_factory=dict)  # (tp, phase, seqlen, mbs) -> ms
    # the encoder on one rank of a context-parallel group: (tp, cp, recompute, layout, phase, seqlen, mbs) -> ms
    cp_times: dict[tuple, float] = field(default_factory=dict)
    cp_spread: dict[tuple, float] = field(default_factory=dict)
    # what that rank stores and peaks at: (tp, cp, recompute, layout, kind, seqlen, mbs) -> MB
    cp_memory: dict[tuple, float] = field(default_factory=dict)

    # -- writing -------------------------------------------------------------------------------

    def records(self) -> dict[str, list]:
        """The record tables of the file, sorted."""
        def times(table, spread, layout):
            return [dict(tp=k[0], recompute=k[1], layer=k[2], phase=k[3], seqlen=k[4], mbs=k[5], **layout,
                         ms=round(v, 4), spread_ms=round(spread.get(k, 0.0), 4)) for k, v in sorted(table.items())]

        def memory(table, layout):
            return [dict(tp=k[0], recompute=k[1], layer="encoder", kind=k[2], seqlen=k[3], mbs=k[4], **layout,
                         mb=round(v, 4)) for k, v in sorted(table.items())]

        def cp(table, what, value):
            return [dict(tp=k[0], cp=k[1], recompute=k[2], layer="encoder", **{what: k[4]}, seqlen=k[5], mbs=k[6],
                         **({"layout": k[3]} if k[3] != "padded" else {}), **value(k, v))
                    for k, v in sorted(table.items())]

        thd = {"layout": "thd"}
        cp_times = cp(self.cp_times, "phase",
                      lambda k, v: dict(ms=round(v, 4), spread_ms=round(self.cp_spread.get(k, 0.0), 4)))
        cp_memory = cp(self.cp_memory, "kind", lambda k, v: dict(mb=round(v, 4)))
        return {
            "layer_time": times(self.times, self.spread, {}) + times(self.packed_times, self.packed_spread, thd)
            + cp_times,
            "activation_memory": memory(self.memory, {}) + memory(self.packed_memory, thd) + cp_memory,
            "model_state_memory": [dict(tp=k[0], recompute=k[1], layer=k[2], mb=round(v, 4))
                                   for k, v in sorted(self.params.items())],
            "infeasible": [dict(tp=k[0], recompute=k[1], seqlen=k[2], mbs=k[3]) for k in sorted(self.infeasible)],
            "microbatch_overhead": self.overhead_records(),
            "attention_core_time": [dict(tp=k[0], phase=k[1], seqlen=k[2], mbs=k[3], ms=round(v, 4))
                                    for k, v in sorted(self.core_times.items())],
        }

    def overhead_records(self) -> list[dict]:
        return [dict(tp=tp, per=per, phase=phase, ms=round(ms, 4), ms_per_token=round(per_token, 7),
                     points=self.overhead_points.get(tp, 0))
                for tp, lines in sorted(self.overhead.items())
                for per in OVERHEAD_PER for phase in PHASES
                for ms, per_token in [lines[per, phase]]]

    # -- reading -------------------------------------------------------------------------------

    @classmethod
    def from_document(cls, doc: Any, source: str) -> "ProfileRecords":
        """The records of a measured profile, every one checked."""
        where = _Source(source)
        if not isinstance(doc, dict):
            where.fail(f"holds a JSON {type(doc).__name__}, not an object")
        out = cls()
        for table in _FIELDS:
            if table not in doc and table not in OPTIONAL_TABLES:
                where.fail(f"lacks the key {table!r}")
            if not isinstance(doc.get(table, []), list):
                where.fail(f"key {table!r} is not a list of records")
            for n, rec in enumerate(doc.get(table, [])):
                out._add(table, _record(where, table, n, rec), rec, where)
        out.overhead, out.overhead_points = _overhead(doc, where)
        for n, rec in enumerate(doc.get("infeasible", [])):
            if not isinstance(rec, dict) or not all(_positive_int(rec.get(k)) for k in ("tp", "seqlen", "mbs")):
                where.fail(f"has an infeasible record {n} without a positive tp, seqlen and mbs")
            out.infeasible.add((int(rec["tp"]), _recompute_label(where, f"infeasible record {n}", rec.get("recompute")),
                                int(rec["seqlen"]), int(rec["mbs"])))
        return out

    def _add(self, table: str, values: tuple, rec: dict, where: _Source) -> None:
        *key, value = values
        key = tuple(key)
        if table == "layer_time" and rec.get("layer") == "encoder" and value <= 0:
            where.fail(f"has an encoder layer_time of {value:g} ms (seqlen {rec.get('seqlen')}, mbs {rec.get('mbs')}): "
                       "a transformer layer takes time; measure it again (megatron-dynapipe profile)")
        layout = _layout(where, table, rec)
        packed = layout == "thd"
        cp = _cp(where, table, rec)
        if cp > 1 and table == "layer_time":
            tp, rc, _layer, phase, s, m = key
            _put(where, self.cp_times, (tp, cp, rc, layout, phase, s, m), value, table)
            self.cp_spread[tp, cp, rc, layout, phase, s, m] = float(rec.get("spread_ms", 0.0) or 0.0)
        elif cp > 1:
            tp, rc, _layer, kind, s, m = key
            _put(where, self.cp_memory, (tp, cp, rc, layout, kind, s, m), value, table)
        elif table == "layer_time":
            _put(where, self.packed_times if packed else self.times, key, value, table)
            (self.packed_spread if packed else self.spread)[key] = float(rec.get("spread_ms", 0.0) or 0.0)
        elif table == "activation_memory":
            tp, rc, _layer, kind, s, m = key
            _put(where, self.packed_memory if packed else self.memory, (tp, rc, kind, s, m), value, table)
        elif table == "attention_core_time":
            _put(where, self.core_times, key, value, table)
        else:  # one value per recompute type, equal up to noise
            self.params[key] = max(self.params.get(key, 0.0), value)

    def tps(self) -> set[int]:
        return {k[0] for k in self.times}

    def tables(self, tp: int, source: str) -> tuple[dict, dict, dict]:
        """The tables of tensor-parallel size ``tp`` a profiled cost model interpolates:
        (layer, phase, RecomputeType) -> {(seqlen, mbs): ms}, (kind, RecomputeType) -> {(seqlen,
        mbs): MB} and layer -> parameter MB (the largest of the recompute types' records); a
        layer missing from ``OPTIONAL_LAYERS`` is priced at nothing, any other absence fails."""
        where = _Source(source)
        times, memory = _grids(self.times, tp), _grids(self.memory, tp)
        params: dict[str, float] = {}
        for (t, _rc, layer), v in self.params.items():
            if t == tp:
                params[layer] = max(params.get(layer, 0.0), v)
        for rc in sorted({rc for _, _, rc in times}):
            for layer in LAYERS:
                for phase in PHASES:
                    if (layer, phase, rc) in times:
                        continue
                    if layer not in OPTIONAL_LAYERS:
                        where.fail(f"has no {layer} {phase} times for tp={tp} recompute={rc.label}")
                    times[layer, phase, rc] = dict.fromkeys(times["encoder", phase, rc], 0.0)
            for kind in KINDS:
                if (kind, rc) not in memory:
                    where.fail(f"has no {kind} activation memory for tp={tp} recompute={rc.label}")
        for layer in PARAM_LAYERS:
            if layer not in params:
                where.fail(f"has no model_state_memory of the {layer} for tp={tp}")
        return times, memory, params

    def packed_tables(self, tp: int) -> tuple[dict, dict]:
        """The encoder's packed-row tables of ``tp``, keyed as :meth:`tables` keys its own, for the
        recompute types measured in both phases and both kinds; empty where none were."""
        times, memory = _grids(self.packed_times, tp), _grids(self.packed_memory, tp)
        complete = {rc for _, _, rc in times
                    if all(("encoder", phase, rc) in times for phase in PHASES)
                    and all((kind, rc) in memory for kind in KINDS)}
        return ({k: v for k, v in times.items() if k[2] in complete},
                {k: v for k, v in memory.items() if k[1] in complete})

    def cp_tables(self, tp: int) -> dict:
        """The encoder of ``tp`` measured on context-parallel groups: (cp, layout, phase or kind,
        RecomputeType) -> {(seqlen, mbs): ms or MB}, for the groups, layouts and types measured in
        both phases (times) or both kinds (memory)."""
        tables: dict = {}
        for (t, cp, rc, layout, what, s, m), v in (*self.cp_times.items(), *self.cp_memory.items()):
            if t == tp:
                tables.setdefault((cp, layout, what, RecomputeType.parse(rc)), {})[s, m] = v
        return {k: v for k, v in tables.items()
                if all((*k[:2], other, k[3]) in tables for other in (PHASES if k[2] in PHASES else KINDS))}

    def core_tables(self, tp: int) -> dict:
        """The attention core's times of ``tp``: phase -> {(seqlen, mbs): ms}, both phases or none."""
        tables: dict = {}
        for (t, phase, s, m), v in self.core_times.items():
            if t == tp:
                tables.setdefault(phase, {})[s, m] = v
        return tables if all(phase in tables for phase in PHASES) else {}


def _grids(records: Mapping[tuple, float], tp: int) -> dict:
    """Records keyed ``(tp, recompute, *what, seqlen, mbs)`` of tensor-parallel size ``tp`` as
    grids: ``(*what, RecomputeType)`` -> {(seqlen, mbs): value}."""
    grids: dict = {}
    for (t, rc, *what, s, m), v in records.items():
        if t == tp:
            grids.setdefault((*what, RecomputeType.parse(rc)), {})[s, m] = v
    return grids


def hidden_size_of(doc: Mapping, source: str) -> "int | None":
    """The file's optional ``hidden_size``."""
    h = doc.get("hidden_size")
    if h is None:
        return None
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
        _Source(source).fail("has a 'hidden_size' that is not a positive integer")
    return h


def overhead_of(doc: Mapping, tp: int, source: str) -> dict[tuple[str, str], tuple[float, float]]:
    """The ``microbatch_overhead`` lines of ``tp``: (per, phase) -> (ms, ms per token)."""
    return _overhead(doc, _Source(source))[0].get(tp, {})


def calibrated_settings(doc: Mapping, source: str) -> dict[str, Any]:
    """The ``analytical`` object of a calibrated file, every key of :data:`CALIBRATED` present."""
    settings = doc["analytical"]
    missing = [key for key in CALIBRATED if not isinstance(settings, dict) or key not in settings]
    if missing:
        _Source(source).fail(f"has an 'analytical' object without {', '.join(map(repr, missing))}")
    return {key: settings[key] for key in CALIBRATED + CALIBRATED_SHAPE if key in settings}


def calibrated_document(*, name: str, source: str, hidden_size: int, metadata: dict, settings: Mapping[str, Any],
                        overhead: list[dict]) -> dict:
    """A calibrated file: the analytical model's ``settings`` (the keys the reader reads, in its
    order) and the measured ``overhead`` records."""
    return {"name": name, "source": source, "hidden_size": hidden_size, "metadata": metadata,
            "analytical": {key: settings[key] for key in CALIBRATED + CALIBRATED_SHAPE if key in settings},
            "microbatch_overhead": overhead}


# ---- record checks -------------------------------------------------------------------------------


def _positive_int(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == int(v) and v >= 1


def _recompute_label(where: _Source, what: str, v: Any) -> str:
    if not isinstance(v, str):
        where.fail(f"has a {what} whose 'recompute' is not a string")
    try:
        return RecomputeType.parse(v).label
    except ValueError:
        where.fail(f"has a {what} with unknown recompute {v!r} (use none, selective, full)")


def _record(where: _Source, table: str, n: int, rec: Any) -> tuple:
    """A record's key fields and value, in the order of :data:`_FIELDS`, each checked."""
    what = f"{table} record {n}"
    if not isinstance(rec, dict):
        where.fail(f"has a {what} that is not an object")
    keys, value_key = _FIELDS[table]
    out = []
    for key in (*keys, value_key):
        if key not in rec:
            where.fail(f"has a {what} without {key!r}")
        v = rec[key]
        if key == "recompute":
            v = _recompute_label(where, what, v)
        elif key in ("layer", "phase", "kind"):
            choices = _CHOICES[(table, key)]
            if v not in choices:
                where.fail(f"has a {what} with {key} {v!r} (use {', '.join(choices)})")
        elif key in ("tp", "seqlen", "mbs"):
            if not _positive_int(v):
                where.fail(f"has a {what} whose {key!r} is not a positive integer")
            v = int(v)
        else:  # the measured value
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                where.fail(f"has a {what} whose {key!r} is not a finite number >= 0")
            v = float(v)
        out.append(v)
    return tuple(out)


def _layout(where: _Source, table: str, rec: dict) -> str:
    layout = rec.get("layout", "padded")
    if layout not in LAYOUTS or (layout == "thd" and rec.get("layer") != "encoder"):
        where.fail(f"has a {table} record of layout {layout!r}: use padded, or thd for the encoder")
    return layout


def _cp(where: _Source, table: str, rec: dict) -> int:
    """A record's optional ``cp``: the context-parallel ranks its encoder was measured on (1: none)."""
    cp = rec.get("cp", 1)
    if not _positive_int(cp) or (cp > 1 and (table not in ("layer_time", "activation_memory")
                                             or rec.get("layer") != "encoder")):
        where.fail(f"has a {table} record with cp {cp!r}: use a positive integer, above 1 for the encoder's "
                   "layer_time and activation_memory only")
    return int(cp)


def _put(where: _Source, grid: dict, key: tuple, value: float, table: str) -> None:
    if key in grid and grid[key] != value:
        where.fail(f"has conflicting {table} records for seqlen={key[-2]} mbs={key[-1]} ({grid[key]} and {value})")
    grid[key] = value


def _overhead(doc: Mapping, where: _Source) -> tuple[dict[int, dict], dict[int, int]]:
    """Every ``microbatch_overhead`` record: tp -> {(per, phase): (ms, ms_per_token)}, and per tp
    the shapes it was fitted to."""
    records = doc.get("microbatch_overhead", [])
    if not isinstance(records, list):
        where.fail("key 'microbatch_overhead' is not a list of records")
    lines: dict[int, dict] = {}
    points: dict[int, int] = {}
    for n, rec in enumerate(records):
        what = f"microbatch_overhead record {n}"
        if not isinstance(rec, dict) or rec.get("phase") not in PHASES or rec.get("per") not in OVERHEAD_PER:
            where.fail(f"has a {what} that is not an object with a phase of {', '.join(PHASES)} and a per "
                       f"of {', '.join(OVERHEAD_PER)}")
        values = [rec.get(key) for key in ("tp", "ms", "ms_per_token")]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                   for v in values):
            where.fail(f"has a {what} whose tp, ms or ms_per_token is not a finite number >= 0")
        tp = int(values[0]) if values[0] == int(values[0]) else values[0]
        lines.setdefault(tp, {})[rec["per"], rec["phase"]] = (float(values[1]), float(values[2]))
        points[tp] = int(rec.get("points", 0) or 0)
    return lines, points
