"""Samples planned whole, or cut where Megatron-LM's GPT data path cuts them (``documents="cut"``)."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynapipe.planning import TrainingSpec, generate_execution_plan
from megatron_dynapipe.planning.baselines import thd_packing_rows
from megatron_dynapipe.planning.cost_model import AnalyticalCostModel, StageCosts, split_over_cp
from megatron_dynapipe.planning.documents import cut_documents
from megatron_dynapipe.planning.planner import PlanningError
from megatron_dynapipe.planning.samples import scaled_lengths

SMALL = AnalyticalCostModel(hidden_size=1024, num_heads=16, vocab_size=32000, device_memory_mb=16384)


def _stream_windows(lengths, seq_length):
    """Token by token: the samples' tokens laid back to back, a new window every ``seq_length``
    of them; per window, the [sample, count] runs it holds."""
    windows = []
    position = 0
    for sample, n in enumerate(lengths):
        for _ in range(n):
            if position % seq_length == 0:
                windows.append([])
            if windows[-1] and windows[-1][-1][0] == sample:
                windows[-1][-1][1] += 1
            else:
                windows[-1].append([sample, 1])
            position += 1
    return windows


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 700), min_size=1, max_size=30), seq_length=st.sampled_from([64, 256, 512]),
       multiple=st.sampled_from([1, 2, 4, 8]))
def test_pieces_are_the_runs_of_each_window_token_by_token(lengths, seq_length, multiple):
    pieces = cut_documents(lengths, seq_length, multiple)
    windows = _stream_windows(lengths, seq_length)
    runs = [(sample, n, w) for w, window in enumerate(windows) for sample, n in window]
    assert list(zip(pieces.sample.tolist(), pieces.tokens.tolist(), pieces.window.tolist())) == runs
    assert pieces.length.tolist() == [-(-n // multiple) * multiple for _, n, _ in runs]  # padded after the cut
    assert [len(w) for w in pieces.windows()] == [len(w) for w in windows]
    # a sample's pieces follow each other from its first token
    for sample, n in enumerate(lengths):
        mine = pieces.sample == sample
        assert pieces.start[mine].tolist() == np.cumsum(np.r_[0, pieces.tokens[mine]])[:-1].tolist()
        assert pieces.tokens[mine].sum() == n


def test_a_document_crossing_a_windows_end_is_cut_there():
    pieces = cut_documents([300, 50, 700], 256, multiple=4)
    assert pieces.sample.tolist() == [0, 0, 1, 2, 2, 2, 2]
    assert pieces.start.tolist() == [0, 256, 0, 0, 162, 418, 674]
    assert pieces.tokens.tolist() == [256, 44, 50, 162, 256, 256, 26]
    assert pieces.length.tolist() == [256, 44, 52, 164, 256, 256, 28]
    assert pieces.windows() == [[0], [1, 2, 3], [4], [5], [6]]


def test_the_spec_says_what_a_cut_needs():
    with pytest.raises(ValueError, match="unknown documents 'split': choose from whole, cut"):
        TrainingSpec(num_layers=4, pp=2, documents="split")
    with pytest.raises(ValueError, match="documents 'cut' cuts the samples at Megatron-LM's --seq-length: give"):
        TrainingSpec(num_layers=4, pp=2, packing="varlen", documents="cut")
    with pytest.raises(ValueError, match="seq_length 1030 is not a multiple of 2 x cp = 4"):
        TrainingSpec(num_layers=4, pp=2, cp=2, seqlen_round=8, packing="varlen", seq_length=1030, documents="cut")
    spec = TrainingSpec(num_layers=4, pp=2, packing="varlen", seq_length=1024, documents="cut")
    assert TrainingSpec.from_json(spec.to_json()) == spec


def _windows_as_rows(lengths, seq_length, multiple, costs, limit, chunks):
    """THD packing's windows, found token by token (:func:`_stream_windows`), each piece padded to
    ``multiple``, as Megatron runs them."""
    runs = _stream_windows(lengths, seq_length)
    pieces = [-(-n // multiple) * multiple for window in runs for _, n in window]
    firsts = np.cumsum([0] + [len(w) for w in runs])
    windows = [list(range(a, b)) for a, b in zip(firsts[:-1], firsts[1:])]
    return thd_packing_rows(windows, pieces, seq_length, costs, limit, chunks)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mix=st.sampled_from(["multitask", "lognormal", "long", "longtail"]),
    samples=st.integers(8, 80),
    seq_length=st.sampled_from([1024, 2048, 4096]),
    pp=st.integers(1, 4),
    chunks=st.integers(1, 2),
    dp=st.integers(1, 4),
    cp=st.integers(1, 2),
    limit=st.sampled_from([9_000.0, 16_000.0]),
    fast=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_cut_plan_trains_thds_pieces_and_is_never_predicted_slower_than_thd(mix, samples, seq_length, pp, chunks,
                                                                              dp, cp, limit, fast, seed):
    chunks = chunks if pp > 1 else 1
    multiple = 2 * cp if cp > 1 else 1
    lengths = scaled_lengths(samples, seed, mix, 2 * seq_length)  # documents longer than a window too
    spec = TrainingSpec(num_layers=2 * pp * chunks, pp=pp, dp=dp, chunks=chunks, cp=cp, seqlen_round=8,
                        memory_limit_mb=limit, fast_mode=fast, packing="varlen", seq_length=seq_length,
                        documents="cut")
    costs = StageCosts(SMALL, num_layers=spec.num_layers, pp=pp * chunks, dp=dp)
    try:
        result = generate_execution_plan(lengths, spec, costs)
    except PlanningError:
        result = None
    priced = result.costs if result else dataclasses.replace(costs, model=split_over_cp(SMALL, cp)).packed()
    theirs = _windows_as_rows(lengths, seq_length, multiple, priced, limit, chunks)
    if result is None:
        assert theirs is None, f"refused a batch THD packing runs in {theirs.makespan_ms:.1f} ms"
        return
    if theirs is not None:
        assert result.makespan_ms <= theirs.makespan_ms * (1 + 1e-9), (result.makespan_ms, theirs.makespan_ms)
    # every DP rank's micro-batches hold THD's pieces, each once
    planned = sorted(n for choice in result.choices for mb in choice.microbatches for n in mb.packed_lengths)
    assert planned == sorted(-(-n // multiple) * multiple for window in _stream_windows(lengths, seq_length)
                             for _, n in window)
    assert result.pieces.tokens.sum() == sum(lengths)
