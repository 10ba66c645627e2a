"""Sample lengths of a global batch: read from a file or drawn from a documented mix."""

from __future__ import annotations

import json
import numbers
import sys
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Sequence

import numpy as np

MAX_LENGTH = 2048  # cap of the multitask and lognormal mixes
LONG_MAX_LENGTH = 4096  # cap of the long mix

# Built-in multi-task mix (task: share of samples, lognormal mu and sigma of token length).
# Short QA-style prompts dominate, a tail of long documents makes padding expensive.
MULTITASK_MIX = {
    "qa": (0.40, 4.0, 0.5),
    "translation": (0.25, 5.0, 0.4),
    "summarization": (0.25, 6.2, 0.5),
    "long-document": (0.10, 7.2, 0.3),
}
# Long-sample mix, capped at 4096 tokens: as in real pre-training text, about a quarter of the
# samples are documents cut at the context length, the rest spread from prompts to pages.
LONG_MIX = {
    "qa": (0.25, 4.5, 0.6),
    "dialogue": (0.20, 6.0, 0.6),
    "article": (0.25, 7.2, 0.5),
    "book": (0.30, 8.6, 0.5),
}
# Long-tail mix, capped at 16384 tokens, for context-parallel layouts: most samples are a page or
# two, and one in twelve is a long document of 4-8x the median (about 1,300 tokens).
LONGTAIL_MIX = {
    "chat": (0.92, 7.0, 0.7),
    "long-document": (0.08, 8.9, 0.25),
}
LONGTAIL_MAX_LENGTH = 16384
MIXES = ("multitask", "lognormal", "long", "longtail")
#: the longest sample each mix draws
MIX_CAPS = {"multitask": MAX_LENGTH, "lognormal": MAX_LENGTH, "long": LONG_MAX_LENGTH, "longtail": LONGTAIL_MAX_LENGTH}


def synthetic_lengths(num_samples: int, seed: int = 0, mix: str = "multitask") -> list[int]:
    """Lengths from a documented mix: `multitask` draws from MULTITASK_MIX and `lognormal` from
    lognormal(5.3, 0.9) (median about 200 tokens), both clipped to [8, 2048]; `long` draws from
    LONG_MIX clipped to [8, 4096], `longtail` from LONGTAIL_MIX clipped to [8, 16384]."""
    rng = np.random.default_rng(seed)
    if mix == "lognormal":
        return _clip(rng.lognormal(5.3, 0.9, num_samples), MAX_LENGTH)
    tasks = {"multitask": MULTITASK_MIX, "long": LONG_MIX, "longtail": LONGTAIL_MIX}.get(mix)
    if tasks is None:
        raise ValueError(f"unknown length mix {mix!r}: choose from {', '.join(MIXES)}")
    shares, mus, sigmas = map(np.array, zip(*tasks.values()))
    task = rng.choice(len(shares), size=num_samples, p=shares / shares.sum())
    return _clip(rng.lognormal(mus[task], sigmas[task]), MIX_CAPS[mix])


def scaled_lengths(num_samples: int, seed: int, mix: str, cap: int) -> list[int]:
    """:func:`synthetic_lengths` scaled from the mix's cap to ``cap`` (at least 2 tokens each): a
    short-context model sees the mix's shape, not a batch of samples all cut to its length."""
    scale = cap / MIX_CAPS[mix]
    return [max(2, min(cap, round(n * scale))) for n in synthetic_lengths(num_samples, seed, mix)]


def _clip(raw: np.ndarray, cap: int) -> list[int]:
    return [int(n) for n in np.clip(np.rint(raw), 8, cap)]


LENGTHS_FIX = "give each sample's length as a whole number of tokens >= 1"
#: the most samples a global batch may hold: planning 65,536 takes seconds, a million minutes; more
#: is a typo or a whole dataset, not a batch
MAX_SAMPLES = 2**20
#: the longest sample taken: Megatron-LM's positions and the plans' token counts are 32-bit
MAX_SAMPLE_TOKENS = 2**31 - 1
#: the largest lengths file read (a million lengths of seven digits take 8 MB)
MAX_LENGTHS_FILE_BYTES = 64 * 2**20


def check_sample_count(count: int, flag: str) -> None:
    """Refuse, in one line naming the limit, a global batch of more than :data:`MAX_SAMPLES`."""
    if count > MAX_SAMPLES:
        raise ValueError(f"{flag} {count:,} samples: a global batch holds at most {MAX_SAMPLES:,} (planning that many "
                         "takes minutes); plan a batch, not a dataset")


def check_lengths(values: Sequence, where: str = "the global batch") -> list[int]:
    """``values`` as a list of sample lengths: whole numbers >= 1 (Python or numpy integers; not
    bools, not floats such as 2.5 or 2.0), at least one, in a sequence (not bytes or a string,
    whose items are character codes or characters, nor a mapping, whose items are its keys);
    ValueError naming the first bad value."""
    if isinstance(values, (str, bytes, bytearray, Mapping)) or not isinstance(values, Iterable):
        raise ValueError(f"{where} is of type {type(values).__name__}, not a list of lengths: {LENGTHS_FIX}, in a list "
                         "(bytes read from a file: parse them first, as read_lengths does)")
    values = list(values)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1]
    if bad:
        raise ValueError(f"{where} is not a list of integer lengths (found {bad[0]!r}): {LENGTHS_FIX}")
    if not values:
        raise ValueError(f"{where} holds no sample lengths: the global batch needs at least one sample")
    longest = max(values)
    if longest > MAX_SAMPLE_TOKENS:
        raise ValueError(f"{where} has a sample of {longest:,} tokens, over the {MAX_SAMPLE_TOKENS:,} a sample may "
                         "hold (32-bit positions): cut it into documents of at most that")
    check_sample_count(len(values), where + " holds")
    return [int(v) for v in values]


