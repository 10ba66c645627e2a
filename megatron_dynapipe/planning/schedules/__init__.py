"""Pipeline schedules, by name: the contract (:mod:`.base`) and the registry.

A new schedule is one module here defining a :class:`Schedule` (or, when its orders depend on
``pp`` and ``n`` alone, a :class:`FixedSchedule`) and one entry in :data:`SCHEDULES`
(docs/schedules.md walks through one).
"""

from __future__ import annotations

from megatron_dynapipe.planning.schedules.base import FixedSchedule, Schedule, check_chunks
from megatron_dynapipe.planning.schedules.gpipe import GPipe
from megatron_dynapipe.planning.schedules.interleaved import Interleaved1F1B
from megatron_dynapipe.planning.schedules.one_f_one_b import OneFOneB
from megatron_dynapipe.planning.schedules.wait_free_cyclic import WaitFreeCyclic
from megatron_dynapipe.planning.simulator import Order

__all__ = ["SCHEDULES", "DEFAULT_SCHEDULES", "Schedule", "FixedSchedule", "check_chunks", "default_schedules",
           "get_schedule", "fast_mode_schedule", "fast_mode_schedules", "megatron_orders", "megatron_schedule",
           "one_f_one_b_orders"]

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (OneFOneB(), WaitFreeCyclic(), GPipe(), Interleaved1F1B())}
#: what the planner searches unless told otherwise (one model chunk a rank)
DEFAULT_SCHEDULES: tuple[str, ...] = tuple(name for name, s in SCHEDULES.items()
                                           if s.searched_by_default and not s.interleaved)


def default_schedules(chunks: int = 1) -> tuple[str, ...]:
    """What the planner searches unless told otherwise, for ranks of ``chunks`` model chunks."""
    return DEFAULT_SCHEDULES if chunks == 1 else tuple(name for name, s in SCHEDULES.items() if s.interleaved)


def get_schedule(schedule: "str | Schedule") -> Schedule:
    """The registered schedule of that name (a Schedule is returned as is)."""
    if isinstance(schedule, Schedule):
        return schedule
    try:
        return SCHEDULES[schedule]
    except KeyError:
        raise ValueError(f"unknown schedule {schedule!r}: choose from {', '.join(SCHEDULES)}") from None


def fast_mode_schedule(allowed: "tuple[str, ...] | list[str]") -> str:
    """The one schedule fast mode searches among ``allowed``: the first whose orders follow the
    simulated timeline (it adapts to each batch's costs as fixed orders cannot), else the first."""
    return next((name for name in allowed if not isinstance(get_schedule(name), FixedSchedule)), allowed[0])


def fast_mode_schedules(allowed: "tuple[str, ...] | list[str]", microbatches: int, pp: int) -> list[str]:
    """What fast mode searches for ``microbatches`` on ``pp`` stages: :func:`fast_mode_schedule`,
    and where so few micro-batches never fill the pipeline (fewer than ``FILLS_PIPELINE`` x pp),
    also the first allowed fixed-order one: there the greedy timeline has no steady state to adapt
    to, and 1F1B's plain alternation was up to 3% faster (175B, PP 16, about 10 a rank)."""
    first = fast_mode_schedule(allowed)
    fixed = next((name for name in allowed if isinstance(get_schedule(name), FixedSchedule)), None)
    return [first] + ([fixed] if fixed not in (None, first) and microbatches < FILLS_PIPELINE * pp else [])


#: fast mode adds a fixed-order schedule below this many micro-batches per stage (:func:`fast_mode_schedules`)
FILLS_PIPELINE = 2


def one_f_one_b_orders(pp: int, n: int) -> list[Order]:
    """1F1B's per-stage orders of ``n`` micro-batches on ``pp`` stages."""
    return SCHEDULES["1f1b"].orders_for(pp, n)


def megatron_schedule(chunks: int = 1) -> str:
    """The name of Megatron's own schedule for ranks of ``chunks`` model chunks: 1F1B, interleaved
    where there are several."""
    return "interleaved-1f1b" if chunks > 1 else "1f1b"


def megatron_orders(pp: int, n: int, chunks: int = 1) -> list[Order]:
    """The per-rank orders of Megatron's own schedule (:func:`megatron_schedule`) of ``n``
    micro-batches on ``pp`` ranks of ``chunks`` model chunks."""
    return SCHEDULES[megatron_schedule(chunks)].orders_for(pp, n, chunks)
