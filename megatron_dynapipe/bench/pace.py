"""How fast this machine runs now, against when the profile that prices the run was measured.

A profile is the machine's pace at the time it was taken. A shared CPU's pace moves by tens of
percent over minutes (other tenants, clocks): on this project's 2-core CPU the same layer took 14.0
ms in a profile and 16.1 ms ten minutes later, and ``bench step`` runs minutes after its profile.
Its prediction errors then mix the cost model's with the machine's drift. So before and after the
steps, ``bench step`` times the profile's own reference point again -- one encoder layer, forward
and backward, as the profiler timed it (same threads, same repeats) -- and reports the ratio to the
profiled time, and each method's error at that pace: the prediction times the ratio against what
was measured. Nothing is fitted to the steps; the ratio is one more measurement of the profile's.

Imports torch and megatron-core (the layer); the rest of ``bench step`` does not need them here.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dynapipe.planning.cost_model import ProfiledCostModel

__all__ = ["Pace", "reference_point", "measure_pace", "paced_error_pct", "pace_line"]


@dataclass(frozen=True)
class Pace:
    """The reference layer's time now over its profiled time, before the steps and after them."""

    seqlen: int
    mbs: int
    before: float
    after: float

    @property
    def ratio(self) -> float:
        """The machine's pace during the steps: the mean of the two measurements."""
        return (self.before + self.after) / 2


def reference_point(profile, max_seq_length: int) -> "tuple[int, int, object] | None":
    """(seqlen, mbs, recompute) of the ``profile``'s padded encoder point to time again: one row of
    the longest length it measured up to ``max_seq_length`` (what the steps' micro-batches are
    nearest), its first recompute type; None for a model that was not measured (nothing to compare)."""
    if not isinstance(profile, ProfiledCostModel):
        return None
    rc = profile.recompute_types[0]
    fitting = [seq for seq, mbs in profile.measured_points(rc) if mbs == 1 and seq <= max_seq_length]
    return (max(fitting), 1, rc) if fitting else None


def measure_pace(spec, cost_model, point, dtype, device, timing: dict, threads: "int | None", time_layer=None):
    """Time the layer at ``point`` now (``time_layer(spec, point, dtype, device, timing, threads)``:
    its forward + backward ms; by default :func:`_layer_ms`), over the profile's time there."""
    seq, mbs, rc = point
    profiled = sum(float(cost_model.layer_ms("encoder", phase, rc, mbs, seq)) for phase in ("forward", "backward"))
    return (time_layer or _layer_ms)(spec, point, dtype, device, timing, threads) / profiled


def _layer_ms(spec, point, dtype, device, timing: dict, threads: "int | None") -> float:
    """One encoder layer's forward + backward ms at ``point``, built and timed as the profiler does."""
    import torch

    from megatron_dynapipe.profiling.layers import build_parts, fake_tp_rank
    from megatron_dynapipe.profiling.measure import time_step

    seq, mbs, rc = point
    kept = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with fake_tp_rank(1, device):
            encoder = build_parts(spec, 1, dtype, device, (rc,)).encoders[rc]
            x = torch.randn(seq, mbs, spec.hidden_size, device=device, dtype=dtype, requires_grad=True)
            timed = time_step(lambda: encoder(x), device, **timing)
    finally:
        torch.set_num_threads(kept)
    return timed.forward_ms + timed.backward_ms


def paced_error_pct(predicted_ms: float, measured_ms: float, pace: Pace) -> float:
    """A prediction's error at the machine's pace during the steps."""
    return (predicted_ms * pace.ratio / measured_ms - 1) * 100


def pace_line(pace: "dict | None", errors: "list[float]") -> "list[str]":
    """The report's line on the pace (``pace`` as :func:`dataclasses.asdict` gives it), with the
    range of the methods' ``errors`` at that pace."""
    if not pace:
        return []
    at = (f"; at that pace the predictions are {min(errors):+.0f}% to {max(errors):+.0f}% off" if errors else "")
    return [f"pace: the profile's layer at {pace['mbs']} x {pace['seqlen']} tokens took {pace['before']:.2f}x its "
            f"profiled time before the steps and {pace['after']:.2f}x after (a CPU's pace moves with its load){at}"]
