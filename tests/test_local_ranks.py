"""The one way local ranks start (megatron_dynapipe.local_ranks): results in rank order, and a
failing, dying or hanging rank reported instead of hanging the caller."""

import os

import pytest
import torch

from megatron_dynapipe.local_ranks import LocalRanksError, run_local_ranks


def _rank_and_sum(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    torch.distributed.all_reduce(t)
    return rank, world_size, float(t.item())


@pytest.mark.slow
def test_ranks_join_one_group_and_return_in_rank_order():
    # two ranks: (0 + 10) + (1 + 10), summed over the group
    assert run_local_ranks(_rank_and_sum, 2, 10, timeout=600) == [(0, 2, 21.0), (1, 2, 21.0)]


def _threads(rank, world_size):
    return torch.get_num_threads()


@pytest.mark.slow
def test_ranks_run_with_the_callers_thread_count_within_their_share_of_the_cores():
    # a profile made with OMP_NUM_THREADS=1 prices ranks that run one thread each, on any machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_local_ranks(_threads, 1, timeout=600) == [1]
    finally:
        torch.set_num_threads(before)
    share = max(1, (os.cpu_count() or 1) // 2)
    assert run_local_ranks(_threads, 2, timeout=600) == [min(before, share)] * 2


def _warned(rank, world_size):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("a notice the parent silenced", UserWarning)
        warnings.warn("another notice", UserWarning)
    return [str(w.message) for w in caught]


@pytest.mark.slow
def test_ranks_keep_the_callers_warning_filters():
    # a spawned interpreter starts from the default filters: what the parent silenced must stay silent
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="a notice the parent", category=UserWarning)
        assert run_local_ranks(_warned, 1, timeout=600) == [["another notice"]]
    assert run_local_ranks(_warned, 1, timeout=600) == [["a notice the parent silenced", "another notice"]]


def test_a_world_of_no_ranks_is_refused():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_local_ranks(_rank_and_sum, 0, 1)


def _fail_or_block(rank, world_size, how):
    import os
    import time

    if rank == 0:
        if how == "raise":
            raise ValueError("rank zero gave up")
        if how == "exit":
            os._exit(3)
    if how == "sleep" or rank != 0:
        if how != "sleep":
            torch.distributed.barrier()  # waits for rank 0, which never comes
        time.sleep(3600)


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, timeout, expected",
    [
        ("raise", 600, r"^_fail_or_block failed on rank 0:(.|\n)*ValueError: rank zero gave up"),
        ("exit", 600, r"rank\(s\) \[0\] exited without a result \(exit codes \{0: 3\}\)"),
        ("sleep", 4, r"did not finish within 4s \(ranks still running: \[0, 1\]\)"),
    ],
    ids=["raise", "exit", "hang"],
)
def test_harness_reports_failures_and_kills_the_rest(how, timeout, expected):
    # A failure is reported as it happens: were it cut at the timeout instead, the message would
    # say the ranks did not finish. A hang is cut at the timeout, however slowly the ranks start.
    with pytest.raises(LocalRanksError, match=expected) as info:
        run_local_ranks(_fail_or_block, 2, how, timeout=timeout)
    # what a rank raised comes back as itself, for the caller to act on (rank 1 may add its barrier's
    # error at the teardown); a rank that exited or hung raised nothing
    raised = info.value.raised
    if how == "raise":
        assert type(raised[0]) is ValueError and str(raised[0]) == "rank zero gave up"
    else:
        assert 0 not in raised