def read_lengths(path: str | Path) -> list[int]:
    """A JSON list of lengths, or one length a line (blank lines and # comments ignored), from a
    file or, for ``-``, standard input."""
    text, name = _lengths_text(path)
    fix = "write a JSON list or one length a line, each a whole number of tokens >= 1"
    try:
        if text.lstrip().startswith("["):
            values = json.loads(text)
        else:
            values = [int(line.split("#")[0]) for line in text.splitlines() if line.split("#")[0].strip()]
    except ValueError as error:
        raise ValueError(f"{name} is not a list of integer lengths ({error}): {fix}") from None
    if not isinstance(values, list):
        raise ValueError(f"{name} holds a JSON {type(values).__name__}, not a list of lengths: {fix}")
    return check_lengths(values, name)


def _lengths_text(path: str | Path) -> tuple[str, str]:
    """The text of a lengths file (or of standard input, ``-``), at most MAX_LENGTHS_FILE_BYTES of
    it, and its name for messages."""
    too_big = (f"over the {MAX_LENGTHS_FILE_BYTES:,} bytes a global batch of at most {MAX_SAMPLES:,} lengths needs: "
               "pass one batch's lengths")
    if str(path) == "-":
        text = sys.stdin.read(MAX_LENGTHS_FILE_BYTES + 1)
        if len(text) > MAX_LENGTHS_FILE_BYTES:
            raise ValueError(f"standard input holds {too_big}")
        return text, "standard input"
    path = Path(path)
    if not path.exists():
        raise ValueError(f"lengths file {path} not found: pass --lengths FILE with a JSON list or one length a line "
                         "(- reads standard input)")
    if not path.is_file():  # a folder, a FIFO or a device (a link to /dev/zero never ends)
        raise ValueError(f"lengths file {path} is not a regular file: pass --lengths FILE with a JSON list or one "
                         "length a line (- reads standard input)")
    if path.stat().st_size > MAX_LENGTHS_FILE_BYTES:
        raise ValueError(f"lengths file {path} holds {path.stat().st_size:,} bytes, {too_big}")
    return path.read_text(), str(path)


class LengthSource:
    """Where a sizing run's samples come from: the lengths of one pool (a file's, drawn with
    replacement), of several pools drawn from by weight (a blend of datasets), or a documented
    mix (:func:`synthetic_lengths`). ``label`` names it in reports."""

    def __init__(self, label: str, *, pool: Sequence[int] | None = None, mix: str | None = None,
                 pools: Sequence[Sequence[int]] | None = None, weights: Sequence[float] | None = None):
        if pool is not None:
            pools = [pool]
        if (pools is None) == (mix is None):
            raise ValueError("a length source is a pool of lengths (or several) or a mix, one of these")
        if mix is not None and mix not in MIXES:
            raise ValueError(f"unknown length mix {mix!r}: choose from {', '.join(MIXES)}")
        self.label, self.mix = label, mix
        self.pools = None if pools is None else [np.asarray(check_lengths(p, label)) for p in pools]
        weights = np.ones(len(self.pools or ())) if weights is None else np.asarray(weights, dtype=float)
        if self.pools is not None and (len(weights) != len(self.pools) or np.any(weights < 0) or weights.sum() <= 0):
            raise ValueError(f"{label}: give one non-negative weight per pool of lengths, some positive")
        self.weights = weights / weights.sum() if self.pools else weights

    @classmethod
    def from_file(cls, path: str | Path) -> "LengthSource":
        return cls(str(path), pool=read_lengths(path))

    @classmethod
    def from_mix(cls, mix: str) -> "LengthSource":
        return cls(f"the {mix} mix", mix=mix)

    def batches(self, tokens: int, cap: int, count: int, seed: int = 0) -> list[list[int]]:
        """``count`` global batches of exactly ``tokens`` tokens each: samples drawn in turn,
        each clipped to ``cap`` (the longest sequence the job takes), the last cut to the budget.
        Batch ``i`` depends on ``seed`` and ``i`` alone."""
        return [self._batch(tokens, cap, np.random.default_rng([seed, i])) for i in range(count)]

    def _batch(self, tokens: int, cap: int, rng: np.random.Generator) -> list[int]:
        drawn: list[int] = []
        total, chunk = 0, 256
        while total < tokens:
            lengths = np.minimum(self._draw(chunk, rng), cap)
            drawn.extend(lengths.tolist())
            total += int(lengths.sum())
            chunk = int((tokens - total) / max(1.0, total / len(drawn)) * 1.1) + 16
        ends = np.cumsum(drawn)
        last = int(np.searchsorted(ends, tokens))  # the sample that reaches the budget
        batch = drawn[:last + 1]
        batch[-1] -= int(ends[last]) - tokens
        return batch

    def _draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.pools is None:
            return np.asarray(synthetic_lengths(n, int(rng.integers(2**32)), self.mix))
        if len(self.pools) == 1:
            return rng.choice(self.pools[0], n)
        part = rng.choice(len(self.pools), n, p=self.weights)
        out = np.empty(n, dtype=np.int64)
        for j, pool in enumerate(self.pools):
            out[part == j] = rng.choice(pool, int(np.count_nonzero(part == j)))
        return out
