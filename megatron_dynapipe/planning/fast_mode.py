"""Fast mode: a trimmed search for planning at scale (README "Fast mode"), and how a job
switches it on.  A *setting* is True, False, ``"auto"`` (fast above 16 samples) or None (the
``DYNAPIPE_FAST_MODE`` environment variable, else off); :meth:`SearchBudget.of` turns one into
the decision for a batch, and the budget names every cut fast mode makes in the search."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Union

from megatron_dynapipe.planning.microbatching import DP_THRESHOLDS
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["FastMode", "FAST_MODE_ENV", "SearchBudget", "NORMAL", "FAST", "parse_fast_mode", "fast_mode_from_env",
           "resolve_fast_mode_setting", "resolve_fast_mode"]

FAST_MODE_ENV = "DYNAPIPE_FAST_MODE"
AUTO_FAST_MODE_MIN_SAMPLES = 17  # "auto": fast when the global batch has more than 16 samples
# The three words the flags show ({true,false,auto}) and nothing else, so that every accepted
# value is one the help names; an empty variable counts as unset.
_TRUE = {"true"}
_FALSE = {"false", ""}

FastMode = Union[bool, str, None]  # True / False / "auto" / None (= environment, else off)

# What fast mode trims, by how much (read when used: tests lower them)
FAST_MODE_DP_THRESHOLDS = 8  # caps on the largest micro-batch time the fast partition tries (normal: DP_THRESHOLDS)
FAST_MODE_GAP = 0.02  # fast mode skips candidates that could beat the best found by at most 2%
BOUND_SLACK = 1e-9  # relative: a bound summed in another order may exceed an equal makespan by rounding
FAST_MODE_ROUNDS = 3  # rounds of recompute adjustment fast mode runs at most


def parse_fast_mode(text: str) -> "bool | str":
    """"true" -> True, "false" -> False, "auto" -> "auto" (any case); else ValueError."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    if value == "auto":
        return "auto"
    raise ValueError(f"{text!r} is not a fast mode: use true, false or auto")


def fast_mode_from_env(environ: Mapping[str, str] = os.environ) -> "bool | str | None":
    """`DYNAPIPE_FAST_MODE` as True/False/"auto", or None when unset."""
    raw = environ.get(FAST_MODE_ENV)
    if raw is None:
        return None
    try:
        return parse_fast_mode(raw)
    except ValueError:
        raise ValueError(f"{FAST_MODE_ENV}={raw!r} is not understood: use true, false or auto") from None


def resolve_fast_mode_setting(fast_mode: FastMode) -> "bool | str":
    """A job's setting at the edge where its settings are read: an explicit True/False/"auto"
    as given, None from `DYNAPIPE_FAST_MODE`, else off. Whatever plans later gets this value."""
    return _setting(fast_mode_from_env() if fast_mode is None else fast_mode)


def _setting(value: FastMode) -> "bool | str":
    """True, False or "auto" of a setting given (a word is parsed; None is off)."""
    return parse_fast_mode(value) if isinstance(value, str) else bool(value)


def resolve_fast_mode(fast_mode: FastMode, num_samples: int) -> bool:
    """Whether a batch of ``num_samples`` is planned in fast mode under this setting (None: the
    environment's): :meth:`SearchBudget.of`'s decision."""
    return SearchBudget.of(fast_mode, None, num_samples).fast


@dataclass(frozen=True)
class SearchBudget:
    """How far the plan of one global batch searches, decided once (:meth:`of`) and read wherever
    the search can be cut: normal mode explores all of it, fast mode makes each cut below.

    ``setting`` is what was asked (True, False or "auto") and ``source`` where it came from:
    ``"call"`` (generate_execution_plan's argument), ``"TrainingSpec"``, ``DYNAPIPE_FAST_MODE`` or
    ``"default"`` (off)."""

    fast: bool = False
    setting: "bool | str" = False
    source: str = "default"

    @classmethod
    def of(cls, call: FastMode, spec: FastMode, num_samples: int) -> "SearchBudget":
        """The budget of a batch of ``num_samples``: the first setting given of ``call``, ``spec``
        and the environment; "auto" fast above 16 samples (planning time grows with them)."""
        if call is not None:
            value, source = call, "call"
        elif spec is not None:
            value, source = spec, "TrainingSpec"
        else:
            value = fast_mode_from_env()
            source = "default" if value is None else FAST_MODE_ENV
        setting = _setting(value)
        return cls(num_samples >= AUTO_FAST_MODE_MIN_SAMPLES if setting == "auto" else setting, setting, source)

    # -- micro-batching
    @property
    def dp_thresholds(self) -> int:
        """Candidate caps on the largest micro-batch time partition_dp tries."""
        return FAST_MODE_DP_THRESHOLDS if self.fast else DP_THRESHOLDS

    @property
    def trims_cost_tables(self) -> bool:
        """partition_dp costs only micro-batches that can occur, long runs at fewer sizes, each under
        the lightest recompute that fits (normal: every size, the cheapest recompute)."""
        return self.fast

    def every_partition(self, packed: bool) -> bool:
        """A partition per uniform recompute type, and on an interleaved pipeline one sized for each
        fill (fast: the mixed and the heaviest uniform one, sized for 1F1B's fill). Padded plans
        keep them in fast mode too: without them 5 of 24 13B batches at 4K (256 H100s, PP 2 x 4 and
        4 x 2) planned 2.1-2.8% longer than normal mode, with them at most 1.8%, in 0.08-1.01 s a
        batch on one core (0.07-0.34 s before). Packed plans, whose partitions cost several times
        more, make the cut."""
        return not (self.fast and packed)

    @property
    def every_microbatching(self) -> bool:
        """Besides a light start, each partition as sized (fast: the light start alone)."""
        return not self.fast

    @property
    def first_tries(self) -> bool:
        """Every rank's mixed micro-batching is scheduled alone first, slowest rank first."""
        return self.fast

    # -- scheduling
    @property
    def enough_at_the_slowest_rank(self) -> bool:
        """A rank's search stops at the first plan no longer than a rank planned before it."""
        return self.fast

    @property
    def narrows_schedules(self) -> bool:
        """One schedule a micro-batching (:func:`~.schedules.fast_mode_schedules`), not every one allowed."""
        return self.fast

    @property
    def candidate_gap(self) -> float:
        """Relative: candidates whose bound is within this of the best found are skipped."""
        return FAST_MODE_GAP if self.fast else -BOUND_SLACK

    def recompute_rounds(self, stages: int, microbatches: int) -> int:
        """Rounds of recompute adjustment (normal: enough to raise every op to full)."""
        return FAST_MODE_ROUNDS if self.fast else stages * microbatches * len(RecomputeType)

    @property
    def cuts_hopeless_simulations(self) -> bool:
        """Recompute adjustment stops simulating a candidate once it cannot end in time."""
        return self.fast


NORMAL, FAST = SearchBudget(False, False, "call"), SearchBudget(True, True, "call")
