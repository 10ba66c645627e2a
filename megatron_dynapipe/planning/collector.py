"""The cyclic garbage collector, paused where a burst of objects in no cycle is made.

Planning a batch, reading a large layout's traces and replaying it each allocate tens of
thousands to millions of small objects that reference counting frees on its own; the cyclic
collector would scan them, and every older object, again and again for nothing: about a fifth
of a 1024-sample plan, a third of reading a 64-stage layout's traces (530k ops: 11 s, 7 s
paused).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

__all__ = ["cyclic_gc_paused"]


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The cyclic collector off inside the block; a caller's own setting is kept."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
