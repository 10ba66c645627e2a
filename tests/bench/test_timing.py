"""Methods timed side by side on local ranks (bench/timing.py): rotated, and what runs between rounds."""

import pytest

from megatron_dynapipe.bench.timing import time_alternating
from megatron_dynapipe.local_ranks import run_local_ranks


def _rounds(rank, world_size):
    calls = []
    runs = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times, _ = time_alternating(runs, warmup=2, steps=3, rank=rank, before_each=lambda: None,
                                after_round=lambda: calls.append("|"))
    return calls, {name: len(t) for name, t in times.items()}


@pytest.mark.slow
def test_each_step_rotates_which_method_goes_first_and_only_timed_rounds_are_followed_by_after_round():
    for calls, timed in run_local_ranks(_rounds, 2, timeout=600):
        assert "".join(calls) == "abc" "bca" "cab|" "abc|" "bca|"
        assert timed == {"a": 3, "b": 3, "c": 3}
