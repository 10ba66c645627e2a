"""The planner's search settings as command-line flags, the same on every surface:
``megatron-dynapipe plan`` adds them bare, a Megatron job with the ``--dynapipe-`` prefix."""

from __future__ import annotations

import argparse
from typing import Callable

from megatron_dynapipe.planning.fast_mode import AUTO_FAST_MODE_MIN_SAMPLES, FAST_MODE_ENV, parse_fast_mode
from megatron_dynapipe.planning.documents import DOCUMENTS
from megatron_dynapipe.planning.spec import PACKINGS, PARTITION_METHODS, SCHEDULES, TrainingSpec, seqlen_round_for
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["ListAction", "add_fast_mode_argument", "argument_type", "positive_int_argument", "positive_number_argument",
           "seed_argument", "recompute_argument", "fast_mode_argument", "add_planner_arguments", "planner_settings"]


def argument_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` as an argparse ``type``: its ValueError becomes argparse's one-line message."""
    def parsed(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parsed.__name__ = getattr(parse, "__name__", "value")
    return parsed


def _integer(text: str, least: int, below: str) -> int:
    """``text`` as an integer of at least ``least``; else ValueError (``below``: what is wrong)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None
    if value < least:
        raise ValueError(f"{value} {below}")
    return value


def _positive_int(text: str) -> int:
    return _integer(text, 1, "must be a positive integer")


def _seed(text: str) -> int:
    return _integer(text, 0, "is not a seed: give an integer >= 0")


#: argparse ``type`` of a count that must be at least 1
positive_int_argument = argument_type(_positive_int)
#: argparse ``type`` of a random seed: an integer >= 0, as numpy's generators take
seed_argument = argument_type(_seed)


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise ValueError(f"{value:g} must be a positive number")
    return value


#: argparse ``type`` of an amount (MB, seconds) that must be above 0 and finite
positive_number_argument = argument_type(_positive_number)


class ListAction(argparse.Action):
    """A list flag written either way: ``--tp 1 2 4``, ``--tp 1,2,4`` or a mix. ``type`` parses each
    item; the flag's value is the tuple of them in order, duplicates dropped."""

    def __init__(self, option_strings, dest, type=None, **kwargs):
        kwargs.setdefault("nargs", "+")
        super().__init__(option_strings, dest, **kwargs)
        self.item_type = type or str

    def __call__(self, parser, namespace, values, option_string=None):
        items = []
        for value in values:
            for text in (v.strip() for v in value.split(",")):
                if not text:
                    continue
                try:
                    items.append(self.item_type(text))
                except (ValueError, argparse.ArgumentTypeError) as error:
                    parser.error(f"argument {option_string}: {error}")
        if not items:
            parser.error(f"argument {option_string}: give at least one value")
        setattr(namespace, self.dest, tuple(dict.fromkeys(items)))


#: argparse ``type`` of a recompute choice (none, selective, full)
recompute_argument = argument_type(RecomputeType.parse)
#: argparse ``type`` of every fast-mode flag (``plan --fast-mode``, ``--dynapipe-fast-mode``)
fast_mode_argument = argument_type(parse_fast_mode)


def add_fast_mode_argument(group, flag: str = "--fast-mode") -> None:
    """The one fast-mode flag (``plan``, ``search``, ``simulate``, ``trace``, a job's
    ``--dynapipe-fast-mode``): true, false or auto; bare, true; absent (None), the environment's."""
    group.add_argument(flag, nargs="?", const=True, default=None, type=fast_mode_argument,
                       metavar="{true,false,auto}",
                       help=f"trim the planner's search (bare flag: true; auto: fast above "
                            f"{AUTO_FAST_MODE_MIN_SAMPLES - 1} samples); without the flag {FAST_MODE_ENV} applies, "
                            "else off")


def add_planner_arguments(group, prefix: str = "") -> None:
    """Add the planner's search settings to an argparse parser or group: ``--{prefix}fast-mode``,
    ``cost-model``, ``schedule``, ``partition``, ``recompute``, ``seed``, ``seqlen-round``,
    ``max-permutations``, ``tokens-per-microbatch``, ``packing`` and ``documents``.  ``megatron-dynapipe plan`` adds them bare,
    a Megatron job with ``prefix="dynapipe-"``; :func:`planner_settings` reads them back."""
    d = TrainingSpec

    def add(name: str, **kwargs) -> None:
        group.add_argument(f"--{prefix}{name}", **kwargs)

    add_fast_mode_argument(group, f"--{prefix}fast-mode")
    add("cost-model", default=None, metavar="NAME|FILE",
        help="profiled cost model: a JSON file (docs/cost_model.md) or a shipped profile's name, e.g. "
             "gpt-6.7b-a100 (default: the analytical GPT cost model)")
    add("schedule", nargs="+", choices=SCHEDULES, default=list(d.schedules), metavar="NAME",
        help=f"schedules the planner may choose from: {', '.join(SCHEDULES)} (default: {' '.join(d.schedules)})")
    add("partition", choices=PARTITION_METHODS, default=d.partition,
        help="micro-batching: dynamic programming (dp, default), token_based or uniform")
    add("recompute", action=ListAction, type=recompute_argument, default=list(d.recompute_types),
        metavar="{none,selective,full}", help="recompute choices the planner may give a micro-batch (default: all)")
    add("seed", type=seed_argument, default=d.seed, help=f"seed of the micro-batch order search (default {d.seed})")
    add("seqlen-round", type=positive_int_argument, default=None, metavar="N",
        help=f"pad each micro-batch's sequence length to a multiple of N (default {d.seqlen_round}, made a multiple "
             "of 2 x the context-parallel size, as each row splits into that many chunks)")
    add("max-permutations", type=positive_int_argument, default=d.max_permutations, metavar="N",
        help=f"most micro-batch orders the planner tries per micro-batching (default {d.max_permutations}; "
             "fewer, down to 3, where they would simulate over 1024 micro-batches)")
    add("tokens-per-microbatch", type=positive_int_argument, default=d.tokens_per_microbatch, metavar="N",
        help=f"token budget of a micro-batch with --{prefix}partition token_based (default {d.tokens_per_microbatch})")
    add("packing", choices=PACKINGS, default=d.packing,
        help="pad each micro-batch's samples to its longest (pad, default) or pack them into one row, each "
             "sample attending to itself alone (varlen: megatron-core's THD format; needs transformer-engine "
             "or --attention sdpa)")
    add("documents", choices=DOCUMENTS, default=d.documents,
        help="plan each sample whole (default), or cut the samples at every --seq-length tokens of their stream "
             "as Megatron-LM's GPT data path cuts documents, and plan the pieces (cut: what THD packing trains; "
             "never predicted slower than it)")


def planner_settings(args: argparse.Namespace, prefix: str = "", cp: int = 1) -> dict:
    """The :class:`TrainingSpec` search fields from flags added by :func:`add_planner_arguments`
    (a flag missing from ``args`` keeps the field's default; ``seqlen_round``'s, of a layout of
    ``cp`` context-parallel ranks: :func:`~.spec.seqlen_round_for`)."""
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
        seqlen_round=get("seqlen-round", seqlen_round_for(cp)),
        max_permutations=get("max-permutations", d.max_permutations),
        tokens_per_microbatch=get("tokens-per-microbatch", d.tokens_per_microbatch),
        packing=get("packing", d.packing),
        documents=get("documents", d.documents),
    )
