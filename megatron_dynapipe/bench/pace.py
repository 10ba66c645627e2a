"""How fast this machine runs during the steps, against when the profile that prices them was taken.

A profile is the machine's pace at the time it was taken. A shared CPU's pace moves by tens of
percent over minutes (other tenants, clocks): on this project's 2-core CPU the same layer took 14.0
ms in a profile and 16.1 ms ten minutes later, and ``bench step`` runs minutes after its profile.
Its prediction errors then mix the cost model's with the machine's drift. So ``bench step`` times
the profile's own reference points again on every rank after every timed round of the steps -- one
encoder layer, forward and backward, on 1, 2 and 4 rows of the longest length the profile measured
and the steps reach, built and timed as the profiler built and timed it (its repeats; the rank's
threads, which the steps run with) -- and reports the median ratio to the profiled times, and each
method's error at that pace: the prediction times the ratio against what was measured. Nothing is
fitted to the steps; the ratio is more measurements of the profile's points, made beside the steps
(timed before and after the steps instead, the layer ran at 1.02-1.08x while the steps between ran
1.1-1.3x their price), and of several points, each of which the profile measured at its own
moment (one row of 256 tokens alone put the pace at 0.70x in a round whose steps ran 0.85-0.96x
their price). It says how far the machine moved, not how to correct a step: at 256 positions the
points ran 0.8-0.95x their profiled times in rounds whose steps ran at their price.

The layer is built on the rank, in its own parallel state (torch and megatron-core are imported
there); the rest of this module needs neither.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

from megatron_dynapipe.planning.cost_model import ProfiledCostModel

__all__ = ["Pace", "reference_points", "profiled_ms", "reference_layer", "paced_error_pct", "pace_line"]

#: the rows of the longest length timed again, as many of them as the profile measured
REFERENCE_ROWS = (1, 2, 4)


@dataclass(frozen=True)
class Pace:
    """The reference points' times over their profiled times, each time they ran beside the steps."""

    seqlen: int
    rows: tuple[int, ...]
    ratios: tuple[float, ...]  # every rank's, every timed round's, every point's

    @property
    def ratio(self) -> float:
        """The machine's pace during the steps: the median of the measurements."""
        return statistics.median(self.ratios)


def reference_points(profile, max_seq_length: int) -> "list[tuple[int, int, object]]":
    """(seqlen, mbs, recompute) of the ``profile``'s padded encoder points to time again: up to
    :data:`REFERENCE_ROWS` rows of the longest length it measured up to ``max_seq_length`` (what the
    steps' micro-batches are nearest), its first recompute type; none for a model that was not
    measured (nothing to compare)."""
    if not isinstance(profile, ProfiledCostModel):
        return []
    rc = profile.recompute_types[0]
    measured = profile.measured_points(rc)
    fitting = [seq for seq, mbs in measured if mbs == 1 and seq <= max_seq_length]
    if not fitting:
        return []
    longest = max(fitting)
    return [(longest, mbs, rc) for mbs in REFERENCE_ROWS if (longest, mbs) in measured]


def profiled_ms(cost_model, point) -> float:
    """The encoder layer's forward + backward ms at ``point`` in the profile."""
    seq, mbs, rc = point
    return sum(float(cost_model.layer_ms("encoder", phase, rc, mbs, seq)) for phase in ("forward", "backward"))


def reference_layer(spec, points, dtype, device, timing: dict) -> Callable[[], list[float]]:
    """A function timing one encoder layer of ``spec`` at each of ``points`` (of one recompute),
    forward + backward ms, as the profiler times it (``timing``: its warmup, repeats and
    min_time_ms). Built once, here, in the calling rank's megatron parallel state."""
    import torch

    from megatron_dynapipe.profiling.layers import build_parts
    from megatron_dynapipe.profiling.measure import time_step

    rc = points[0][2]
    encoder = build_parts(spec, 1, dtype, device, (rc,)).encoders[rc]
    inputs = [torch.randn(seq, mbs, spec.hidden_size, device=device, dtype=dtype, requires_grad=True)
              for seq, mbs, _ in points]

    def layer_ms() -> list[float]:
        timed = [time_step(lambda x=x: encoder(x), device, **timing) for x in inputs]
        return [t.forward_ms + t.backward_ms for t in timed]

    return layer_ms


def paced_error_pct(predicted_ms: float, measured_ms: float, pace: Pace) -> float:
    """A prediction's error at the machine's pace during the steps."""
    return (predicted_ms * pace.ratio / measured_ms - 1) * 100


def pace_line(pace: "dict | None", errors: "list[float]") -> "list[str]":
    """The report's line on the pace (``pace`` as :func:`dataclasses.asdict` gives it), with the
    range of the methods' ``errors`` at that pace."""
    if not pace:
        return []
    pace = Pace(**pace)
    rows, ratios = pace.rows, pace.ratios
    counts = ", ".join(map(str, rows[:-1])) + (" and " if len(rows) > 1 else "") + str(rows[-1])
    at = (f"; at that pace the predictions are {min(errors):+.0f}% to {max(errors):+.0f}% off" if errors else "")
    return [f"pace: the profile's layer on {counts} x {pace.seqlen} tokens took {pace.ratio:.2f}x its profiled "
            f"time beside the steps ({min(ratios):.2f}-{max(ratios):.2f}x, {len(ratios)} timings on the ranks; a "
            f"CPU's pace moves with its load){at}"]
