"""What one training job asks of the planner, and how fast mode is switched on."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Mapping, Union

from megatron_dynapipe.planning.types import RecomputeType

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


# --------------------------------------------------------------------------------------------
# the planner's search settings as command-line flags, the same on every surface


def positive_int_argument(text: str) -> int:
    """argparse ``type`` of a count that must be at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def recompute_argument(text: str) -> RecomputeType:
    """argparse ``type`` of a recompute choice (none, selective, full)."""
    try:
        return RecomputeType.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_planner_arguments(group, prefix: str = "") -> None:
    """Add the planner's search settings to an argparse parser or group: ``--{prefix}fast-mode``,
    ``cost-model``, ``schedule``, ``partition``, ``recompute``, ``seed``, ``seqlen-round``,
    ``max-permutations`` and ``tokens-per-microbatch``.  ``megatron-dynapipe plan`` adds them bare,
    a Megatron job with ``prefix="dynapipe-"``; :func:`planner_settings` reads them back."""
    d = TrainingSpec

    def add(name: str, **kwargs) -> None:
        group.add_argument(f"--{prefix}{name}", **kwargs)

    add("fast-mode", nargs="?", const=True, default=None, type=fast_mode_argument, metavar="{true,false,auto}",
        help=f"trim the planner's search (bare flag: true; auto: fast above {AUTO_FAST_MODE_MIN_SAMPLES - 1} "
             f"samples); without the flag {FAST_MODE_ENV} applies, else off")
    add("cost-model", default=None, metavar="NAME|FILE",
        help="profiled cost model: a JSON file (docs/cost_model.md) or a shipped profile's name, e.g. "
             "gpt-6.7b-a100 (default: the analytical GPT cost model)")
    add("schedule", nargs="+", choices=SCHEDULES, default=list(d.schedules), metavar="NAME",
        help=f"schedules the planner may choose from: {', '.join(SCHEDULES)} (default: all)")
    add("partition", choices=PARTITION_METHODS, default=d.partition,
        help="micro-batching: dynamic programming (dp, default), token_based or uniform")
    add("recompute", nargs="+", type=recompute_argument, default=list(d.recompute_types),
        metavar="{none,selective,full}", help="recompute choices the planner may give a micro-batch (default: all)")
    add("seed", type=int, default=d.seed, help=f"seed of the micro-batch order search (default {d.seed})")
    add("seqlen-round", type=positive_int_argument, default=d.seqlen_round, metavar="N",
        help=f"pad each micro-batch's sequence length to a multiple of N (default {d.seqlen_round})")
    add("max-permutations", type=positive_int_argument, default=d.max_permutations, metavar="N",
        help=f"micro-batch orders the planner tries per candidate (default {d.max_permutations})")
    add("tokens-per-microbatch", type=positive_int_argument, default=d.tokens_per_microbatch, metavar="N",
        help=f"token budget of a micro-batch with --{prefix}partition token_based (default {d.tokens_per_microbatch})")


def planner_settings(args: argparse.Namespace, prefix: str = "") -> dict:
    """The :class:`TrainingSpec` search fields from flags added by :func:`add_planner_arguments`
    (a flag missing from ``args`` keeps the field's default)."""
    def get(name: str, default):
        value = getattr(args, (prefix + name).replace("-", "_"), None)
        return default if value is None else value

    d = TrainingSpec
    return dict(
        fast_mode=get("fast-mode", None),
        schedules=tuple(get("schedule", d.schedules)),
        recompute_types=tuple(get("recompute", d.recompute_types)),
        partition=get("partition", d.partition),
        seed=get("seed", d.seed),
        seqlen_round=get("seqlen-round", d.seqlen_round),
        max_permutations=get("max-permutations", d.max_permutations),
        tokens_per_microbatch=get("tokens-per-microbatch", d.tokens_per_microbatch),
    )

