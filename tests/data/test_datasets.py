"""Variable-length datasets: Megatron .bin/.idx through megatron-core, JSONL, in memory."""

from __future__ import annotations

import json
import logging
import pickle

import numpy as np
import pytest

from megatron_dynapipe.data.datasets import (
    IndexedTokenDataset,
    JsonlTokenDataset,
    SampleTooLongError,
    TokenListDataset,
    VariableLengthDataset,
    open_dataset,
)

# documents of sequences (a document of several sequences is what --split-sentences writes)
DOCUMENTS = [
    [[1, 2, 3, 4, 5]],
    [[10, 11], [12, 13, 14]],
    [],  # an empty document
    [[20] * 9],
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


def _docs(max_len=None):
    out = [np.concatenate([np.array(s, dtype=np.int64) for s in d]) if d else np.zeros(0, np.int64)
           for d in DOCUMENTS]
    out = [d for d in out if len(d)]
    return out if max_len is None else [d[:max_len] for d in out]


def test_indexed_documents_match_what_was_written(indexed_prefix):
    ds = IndexedTokenDataset(indexed_prefix, max_seq_len=16)
    expected = _docs()
    assert isinstance(ds, VariableLengthDataset)
    assert len(ds) == len(expected) == 5 and ds.num_empty == 1
    assert ds.lengths.tolist() == [len(d) for d in expected] == [5, 5, 9, 3, 3]
    for i, doc in enumerate(expected):
        np.testing.assert_array_equal(ds[i], doc)
    assert ds[-1].tolist() == [0, 40, 41]
    with pytest.raises(IndexError):
        ds[5]


def test_indexed_sequence_unit(indexed_prefix):
    ds = IndexedTokenDataset(indexed_prefix, max_seq_len=16, unit="sequence")
    sequences = [s for d in DOCUMENTS for s in d if s]
    assert len(ds) == len(sequences) and ds.num_empty == 1
    for i, seq in enumerate(sequences):
        assert ds[i].tolist() == seq


def test_indexed_pickles_as_its_path_and_reopens(indexed_prefix):
    ds = IndexedTokenDataset(indexed_prefix, max_seq_len=16)
    ds[0]  # open it
    blob = pickle.dumps(ds)
    assert len(blob) < 500  # only the path and options: no index, no data
    again = pickle.loads(blob)
    for i in range(len(ds)):
        np.testing.assert_array_equal(again[i], ds[i])
    np.testing.assert_array_equal(again.lengths, ds.lengths)


def test_indexed_too_long_sample_names_the_truncate_flag(indexed_prefix):
    with pytest.raises(SampleTooLongError, match=r"sample 2 \(document 3\) has 9 tokens.*max_seq_len=8.*truncate=True"):
        IndexedTokenDataset(indexed_prefix, max_seq_len=8)
    with pytest.raises(SampleTooLongError, match="3 of 5 samples are too long"):
        IndexedTokenDataset(indexed_prefix, max_seq_len=4)


def test_indexed_truncation_keeps_the_head_and_says_so(indexed_prefix, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_dynapipe.data.datasets"):
        ds = IndexedTokenDataset(indexed_prefix, max_seq_len=4, truncate=True)
    assert "truncating 3 of 5 samples" in caplog.text
    assert ds.num_truncated == 3
    assert ds.lengths.tolist() == [4, 4, 4, 3, 3]
    for i, doc in enumerate(_docs(4)):
        assert ds[i].tolist() == doc.tolist()


def test_indexed_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="without .bin/.idx"):
        IndexedTokenDataset(tmp_path / "nothing", max_seq_len=8)


def _write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_lists_objects_blank_and_empty_lines(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [
        "[1, 2, 3]",
        "",
        json.dumps({"input_ids": [7, 8], "text": "ignored"}),
        "[]",
        "   ",
        "[5]",
    ])
    ds = JsonlTokenDataset(path, max_seq_len=8)
    assert isinstance(ds, VariableLengthDataset)
    assert len(ds) == 3 and ds.num_empty == 1
    assert [ds[i].tolist() for i in range(3)] == [[1, 2, 3], [7, 8], [5]]
    assert ds.lengths.tolist() == [3, 2, 1]
    again = pickle.loads(pickle.dumps(ds))
    assert [again[i].tolist() for i in range(3)] == [[1, 2, 3], [7, 8], [5]]


def test_jsonl_custom_key_and_malformed_lines(tmp_path):
    ds = JsonlTokenDataset(_write_jsonl(tmp_path / "a.jsonl", ['{"tokens": [4, 5]}']), 8, key="tokens")
    assert ds[0].tolist() == [4, 5]
    with pytest.raises(ValueError, match=r"line 2: not valid JSON"):
        JsonlTokenDataset(_write_jsonl(tmp_path / "b.jsonl", ["[1]", "[1, 2"]), 8)
    with pytest.raises(ValueError, match=r"line 1: the object has no 'input_ids' key \(keys: text\)"):
        JsonlTokenDataset(_write_jsonl(tmp_path / "c.jsonl", ['{"text": "hello"}']), 8)
    with pytest.raises(ValueError, match="line 1: expected a list of non-negative integer"):
        JsonlTokenDataset(_write_jsonl(tmp_path / "d.jsonl", ["[1.5, 2]"]), 8)


def test_jsonl_too_long_and_truncate(tmp_path, caplog):
    path = _write_jsonl(tmp_path / "long.jsonl", ["[1, 2]", "", json.dumps(list(range(10)))])
    with pytest.raises(SampleTooLongError, match=r"sample 1 \(line 3\) has 10 tokens.*max_seq_len=6.*truncate=True"):
        JsonlTokenDataset(path, max_seq_len=6)
    with caplog.at_level(logging.WARNING, logger="megatron_dynapipe.data.datasets"):
        ds = JsonlTokenDataset(path, max_seq_len=6, truncate=True)
    assert "truncating 1 of 2 samples to their first max_seq_len=6 tokens" in caplog.text
    assert ds[1].tolist() == [0, 1, 2, 3, 4, 5] and ds.lengths.tolist() == [2, 6]


def test_token_list_and_limits():
    ds = TokenListDataset([[1, 2, 3], [4]], max_seq_len=3)
    assert [ds[i].tolist() for i in range(2)] == [[1, 2, 3], [4]]
    with pytest.raises(SampleTooLongError, match="truncate"):
        TokenListDataset([[1, 2, 3, 4]], max_seq_len=3)
    assert TokenListDataset([[1, 2, 3, 4]], max_seq_len=3, truncate=True)[0].tolist() == [1, 2, 3]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_seq_len"):
            TokenListDataset([[1]], max_seq_len=bad)


def test_open_dataset_dispatches_on_the_path(tmp_path, indexed_prefix):
    assert isinstance(open_dataset(_write_jsonl(tmp_path / "x.jsonl", ["[1]"]), 4), JsonlTokenDataset)
    for path in (indexed_prefix, indexed_prefix + ".bin", indexed_prefix + ".idx"):
        ds = open_dataset(path, 16, unit="sequence")
        assert isinstance(ds, IndexedTokenDataset) and ds.unit == "sequence"
