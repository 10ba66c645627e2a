"""Samples planned whole, or cut where Megatron-LM's GPT data path cuts them (``documents="cut"``);
that a cut plan is never priced above THD packing's windows is a case of
``tests/planning/test_planner.py``'s property test of Megatron's own packings."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynapipe.planning import TrainingSpec
from megatron_dynapipe.planning.documents import cut_documents
from project import stream_windows


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 700), min_size=1, max_size=30), seq_length=st.sampled_from([64, 256, 512]),
       multiple=st.sampled_from([1, 2, 4, 8]))
def test_pieces_are_the_runs_of_each_window_token_by_token(lengths, seq_length, multiple):
    pieces = cut_documents(lengths, seq_length, multiple)
    windows = stream_windows(lengths, seq_length)
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
