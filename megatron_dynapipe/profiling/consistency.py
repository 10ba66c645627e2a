"""Whether a profile's times hang together: a part takes no less time on more tokens.

A layer (or the head, or the embedding) run on more sequences, or on longer ones, does at least
the work it did on fewer: its time cannot drop. Where a measured time is well above the time of a
larger shape beside it (the next micro-batch size at the same length, or the next length at the
same micro-batch size), one of the two was mis-measured: the smaller slowed while something else
ran -- another job on the machine, the allocator growing -- or the larger timed too fast. Which one
the pair cannot tell, and the cost model would price either, and every shape interpolated from it,
wrongly; so both are measured again, and a profile where the pair stays so is not written as
complete unless asked (``profile --allow-noisy``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

__all__ = ["TOLERANCE", "SLACK_MS", "inconsistent_points", "noisy_points"]

#: how much slower than a larger shape beside it a point may be measured before it is suspect:
#: twice its time, plus SLACK_MS. Measured profiles do run slower at some smaller shapes (a GPU's
#: small GEMMs pick other kernels: up to 3.1x, 2.5 ms, between neighbours in the shipped H100
#: profiles); a point measured while another job ran is off by far more (33x, 770 ms, seen on a
#: busy 2-core machine)
TOLERANCE = 1.0
SLACK_MS = 2.0


def inconsistent_points(times: Mapping[tuple, float]) -> list[tuple[tuple, str]]:
    """The suspect points of a profile's ``times`` ((tp, recompute, part, phase, seq, mbs) -> ms,
    :class:`~megatron_dynapipe.planning.cost_model.profile_file.ProfileRecords`' keys): each as
    ((tp, recompute, seq, mbs), why, in one line), both points of every pair where the smaller shape
    was measured well above the larger beside it (module docstring), sorted."""
    grids: dict[tuple, dict[tuple[int, int], float]] = defaultdict(dict)
    for (tp, rc, part, phase, seq, mbs), ms in times.items():
        grids[(tp, rc, part, phase)][(seq, mbs)] = ms
    found: dict[tuple, str] = {}
    for (tp, rc, part, phase), grid in grids.items():
        for (seq, mbs), ms in sorted(grid.items()):
            for larger in _larger_neighbours(grid, seq, mbs):
                if ms > grid[larger] * (1 + TOLERANCE) + SLACK_MS:
                    why = (f"{part} {phase} at tp {tp}, recompute {rc}: {ms:.3g} ms at {mbs} x {seq} tokens, above "
                           f"the {grid[larger]:.3g} ms at {larger[1]} x {larger[0]} (one slowed, or the other too fast)")
                    for point in ((seq, mbs), larger):
                        found.setdefault((tp, rc) + point, why)
    return sorted(found.items())


def noisy_points(records) -> list[tuple[tuple, str]]:
    """:func:`inconsistent_points` of a profile's padded and packed layer times
    (:class:`~megatron_dynapipe.planning.cost_model.profile_file.ProfileRecords`)."""
    return inconsistent_points(records.times) + inconsistent_points(records.packed_times)


def _larger_neighbours(grid: Mapping[tuple[int, int], float], seq: int, mbs: int) -> list[tuple[int, int]]:
    """The next larger micro-batch size at this length and the next longer length at this size,
    where measured."""
    more = min((m for s, m in grid if s == seq and m > mbs), default=None)
    longer = min((s for s, m in grid if m == mbs and s > seq), default=None)
    return [p for p in ((seq, more), (longer, mbs)) if None not in p]
