"""Megatron-LM's data flags as DynaPipe's variable-length datasets, one per split.

* ``--data-path`` (or ``--data-args-path``): one dataset or a blend ``W1 P1 W2 P2 ...``, as
  Megatron-LM's own ``get_blend_and_blend_per_split`` parses it; each path is cut by ``--split``
  and the parts of each split are blended. ``--train/valid/test-data-path`` (or
  ``--per-split-data-args-path``): one blend per split, not cut.
* A path is a Megatron ``.bin/.idx`` prefix, a ``.jsonl`` file of token lists, or a token-file
  directory; with ``--sft``, a ``.jsonl`` file of conversations (:mod:`megatron_dynapipe.data.sft`),
  tokenized with the job's tokenizer.
* ``--mock-data``: counting sequences made from the seed (a different seed per split).

Blends follow Megatron's builder: with weights, a split's blend holds as many samples as the run
asks of that split (``train_val_test_num_samples``); without, each dataset counts by its size,
one pass over every one. Samples longer than ``--seq-length`` are split into windows, truncated
or refused (``--dynapipe-long-samples``).
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from megatron_dynapipe.data.blend import BlendedDataset, split_dataset
from megatron_dynapipe.data.datasets import MockDataset, open_dataset
from megatron_dynapipe.data.sft import sft_dataset

__all__ = ["open_splits"]


def open_splits(args: argparse.Namespace, num_samples: Optional[Sequence[int]] = None) -> list:
    """(train, valid, test) datasets of Megatron's data flags (module docstring); ``num_samples``
    is what the run asks of each split (Megatron's ``train_val_test_num_samples``)."""
    num_samples = list(num_samples) if num_samples else [0, 0, 0]
    if getattr(args, "mock_data", False):
        n = getattr(args, "dynapipe_mock_samples", None) or max(256, 8 * int(args.global_batch_size))
        vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 128
        return [MockDataset(n, args.seq_length, vocab, seed=int(args.seed) + k) for k in range(3)]
    from megatron.training.utils import get_blend_and_blend_per_split  # Megatron-LM's own reading of the flags

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    opener = _opener(args)
    if blend_per_split is not None:
        return [_blend([opener(p) for p in b[0]], b[1], size) if b else None
                for b, size in zip(blend_per_split, num_samples)]
    paths, weights = blend
    splits = [split_dataset(opener(path), getattr(args, "split", None)) for path in paths]
    return [_blend([parts[i] for parts in splits], weights, num_samples[i]) for i in range(3)]


def _opener(args):
    long_samples = getattr(args, "dynapipe_long_samples", None) or "split"
    if not getattr(args, "sft", False):
        return lambda path: open_dataset(path, args.seq_length, long_samples=long_samples)
    from megatron_dynapipe.compat.megatron_lm_script import sft_appends_eod

    tokenizer, append_eod = _tokenizer(args), sft_appends_eod()
    cache = getattr(args, "data_cache_path", None)
    return lambda path: sft_dataset(path, tokenizer, args.seq_length, long_samples=long_samples, cache_dir=cache,
                                    append_eod=append_eod)


def _tokenizer(args):
    """The tokenizer pretrain_gpt.py builds its datasets with (``--legacy-tokenizer``: Megatron-LM's
    own, before 0.17)."""
    if getattr(args, "legacy_tokenizer", False):
        from megatron.training import get_tokenizer

        return get_tokenizer()
    from megatron_dynapipe.compat.upstream import build_tokenizer

    return build_tokenizer(args)


def _blend(parts: list, weights: "Sequence[float] | None", size: int):
    """One dataset of ``parts``: itself when alone and unweighted, else a blend (module docstring)."""
    kept = [(part, 1.0 if weights is None else weight) for part, weight in zip(parts, weights or parts) if len(part)]
    if not kept:
        return None
    parts = [part for part, _ in kept]
    if len(parts) == 1 and weights is None:
        return parts[0]
    if weights is None:
        return BlendedDataset(parts, [len(p) for p in parts])
    return BlendedDataset(parts, [weight for _, weight in kept], size or sum(len(p) for p in parts))
