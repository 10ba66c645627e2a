"""A traced layout as the replay reads it: the representative ranks' traces of one config
folder, checked to belong together (:func:`load_job`), and which traced rank stands for any rank
of the job (:meth:`TracedJob.representative_of`). Nothing here imports torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_dynapipe.config.layout import ParallelLayout, expert_coords
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.tracer.trace_format import RankTrace, read_traces

__all__ = ["TraceMismatch", "TracedJob", "load_job", "representatives", "job_folders"]

RETRACE = "re-trace the config with `megatron-dynapipe trace`"


class TraceMismatch(ValueError):
    """The traces of one layout do not fit together (a missing rank, unmatched communication)."""


def _place(layout: ParallelLayout, rank: int) -> tuple[int, int]:
    """(stage, expert rank) of ``rank``: the ranks that share it run the same ops."""
    coords = expert_coords(layout, rank)
    return coords.pp, coords.ep


@dataclass
class TracedJob:
    """The representative-rank traces of one layout, checked to belong together."""

    folder: Path
    traces: dict[int, RankTrace]
    layout: ParallelLayout
    model: ModelSpec
    iteration: dict[str, Any]
    dtype: str

    @property
    def iterations(self) -> int:
        return max(1, int(self.iteration.get("trace_iters") or 1))

    @property
    def global_batch_size(self) -> int:
        it = self.iteration
        return int(it["micro_batch_size"]) * int(it["num_microbatches"]) * self.layout.dp

    @property
    def overlap_grad_reduce(self) -> bool:
        return bool((self.iteration.get("ddp") or {}).get("overlap_grad_reduce"))

    @property
    def training(self) -> dict:
        """The traced ``MegatronOptions`` (``MegatronOptions.to_json``; empty in older traces)."""
        return self.iteration.get("training") or {}

    @property
    def tp_comm_overlap(self) -> bool:
        return bool(self.training.get("tp_comm_overlap"))

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.training.get("sequence_parallel"))

    @property
    def async_tp_backward(self) -> bool:
        """Whether a column-parallel linear's backward collectives run beside its GEMMs (megatron-core's
        way; a trace of an older Megatron-LM's layout may say not: MegatronOptions.async_tp_backward)."""
        return bool(self.training.get("async_tp_backward", True))

    @property
    def overlap_param_gather(self) -> bool:
        return bool((self.iteration.get("ddp") or {}).get("overlap_param_gather"))

    def only_iteration(self, index: int) -> "TracedJob":
        """This job with traced iteration ``index`` alone."""
        traces = {rank: dataclasses.replace(trace, ops=[op for op in trace.ops if op.iteration == index])
                  for rank, trace in self.traces.items()}
        return dataclasses.replace(self, traces=traces, iteration={**self.iteration, "trace_iters": 1})

    def representative_of(self, rank: int) -> int:
        """The traced rank that stands for global rank ``rank`` (same stage and expert rank)."""
        place = _place(self.layout, rank)
        rep = self._reps.get(place)
        if rep is None:
            raise TraceMismatch(f"{self.folder}: no trace stands for rank {rank} (stage {place[0]}, expert rank "
                                f"{place[1]}); {RETRACE}")
        return rep

    def representatives_of(self, group: tuple[int, ...]) -> frozenset[int]:
        """The traced ranks that stand for a group's members (asked once per collective op, so kept)."""
        members = self._group_reps.get(group)
        if members is None:
            members = self._group_reps[group] = frozenset(self.representative_of(r) for r in group)
        return members

    def __post_init__(self) -> None:
        self._group_reps: dict[tuple[int, ...], frozenset[int]] = {}
        self._reps = {}
        for rank in self.traces:
            place = _place(self.layout, rank)
            if place in self._reps:
                raise ValueError(f"ranks {self._reps[place]} and {rank} stand for the same stage and expert rank; "
                                 "pass representatives(traces, layout)")
            self._reps[place] = rank
        missing = [stage for stage in range(self.layout.pp) if not any(k[0] == stage for k in self._reps)]
        if missing:
            raise TraceMismatch(f"{self.folder}: no trace of pipeline stage(s) {missing}; {RETRACE}")


def load_job(folder: "str | Path") -> TracedJob:
    """The traces in one config folder (``rank_<r>.trace.jsonl``), checked to be one layout."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such trace folder; give a folder `megatron-dynapipe trace` wrote")
    traces = read_traces(folder)
    if not traces:
        raise TraceMismatch(f"{folder}: no rank_<r>.trace.jsonl files; give a config folder `megatron-dynapipe trace` "
                            "wrote (or the output folder that holds them)")
    first = next(iter(traces.values()))
    for trace in traces.values():
        for what in ("layout", "model", "iteration"):
            if getattr(trace, what) != getattr(first, what):
                raise TraceMismatch(f"{folder}: rank {trace.rank}'s {what} differs from rank {first.rank}'s; the folder "
                                    f"mixes traces of different runs; {RETRACE} into an empty folder")
    layout = ParallelLayout(**{k: v for k, v in first.layout.items() if k != "expert_dp"})
    model_fields = {k: v for k, v in first.model.items() if k in ModelSpec.__dataclass_fields__}
    return TracedJob(folder=folder, traces=representatives(traces, layout), layout=layout,
                     model=ModelSpec(**model_fields), iteration=first.iteration,
                     dtype=str(first.model.get("dtype") or "bfloat16"))


def representatives(traces: dict[int, RankTrace], layout: ParallelLayout) -> dict[int, RankTrace]:
    """One trace per (stage, expert rank), the lowest rank's: a real job's traces of every rank
    replay as its representatives do (their peers run the same ops)."""
    chosen: dict[tuple[int, int], int] = {}
    for rank in sorted(traces):
        chosen.setdefault(_place(layout, rank), rank)
    return {rank: traces[rank] for rank in sorted(chosen.values())}


def job_folders(path: "str | Path") -> list[Path]:
    """``path`` if it holds traces, else its sub-folders that do (a `trace` output folder)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such folder; give a folder `megatron-dynapipe trace` wrote")
    if any(path.glob("rank_*.trace.jsonl")):
        return [path]
    folders = sorted(p for p in path.iterdir() if p.is_dir() and any(p.glob("rank_*.trace.jsonl")))
    if not folders:
        raise TraceMismatch(f"{path}: no rank_<r>.trace.jsonl here or in its sub-folders; give a folder "
                            "`megatron-dynapipe trace` wrote")
    return folders
