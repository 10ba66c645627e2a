"""The data a sizing run draws its global batches from, on the command line: ``--lengths FILE``,
``--mix NAME`` or ``--data-path`` as Megatron-LM takes it, with ``--method``, ``--batches``,
``--seed`` and ``--fast-mode`` (``search``, ``simulate`` and ``trace`` alike)."""

from __future__ import annotations

import argparse
from typing import Optional

from megatron_dynapipe.data.blend import blend_lengths
from megatron_dynapipe.data.datasets import LONG_SAMPLES
from megatron_dynapipe.planning.flags import ListAction, add_fast_mode_argument, positive_int_argument, seed_argument
from megatron_dynapipe.planning.samples import MIXES, LengthSource

__all__ = ["add_sizing_data_arguments", "has_sizing_data", "length_source_from_args"]


def add_sizing_data_arguments(p: argparse.ArgumentParser, title: str, methods_help: str):
    """The options, in a group titled ``title`` (returned, for options of the caller's own)."""
    data = p.add_argument_group(title)
    source = data.add_mutually_exclusive_group()
    source.add_argument("--lengths", metavar="FILE",
                        help="sample lengths (a JSON list, or one a line) from which global batches are drawn")
    source.add_argument("--mix", choices=MIXES, help="draw the samples from a documented length mix instead")
    source.add_argument("--data-path", nargs="+", metavar="PATH",
                        help="draw them from datasets as Megatron-LM's --data-path takes them: a .bin/.idx prefix, "
                             "a .jsonl file of token lists or a token-file folder, or a blend W1 P1 W2 P2 ...")
    data.add_argument("--long-samples", choices=LONG_SAMPLES, default="split",
                      help="with --data-path, documents longer than --seq-length are split into windows, "
                           "truncated, or refused (default split)")
    data.add_argument("--method", action=ListAction, metavar="NAME", help=methods_help)
    data.add_argument("--batches", type=positive_int_argument, default=8, metavar="N",
                      help="global batches drawn, each of global batch x seq-length tokens (default 8)")
    data.add_argument("--seed", type=seed_argument, default=0, metavar="N",
                      help="seed of the drawn batches (default 0)")
    add_fast_mode_argument(data)
    return data


def has_sizing_data(args: argparse.Namespace) -> bool:
    return bool(args.lengths or args.mix or args.data_path)


def length_source_from_args(args: argparse.Namespace, seq_length: int) -> Optional[LengthSource]:
    """The source ``--lengths``/``--mix``/``--data-path`` name (None without one); ``seq_length``
    windows the documents of ``--data-path``."""
    if args.data_path:
        pools, weights = blend_lengths(args.data_path, seq_length, args.long_samples)
        return LengthSource(" ".join(args.data_path), pools=pools, weights=weights)
    if args.lengths:
        return LengthSource.from_file(args.lengths)
    return LengthSource.from_mix(args.mix) if args.mix else None
