"""Sample lengths of a global batch: read from a file or drawn from a documented mix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MAX_LENGTH = 2048

# Built-in multi-task mix (task: share of samples, lognormal mu and sigma of token length).
# Short QA-style prompts dominate, a tail of long documents makes padding expensive.
MULTITASK_MIX = {
    "qa": (0.40, 4.0, 0.5),
    "translation": (0.25, 5.0, 0.4),
    "summarization": (0.25, 6.2, 0.5),
    "long-document": (0.10, 7.2, 0.3),
}
MIXES = ("multitask", "lognormal")


def synthetic_lengths(num_samples: int, seed: int = 0, mix: str = "multitask") -> list[int]:
    """Lengths clipped to [8, 2048]: `multitask` draws from MULTITASK_MIX, `lognormal` from
    lognormal(5.3, 0.9) (median about 200 tokens, a long tail)."""
    rng = np.random.default_rng(seed)
    if mix == "lognormal":
        raw = rng.lognormal(5.3, 0.9, num_samples)
    elif mix == "multitask":
        shares, mus, sigmas = map(np.array, zip(*MULTITASK_MIX.values()))
        task = rng.choice(len(shares), size=num_samples, p=shares / shares.sum())
        raw = rng.lognormal(mus[task], sigmas[task])
    else:
        raise ValueError(f"unknown length mix {mix!r}: choose from {', '.join(MIXES)}")
    return [int(n) for n in np.clip(np.rint(raw), 8, MAX_LENGTH)]


def read_lengths(path: str | Path) -> list[int]:
    """A JSON list of lengths, or one length a line (blank lines and # comments ignored)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"lengths file {path} not found: pass --lengths FILE with a JSON list or one length a line")
    text = path.read_text()
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else [
            line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]
        lengths = [int(v) for v in values]
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path} is not a list of integer lengths ({error}): write a JSON list or one length a line") from None
    if not lengths:
        raise ValueError(f"{path} holds no sample lengths: the global batch needs at least one sample")
    return lengths
