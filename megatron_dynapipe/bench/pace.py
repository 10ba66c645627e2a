"""How fast this machine runs during the steps, against when the profile that prices them was taken.

A profile is the machine's pace at the time it was taken. A shared CPU's pace moves by tens of
percent over minutes (other tenants, clocks): on this project's 2-core CPU the same layer took 14.0
ms in a profile and 16.1 ms ten minutes later, and ``bench step`` runs minutes after its profile.
Its prediction errors then mix the cost model's with the machine's drift. So ``bench step`` times
the profile's own reference point again on every rank after every timed round of the steps -- one
encoder layer, forward and backward, built and timed as the profiler built and timed it (its
repeats; the rank's threads, which the steps run with) -- and reports the median ratio to the
profiled time, and each method's error at that pace: the prediction times the ratio against what
was measured. Nothing is fitted to the steps; the ratio is one more measurement of the profile's,
made beside them: timed before and after the steps instead, the layer ran at 1.02-1.08x while the
steps between ran 1.1-1.3x their price.

The layer is built on the rank, in its own parallel state (torch and megatron-core are imported
there); the rest of this module needs neither.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

from megatron_dynapipe.planning.cost_model import ProfiledCostModel

__all__ = ["Pace", "reference_point", "profiled_ms", "reference_layer", "paced_error_pct", "pace_line"]


@dataclass(frozen=True)
class Pace:
    """The reference layer's time over its profiled time, each time it ran beside the steps."""

    seqlen: int
    mbs: int
    ratios: tuple[float, ...]  # every rank's, every timed round's

    @property
    def ratio(self) -> float:
        """The machine's pace during the steps: the median of the measurements."""
        return statistics.median(self.ratios)


def reference_point(profile, max_seq_length: int) -> "tuple[int, int, object] | None":
    """(seqlen, mbs, recompute) of the ``profile``'s padded encoder point to time again: one row of
    the longest length it measured up to ``max_seq_length`` (what the steps' micro-batches are
    nearest), its first recompute type; None for a model that was not measured (nothing to compare)."""
    if not isinstance(profile, ProfiledCostModel):
        return None
    rc = profile.recompute_types[0]
    fitting = [seq for seq, mbs in profile.measured_points(rc) if mbs == 1 and seq <= max_seq_length]
    return (max(fitting), 1, rc) if fitting else None


def profiled_ms(cost_model, point) -> float:
    """The encoder layer's forward + backward ms at ``point`` in the profile."""
    seq, mbs, rc = point
    return sum(float(cost_model.layer_ms("encoder", phase, rc, mbs, seq)) for phase in ("forward", "backward"))


def reference_layer(spec, point, dtype, device, timing: dict) -> Callable[[], float]:
    """A function timing one encoder layer of ``spec`` at ``point``, forward + backward ms, as the
    profiler times it (``timing``: its warmup, repeats and min_time_ms). Built once, here, in the
    calling rank's megatron parallel state."""
    import torch

    from megatron_dynapipe.profiling.layers import build_parts
    from megatron_dynapipe.profiling.measure import time_step

    seq, mbs, rc = point
    encoder = build_parts(spec, 1, dtype, device, (rc,)).encoders[rc]
    x = torch.randn(seq, mbs, spec.hidden_size, device=device, dtype=dtype, requires_grad=True)

    def layer_ms() -> float:
        timed = time_step(lambda: encoder(x), device, **timing)
        return timed.forward_ms + timed.backward_ms

    return layer_ms


def paced_error_pct(predicted_ms: float, measured_ms: float, pace: Pace) -> float:
    """A prediction's error at the machine's pace during the steps."""
    return (predicted_ms * pace.ratio / measured_ms - 1) * 100


def pace_line(pace: "dict | None", errors: "list[float]") -> "list[str]":
    """The report's line on the pace (``pace`` as :func:`dataclasses.asdict` gives it), with the
    range of the methods' ``errors`` at that pace."""
    if not pace:
        return []
    ratios = pace["ratios"]
    at = (f"; at that pace the predictions are {min(errors):+.0f}% to {max(errors):+.0f}% off" if errors else "")
    return [f"pace: the profile's layer at {pace['mbs']} x {pace['seqlen']} tokens took "
            f"{statistics.median(ratios):.2f}x its profiled time beside the steps ({min(ratios):.2f}-"
            f"{max(ratios):.2f}x, {len(ratios)} times on the ranks; a CPU's pace moves with its load){at}"]
