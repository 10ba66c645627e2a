"""The one Chrome-trace builder: simulated plans (:mod:`.viz`), recorded ranks
(:class:`~.tracer.trace_format.RankTrace`, merged per traced layout) and the timed steps of
``bench step`` (:mod:`.bench.step_timeline`) become Trace Event Format documents that
chrome://tracing and Perfetto open.

A document holds processes (a pipeline stage of a DP rank, or a traced rank), each with named
rows (threads, numbered in the order they are first used and shown in that order) and complete
events on them, in microseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from megatron_dynapipe.files import write_atomically

__all__ = ["ChromeTrace"]


class ChromeTrace:
    """A Trace Event Format document, built process by process; ``other_data`` is shown by the
    viewer as the trace's metadata."""

    def __init__(self, **other_data: Any) -> None:
        self.other_data = dict(other_data)
        self._meta: list[dict[str, Any]] = []
        self._spans: list[dict[str, Any]] = []
        self._rows: dict[int, dict[str, int]] = {}

    def process(self, pid: int, name: str) -> None:
        self._meta.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        self._rows.setdefault(pid, {})

    def row(self, pid: int, name: str) -> int:
        """The thread id of row ``name`` of process ``pid`` (declared on first use)."""
        rows = self._rows.setdefault(pid, {})
        tid = rows.get(name)
        if tid is None:
            tid = rows[name] = len(rows)
            self._meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            self._meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                               "args": {"sort_index": tid}})
        return tid

    def span(self, pid: int, row: str, name: str, *, cat: str, start_us: float, dur_us: float,
             args: Optional[dict[str, Any]] = None) -> None:
        """A complete event (``"X"``) on row ``row`` of process ``pid``."""
        self._spans.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": self.row(pid, row),
                            "ts": start_us, "dur": dur_us, "args": args or {}})

    def to_json(self) -> dict[str, Any]:
        return {"traceEvents": self._meta + self._spans, "displayTimeUnit": "ms", "otherData": self.other_data}

    def write(self, path: str | os.PathLike) -> Path:
        return write_atomically(path, json.dumps(self.to_json()))
