"""Variable-length datasets: Megatron .bin/.idx through megatron-core, JSONL, token files, in
memory, mock; long samples split, truncated or refused; descriptors opened again elsewhere."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynapipe.data.datasets import (
    IndexedTokenDataset,
    JsonlTokenDataset,
    MockDataset,
    SampleTooLongError,
    TokenFileDataset,
    TokenListDataset,
    VariableLengthDataset,
    open_dataset,
    open_descriptor,
)

# documents of sequences (a document of several sequences is what --split-sentences writes)
DOCUMENTS = [
    [[1, 2, 3, 4, 5]],
    [[10, 11], [12, 13, 14]],
    [],  # an empty document
    [[20, 21, 22, 23, 24, 25, 26, 27, 28]],
    [[30, 31, 32]],
    [[0], [], [40, 41]],  # an empty sequence inside a document
]


@pytest.fixture(scope="module")
def indexed_prefix(tmp_path_factory):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("indexed") / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in DOCUMENTS:
        for sequence in document:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def _docs():
    out = [np.concatenate([np.array(s, dtype=np.int64) for s in d]) if d else np.zeros(0, np.int64)
           for d in DOCUMENTS]
    return [d for d in out if len(d)]


def _windows(document, limit):
    """Every token after the first a target exactly once: windows of `limit` overlapping by one."""
    if len(document) <= limit:
        return [document]
    out, start = [], 0
    while start < len(document) - 1:
        out.append(document[start:start + limit])
        start += limit - 1
    return out


def _samples(ds):
    return [ds[i].tolist() for i in range(len(ds))]


def test_indexed_documents_match_what_was_written(indexed_prefix):
    ds = IndexedTokenDataset(indexed_prefix, max_seq_len=16)
    expected = _docs()
    assert isinstance(ds, VariableLengthDataset)
    assert len(ds) == len(expected) == 5 and ds.num_empty == 1
    assert ds.lengths.tolist() == [len(d) for d in expected] == [5, 5, 9, 3, 3]
    assert _samples(ds) == [d.tolist() for d in expected]
    assert ds.target_mask(0) is None
    with pytest.raises(IndexError):
        ds[5]


def test_indexed_sequence_unit(indexed_prefix):
    ds = IndexedTokenDataset(indexed_prefix, max_seq_len=16, unit="sequence")
    sequences = [s for d in DOCUMENTS for s in d if s]
    assert len(ds) == len(sequences) and ds.num_empty == 1
    assert _samples(ds) == sequences


@pytest.mark.parametrize("limit", [2, 3, 4, 8])
def test_long_documents_split_into_windows_that_train_every_token_once(indexed_prefix, limit):
    ds = IndexedTokenDataset(indexed_prefix, max_seq_len=limit)
    expected = [w.tolist() for d in _docs() for w in _windows(d, limit)]
    assert _samples(ds) == expected and ds.lengths.tolist() == [len(w) for w in expected]
    assert ds.num_split == sum(len(d) > limit for d in _docs())
    # every token but a document's first is the target (not the first token) of exactly one window
    targets = sorted(t for w in expected for t in w[1:])
    assert targets == sorted(t for d in _docs() for t in d[1:].tolist())


def test_long_documents_truncated_or_refused_on_request(indexed_prefix):
    ds = IndexedTokenDataset(indexed_prefix, max_seq_len=4, long_samples="truncate")
    assert ds.num_truncated == 3 and _samples(ds) == [d[:4].tolist() for d in _docs()]
    with pytest.raises(SampleTooLongError, match=r"document 3 has 9 tokens, more than max_seq_len=8 .*"
                                                 r"--dynapipe-long-samples split"):
        IndexedTokenDataset(indexed_prefix, max_seq_len=8, long_samples="refuse")


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12), limit=st.integers(2, 12))
def test_windows_cover_every_target_once_for_any_lengths(lengths, limit):
    documents = [np.arange(n) + 100 * k for k, n in enumerate(lengths)]
    ds = TokenListDataset(documents, limit)
    assert _samples(ds) == [w.tolist() for d in documents if len(d) for w in _windows(d, limit)]
    assert max(ds.lengths, default=0) <= limit and min(ds.lengths, default=2) >= 1


def test_indexed_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="without .bin/.idx"):
        IndexedTokenDataset(tmp_path / "nothing", max_seq_len=8)


def _write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_lists_objects_blank_and_empty_lines(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [
        "[1, 2, 3]", "", json.dumps({"input_ids": [7, 8], "text": "ignored"}), "[]", "   ", "[5]"])
    ds = JsonlTokenDataset(path, max_seq_len=8)
    assert isinstance(ds, VariableLengthDataset)
    assert len(ds) == 3 and ds.num_empty == 1
    assert _samples(ds) == [[1, 2, 3], [7, 8], [5]] and ds.lengths.tolist() == [3, 2, 1]
    windows = JsonlTokenDataset(_write_jsonl(tmp_path / "w.jsonl", [json.dumps(list(range(10)))]), 4)
    assert _samples(windows) == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]


def test_jsonl_custom_key_and_malformed_lines(tmp_path):
    ds = JsonlTokenDataset(_write_jsonl(tmp_path / "a.jsonl", ['{"tokens": [4, 5]}']), 8, key="tokens")
    assert ds[0].tolist() == [4, 5]
    with pytest.raises(ValueError, match=r"line 2: not valid JSON"):
        JsonlTokenDataset(_write_jsonl(tmp_path / "b.jsonl", ["[1]", "[1, 2"]), 8)
    with pytest.raises(ValueError, match=r"line 1: the object has no 'input_ids' key \(keys: text\)"):
        JsonlTokenDataset(_write_jsonl(tmp_path / "c.jsonl", ['{"text": "hello"}']), 8)
    with pytest.raises(ValueError, match="line 1: expected a list of non-negative integer"):
        JsonlTokenDataset(_write_jsonl(tmp_path / "d.jsonl", ["[1.5, 2]"]), 8)


def test_token_files_keep_samples_and_target_masks(tmp_path):
    samples = [np.arange(6), np.array([2**40, 7]), np.arange(3) + 9]
    targets = [np.array([0, 0, 1, 1, 0, 1], bool), np.array([0, 1], bool), np.ones(3, bool)]
    TokenFileDataset.write(tmp_path / "t", samples, targets)
    ds = TokenFileDataset(tmp_path / "t", max_seq_len=4)
    # the first sample is split into windows [0..3], [3..5]: its target flags travel with it
    assert _samples(ds) == [[0, 1, 2, 3], [3, 4, 5], [2**40, 7], [9, 10, 11]]
    assert [ds.target_mask(i).tolist() for i in range(4)] == [
        [False, False, True, True], [True, False, True], [False, True], [True, True, True]]
    assert sorted(os.listdir(tmp_path)) == ["t"]  # written in place atomically, nothing left over
    with pytest.raises(ValueError, match="one target flag per token"):
        TokenFileDataset.write(tmp_path / "u", samples, targets[:2] + [np.ones(2, bool)])
    assert not (tmp_path / "u").exists()


def test_token_list_saves_to_a_file_other_processes_open(tmp_path):
    ds = TokenListDataset([[1, 2, 3], [4, 5]], max_seq_len=3, targets=[[0, 1, 1], [0, 1]])
    with pytest.raises(TypeError, match=r"save it \(dataset.save\(directory\)\)"):
        ds.descriptor()
    saved = ds.save(tmp_path / "saved")
    again = open_descriptor(json.loads(json.dumps(saved.descriptor())))
    assert _samples(again) == [[1, 2, 3], [4, 5]] and again.target_mask(0).tolist() == [False, True, True]
    for bad in (0, 1, 2.5, True):
        with pytest.raises(ValueError, match="max_seq_len"):
            TokenListDataset([[1]], max_seq_len=bad)


def test_mock_data_is_the_same_wherever_it_is_made():
    ds = MockDataset(50, max_seq_len=32, vocab_size=20, seed=4)
    assert len(ds) == 50 and 4 <= ds.lengths.min() and ds.lengths.max() <= 32
    sample = ds[3]
    assert np.array_equal(np.diff(sample) % 20, np.ones(len(sample) - 1))  # it counts up, modulo the vocabulary
    again = open_descriptor(ds.descriptor())
    assert all(np.array_equal(again[i], ds[i]) for i in range(50))
    assert not np.array_equal(MockDataset(50, 32, 20, seed=5).lengths, ds.lengths)


def test_a_descriptor_opens_the_same_data_or_says_it_is_not(tmp_path, indexed_prefix):
    for ds in (IndexedTokenDataset(indexed_prefix, 4), JsonlTokenDataset(_write_jsonl(tmp_path / "a.jsonl", ["[1, 2]"]), 4)):
        again = open_descriptor(json.loads(json.dumps(ds.descriptor())))
        assert type(again) is type(ds) and _samples(again) == _samples(ds)
    path = _write_jsonl(tmp_path / "b.jsonl", ["[1, 2]", "[3]"])
    descriptor = JsonlTokenDataset(path, 4).descriptor()
    _write_jsonl(path, ["[1, 2]", "[3, 4]"])  # the file changed after rank 0 described it
    with pytest.raises(ValueError, match="not the one rank 0 described .* every rank must read the same files"):
        open_descriptor(descriptor)
    path.unlink()
    with pytest.raises(ValueError, match="every rank must see the dataset's files"):
        open_descriptor(descriptor)
    with pytest.raises(ValueError, match="unknown dataset kind 'pickle'"):
        open_descriptor({"kind": "pickle"})


def test_open_dataset_dispatches_on_the_path(tmp_path, indexed_prefix):
    assert isinstance(open_dataset(_write_jsonl(tmp_path / "x.jsonl", ["[1]"]), 4), JsonlTokenDataset)
    TokenFileDataset.write(tmp_path / "tokens", [[1, 2]])
    assert isinstance(open_dataset(tmp_path / "tokens", 4), TokenFileDataset)
    for path in (indexed_prefix, indexed_prefix + ".bin", indexed_prefix + ".idx"):
        ds = open_dataset(path, 16, unit="sequence")
        assert isinstance(ds, IndexedTokenDataset) and ds.unit == "sequence"
