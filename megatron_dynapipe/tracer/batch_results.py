"""What tracing a batch gives back, and the files that record it.

Each config of a batch ends as a :class:`ConfigResult` ("ok", "failed", "invalid" or
"interrupted") holding one :class:`RankResult` per traced rank.  A config's folder gets
``summary.json`` (rewritten atomically after every rank, ``"complete": true`` at the end) and
``timeline.json`` (every rank merged into one Chrome/Perfetto timeline).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from megatron_dynapipe.chrome_trace import ChromeTrace
from megatron_dynapipe.config.layout import is_positive_int
from megatron_dynapipe.files import write_atomically
from megatron_dynapipe.tracer.batch_config import TraceConfig
from megatron_dynapipe.tracer.trace_format import RECORDING_REVISION, RankTrace, TraceFormatError, trace_path

__all__ = ["RankResult", "ConfigResult", "batch_summary", "exit_code", "write_summary", "write_timeline"]

#: Statuses of a config in a batch ("interrupted": stopped by Ctrl-C, its folder incomplete).
OK, FAILED, INVALID, INTERRUPTED = "ok", "failed", "invalid", "interrupted"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.json"


@dataclass
class RankResult:
    """What tracing one representative rank gave: ``status`` is "ok" or "failed"."""
    rank: int
    stage: int
    ep_rank: int
    status: str
    seconds: float = 0.0
    error: str | None = None
    log: str | None = None
    files: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 4)}


@dataclass
class ConfigResult:
    """One config of a batch: "ok", "failed" (a rank or the config failed) or "invalid" (skipped)."""
    config: TraceConfig
    status: str
    reasons: list[str] = field(default_factory=list)
    error: str | None = None
    folder: Path | None = None
    ranks: list[RankResult] = field(default_factory=list)
    ranks_traced: int = 0
    shapes_only: bool | None = None
    shapes_only_reason: str = ""
    timeline: str | None = None
    seconds: float = 0.0

    @property
    def reduction_pct(self) -> float | None:
        """How much smaller the traced set is than the job: ``100 * (1 - traced / world)``."""
        if not self.ranks_traced or not is_positive_int(self.config.world_size):
            return None
        return 100.0 * (1.0 - self.ranks_traced / self.config.world_size)

    def note(self, rank: RankResult) -> None:
        """A failed rank fails its config; the first failure is the config's error for now."""
        if rank.status != OK:
            self.status = FAILED
            self.error = self.error or f"rank {rank.rank}: {rank.error}"

    def order_ranks(self, global_ranks: list[int]) -> None:
        """List the ranks in the config's order (they finish in any order); the first failed one
        in that order becomes the config's error, so a run reports the same rank every time."""
        position = {rank: i for i, rank in enumerate(global_ranks)}
        self.ranks.sort(key=lambda r: position[r.rank])
        failed = [r for r in self.ranks if r.status != OK]
        if failed:
            self.error = f"rank {failed[0].rank}: {failed[0].error}"

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.config.to_dict(),
            "status": self.status,
            "reasons": list(self.reasons),
            "error": self.error,
            "folder": str(self.folder) if self.folder else None,
            "ranks_in_job": self.config.world_size,
            "ranks_traced": self.ranks_traced,
            "reduction_pct": None if self.reduction_pct is None else round(self.reduction_pct, 4),
            "shapes_only": self.shapes_only,
            "shapes_only_reason": self.shapes_only_reason,
            "timeline": self.timeline,
            "seconds": round(self.seconds, 4),
            "ranks": [r.to_dict() for r in self.ranks],
        }


def batch_summary(results: Sequence[ConfigResult], **extra: Any) -> dict[str, Any]:
    """The whole batch as one JSON-able object (what ``trace --json`` prints)."""
    counts = {s: sum(r.status == s for r in results) for s in (OK, FAILED, INVALID, INTERRUPTED)}
    return {**extra, "configs": [r.to_dict() for r in results], **counts, "exit_code": exit_code(results)}


def exit_code(results: Sequence[ConfigResult], *, strict: bool = False) -> int:
    """0 when every valid config traced; 130 when Ctrl-C stopped the batch; 1 when one failed,
    none was valid, or (``strict``) one was invalid."""
    if any(r.status == INTERRUPTED for r in results):
        return 130  # as a shell reports a command stopped by Ctrl-C
    if any(r.status == FAILED for r in results):
        return 1
    if not any(r.status == OK for r in results):
        return 1
    if strict and any(r.status == INVALID for r in results):
        return 1
    return 0


def write_summary(result: ConfigResult, complete: bool = True) -> None:
    """Write ``summary.json`` atomically; a write that fails fails the config (never raises)."""
    assert result.folder is not None
    doc = {**result.to_dict(), "complete": complete, "recording_revision": RECORDING_REVISION}
    try:
        write_atomically(result.folder / SUMMARY_FILE, json.dumps(doc, indent=2) + "\n")
    except OSError as error:
        result.status = FAILED
        result.error = result.error or f"cannot write {SUMMARY_FILE}: {error}"


def write_timeline(result: ConfigResult, traces: "Mapping[int, Any] | None" = None) -> None:
    """Read every traced rank back (a check that its file is whole) and merge them into one
    Chrome/Perfetto timeline, ``timeline.json``: one process per rank.  A rank whose trace is
    missing or unreadable fails. ``traces``: RankTraces already read, by rank (not read again)."""
    assert result.folder is not None
    timeline = ChromeTrace(config=result.config.to_dict(), ranks=[r.rank for r in result.ranks])
    merged = _each_trace(result, lambda path, rank: (
        traces[rank] if traces and rank in traces else RankTrace.read(path)).add_to(timeline))
    if not merged:
        return
    try:
        timeline.write(result.folder / TIMELINE_FILE)
        result.timeline = TIMELINE_FILE
    except OSError as error:
        result.status, result.error = FAILED, result.error or f"cannot write {TIMELINE_FILE}: {error}"


def check_traces(result: ConfigResult) -> None:
    """Without a timeline: every traced rank's file is there and opens with a trace header (ranks
    write their files atomically, so the rest is whole).  A rank whose file is not fails."""
    _each_trace(result, lambda path, rank: RankTrace.read_header(path))


def _each_trace(result: ConfigResult, use) -> int:
    """``use(path, rank)`` on every traced rank's file; a missing or unreadable one fails its rank.
    Returns how many were used."""
    used = 0
    for rank in result.ranks:
        if rank.status != OK:
            continue
        path = trace_path(result.folder, rank.rank)
        try:
            use(path, rank.rank)
            used += 1
        except FileNotFoundError:
            rank.status, rank.error = FAILED, f"the tracer wrote no {path.name}"
        except (OSError, TraceFormatError) as error:
            rank.status, rank.error = FAILED, f"unreadable {path.name}: {error_line(error)}"
        result.note(rank)
    return used


def error_line(error: BaseException) -> str:
    """An exception as the one line a result records."""
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0] if text else type(error).__name__
