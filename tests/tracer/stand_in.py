"""The stand-in tracer the batch-runner and command tests inject: same call and ``write`` contract as
``trace_fake_rank``, so they run in a second and can fail on purpose; and what those tests share."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import time
from pathlib import Path

from megatron_dynapipe.config.model import get_model
from megatron_dynapipe.tracer.batch_config import (
    TraceConfig,
    parse_config_line,
)
from megatron_dynapipe.tracer.trace_format import RankTrace, TraceOp

TINY = get_model("tiny")
TINY_TE = dataclasses.replace(TINY, attention="transformer_engine")


def cfg(line: str, **kw) -> TraceConfig:
    config = parse_config_line(line, **kw)
    assert config is not None
    return config


# --------------------------------------------------------------------------------------------
# the stand-in tracer: same call and `write` contract as trace_fake_rank


def stand_in_trace(layout, rank, model, options) -> RankTrace:
    """A three-op trace in the real trace format (what trace_fake_rank returns)."""
    ops = [TraceOp(seq=i, iteration=0, stage=0, cat="compute", kind="forward", microbatch=i,
                   start_us=10.0 * i, dur_us=5.0) for i in range(3)]
    return RankTrace(rank=rank, stage=0, layout={"world_size": layout.world_size}, coords={}, groups={},
                     model={"name": model.label}, iteration=dict(options, cost_model=None),
                     mode="shapes_only" if options["shapes_only"] else "real", ops=ops,
                     meta={"trace_seconds": stand_in_seconds(rank)})


def stand_in_seconds(rank: int) -> float:
    """How long the stand-in says tracing ``rank`` took (as trace_fake_rank records it)."""
    return 1.5 + rank / 64


class UnreadableTrace:
    def __init__(self, rank):
        self.rank = rank

    def write(self, directory):
        (Path(directory) / f"rank_{self.rank}.trace.jsonl").write_text("not a trace\n")


class SilentTrace:
    def write(self, directory):
        pass


CALLS: list[dict] = []


def stand_in_tracer(layout, rank, model, **options):
    print(f"stand-in tracing rank {rank}")
    CALLS.append({"world_size": layout.world_size, "rank": rank, "model": model.label, **options})
    return stand_in_trace(layout, rank, model, options)


def failing_on(world_size=None, rank=None, how="raise"):
    """A stand-in that fails for one world size (whole config) or one rank."""

    def tracer(layout, r, model, **options):
        if (world_size is None or layout.world_size == world_size) and (rank is None or r == rank):
            if how == "raise":
                raise RuntimeError(f"boom on W={layout.world_size} rank {r}")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "sleep":
                time.sleep(60)
            if how == "unreadable":
                return UnreadableTrace(r)
            if how == "silent":
                return SilentTrace()
        return stand_in_tracer(layout, r, model, **options)

    return tracer


def summary_of(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def meeting_tracer(folder: Path, wait_s: float = 10.0):
    """A stand-in whose ranks 0 and 4 each wait until the other has started: they can only both
    finish if they run at the same time."""

    def tracer(layout, rank, model, **options):
        (folder / f"arrived_{rank}").touch()
        other = folder / f"arrived_{4 - rank}"
        deadline = time.monotonic() + wait_s
        while not other.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {4 - rank} never ran beside rank {rank}")
            time.sleep(0.02)
        if rank == 0:
            time.sleep(0.5)  # rank 4 finishes first
        return stand_in_tracer(layout, rank, model, **options)

    return tracer


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def ok_folder(line, index):
    """The folder ``trace --model tiny`` writes a config to: tiny on Megatron-LM's default layers."""
    return cfg(line, index=index, model=TINY_TE).folder_name()
