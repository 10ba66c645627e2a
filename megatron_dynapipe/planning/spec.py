"""What one training job asks of the planner, and how fast mode is switched on."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Mapping, Union

from .types import RecomputeType

FAST_MODE_ENV = "DYNAPIPE_FAST_MODE"
AUTO_FAST_MODE_MIN_SAMPLES = 17  # "auto": fast when the global batch has more than 16 samples
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

FastMode = Union[bool, str, None]  # True / False / "auto" / None (= environment, else off)


def parse_fast_mode(text: str) -> "bool | str":
    """"true|1|yes|on" -> True, "false|0|no|off" -> False, "auto" -> "auto"; else ValueError."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    if value == "auto":
        return "auto"
    raise ValueError(f"{text!r} is not a fast mode: use true, false or auto")


def fast_mode_argument(text: str) -> "bool | str":
    """argparse ``type`` of every fast-mode flag (``plan --fast-mode``, ``--dynapipe-fast-mode``)."""
    try:
        return parse_fast_mode(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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
    if fast_mode is None:
        fast_mode = fast_mode_from_env()
    if isinstance(fast_mode, str):
        return parse_fast_mode(fast_mode)
    return bool(fast_mode)


def resolve_fast_mode(fast_mode: FastMode, num_samples: int) -> bool:
    """The one place that turns a fast-mode setting into a decision for one global batch.

    An explicit True/False wins; None falls back to the environment and then to off;
    "auto" is fast when the batch has more than 16 samples (planning time grows with it).
    """
    if fast_mode is None:
        fast_mode = fast_mode_from_env()
    if isinstance(fast_mode, str):
        if fast_mode.strip().lower() != "auto":
            raise ValueError(f"fast_mode={fast_mode!r} is not understood: use True, False or 'auto'")
        return num_samples >= AUTO_FAST_MODE_MIN_SAMPLES
    return bool(fast_mode)


SCHEDULES = ("1f1b", "wait-free-cyclic")
PARTITION_METHODS = ("dp", "token_based", "uniform")


@dataclass
class TrainingSpec:
    """Parallel layout, memory budget and search settings of one training job."""

    num_layers: int = 32
    pp: int = 4
    tp: int = 1
    dp: int = 1
    zero_stage: int = 0
    memory_limit_mb: float = 36_000.0
    fast_mode: FastMode = None
    schedules: tuple[str, ...] = SCHEDULES
    recompute_types: tuple[RecomputeType, ...] = tuple(RecomputeType)
    partition: str = "dp"  # micro-batching: dynamic programming, token_based or uniform
    seqlen_round: int = 8  # sequence lengths are padded to a multiple of this
    tokens_per_microbatch: int = 8192  # for partition="token_based"
    microbatch_size: int = 8  # for partition="uniform"
    max_permutations: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "pp", "tp", "dp", "seqlen_round", "max_permutations"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TrainingSpec.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_layers < self.pp:
            raise ValueError(
                f"{self.num_layers} layers cannot fill {self.pp} pipeline stages: lower pp or raise num_layers"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if not 0 < self.memory_limit_mb < float("inf"):  # also refuses nan
            raise ValueError(f"memory_limit_mb must be a positive number of MB, got {self.memory_limit_mb!r}")
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if unknown or not self.schedules:
            raise ValueError(f"unknown schedule(s) {unknown or '(none)'}: choose from {', '.join(SCHEDULES)}")
        if self.partition not in PARTITION_METHODS:
            raise ValueError(
                f"unknown partition method {self.partition!r}: choose from {', '.join(PARTITION_METHODS)}"
            )
        self.recompute_types = tuple(RecomputeType.parse(r) for r in self.recompute_types)
