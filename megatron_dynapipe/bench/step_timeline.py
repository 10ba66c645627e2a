"""Where a benchmarked step's time went (``bench step --chrome-trace FILE``).

After its timed steps each method runs one more step with every instruction timed on every rank
(:func:`record`, the executor's ``ExecutorOptions.timeline``). A rank's step splits into compute
(FORWARD and BACKWARD), waiting (the FINISHes of transfers: a bubble, or a peer that ran late) and
the rest (starting transfers, loading inputs, freeing buffers, the executor between
instructions). The report gives each rank's split (:func:`breakdown`) beside what the cost model
prices that rank's compute ops at (:func:`op_prices`, summed): a step measured above its
prediction with its compute near that price was held up by waits; one whose compute ran over was
priced low. The Chrome trace (:func:`chrome_trace`) shows every rank's instructions on one time
axis, a process per method and rank, each compute op with its price (:func:`op_prices`) beside it.
"""

from __future__ import annotations

from typing import Callable

from megatron_dynapipe.chrome_trace import ChromeTrace
from megatron_dynapipe.planning.plan import Op
from megatron_dynapipe.planning.simulator import WorkTable
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["record", "breakdown", "op_prices", "chrome_trace"]


def record(run: Callable[[], object], before: Callable[[], None]) -> list:
    """One more run of ``run`` (after ``before``) with its instructions timed: the executor's
    :class:`~megatron_dynapipe.runtime.executor.TimedInstruction` list, picklable for the parent."""
    from megatron_dynapipe.runtime.provider import recording_timeline

    before()
    with recording_timeline() as timeline:
        run()
    return timeline


def breakdown(timeline: list) -> dict[str, float]:
    """One rank's step in ms, from its first instruction's start to its last one's end: the time
    in compute, in waits (FINISHes), and the rest (the other instructions and the executor between
    them)."""
    if not timeline:
        return {"step_ms": 0.0, "compute_ms": 0.0, "waiting_ms": 0.0, "other_ms": 0.0}
    step_ms = (max(t.end for t in timeline) - min(t.start for t in timeline)) * 1e3
    compute_ms = sum(t.end - t.start for t in timeline if t.instruction.op.is_compute) * 1e3
    waiting_ms = sum(t.end - t.start for t in timeline if t.instruction.op.is_finish) * 1e3
    return {"step_ms": step_ms, "compute_ms": compute_ms, "waiting_ms": waiting_ms,
            "other_ms": step_ms - compute_ms - waiting_ms}


def op_prices(plan, costs, stage: int) -> dict[tuple, float]:
    """What the planner prices each compute op of ``stage``'s ``plan`` at, in ms, by (op, micro-batch,
    chunk): its price in the cost model's table of the plan's micro-batches (``costs`` per virtual
    stage, chunk c of stage s being c * pp + s; packed micro-batches at the packed rows' prices)."""
    if any(mb.packed_lengths for mb in plan.microbatches):
        costs = costs.packed()
    tables = WorkTable(costs, plan.microbatches, plan.chunks).tables
    pp, kinds = costs.pp // plan.chunks, list(RecomputeType)
    return {(ins.op, ins.microbatch, ins.chunk): float(tables["forward" if ins.op == Op.FORWARD else "backward"][
        kinds.index(ins.recompute), ins.chunk * pp + stage, ins.microbatch])
        for ins in plan.instructions if ins.op.is_compute}


def chrome_trace(timelines: dict[str, list[tuple[str, list]]], prices: "dict[str, list[dict]] | None" = None,
                 **other_data) -> ChromeTrace:
    """``timelines``: per method, (rank's name, its :func:`record`) for every rank. Each method's
    ranks share a time axis that starts at its earliest instruction (local ranks read one clock).
    ``prices``: per method, each rank's :func:`op_prices`, shown as each compute op's ``priced_ms``."""
    trace = ChromeTrace(**other_data)
    pid = 0
    for method, ranks in timelines.items():
        origin = min((timeline[0].start for _, timeline in ranks if timeline), default=0.0)
        for k, (rank_name, timeline) in enumerate(ranks):
            priced = prices[method][k] if prices else {}
            trace.process(pid, f"{method}: {rank_name}")
            for row in ("compute", "waiting"):
                trace.row(pid, row)
            for t in timeline:
                ins = t.instruction
                if not (ins.op.is_compute or ins.op.is_finish):
                    continue
                name = (f"{ins.op.name[0] if ins.op.is_compute else ins.op.name.lower()} {ins.microbatch}"
                        + (f" chunk {ins.chunk}" if ins.chunk else ""))
                trace.span(pid, "compute" if ins.op.is_compute else "waiting", name, cat=ins.op.name,
                           start_us=(t.start - origin) * 1e6, dur_us=(t.end - t.start) * 1e6,
                           args={"microbatch": ins.microbatch, "chunk": ins.chunk, "recompute": ins.recompute.label}
                           | _priced(priced.get((ins.op, ins.microbatch, ins.chunk))))
            pid += 1
    return trace


def _priced(ms: "float | None") -> dict:
    return {} if ms is None else {"priced_ms": round(ms, 3)}
