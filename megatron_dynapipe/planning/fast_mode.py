"""Fast mode: a trimmed search for planning at scale (README "Fast mode"), and how a job
switches it on.  A *setting* is True, False, ``"auto"`` (fast above 16 samples) or None (the
``DYNAPIPE_FAST_MODE`` environment variable, else off); :func:`resolve_fast_mode` turns one into
the decision for a batch."""

from __future__ import annotations

import os
from typing import Mapping, Union

__all__ = ["FastMode", "FAST_MODE_ENV", "parse_fast_mode", "fast_mode_from_env", "resolve_fast_mode_setting",
           "resolve_fast_mode"]

FAST_MODE_ENV = "DYNAPIPE_FAST_MODE"
AUTO_FAST_MODE_MIN_SAMPLES = 17  # "auto": fast when the global batch has more than 16 samples
# The three words the flags show ({true,false,auto}) and nothing else, so that every accepted
# value is one the help names; an empty variable counts as unset.
_TRUE = {"true"}
_FALSE = {"false", ""}

FastMode = Union[bool, str, None]  # True / False / "auto" / None (= environment, else off)


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
    if fast_mode is None:
        fast_mode = fast_mode_from_env()
    if isinstance(fast_mode, str):
        return parse_fast_mode(fast_mode)
    return bool(fast_mode)


def resolve_fast_mode(fast_mode: FastMode, num_samples: int) -> bool:
    """The one place that turns a fast-mode setting into a decision for one global batch:
    the setting as :func:`resolve_fast_mode_setting` reads it, "auto" fast when the batch has
    more than 16 samples (planning time grows with it)."""
    setting = resolve_fast_mode_setting(fast_mode)
    return num_samples >= AUTO_FAST_MODE_MIN_SAMPLES if setting == "auto" else setting
