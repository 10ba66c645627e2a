"""Blends of datasets (multi-task mixing) and --split ranges."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_dynapipe.data.blend import BlendedDataset, split_dataset
from megatron_dynapipe.data.datasets import MockDataset, TokenListDataset, open_descriptor


def _tasks():
    """Three tasks whose tokens say which task and sample they are: 1000 * task + sample."""
    return [TokenListDataset([[1000 * t + k] * (2 + k % 5) for k in range(n)], 16) for t, n in enumerate((40, 7, 100))]


def test_a_blend_draws_each_task_by_its_weight_and_cycles_a_short_one():
    parts = _tasks()
    blend = BlendedDataset(parts, [2.0, 1.0, 1.0], 400)
    drawn = [int(blend[i][0]) for i in range(len(blend))]
    counts = np.bincount([t // 1000 for t in drawn], minlength=3)
    assert counts.tolist() == [200, 100, 100]  # exact shares of 400
    # every prefix stays within one sample of its share (the part furthest behind goes next)
    for k in (1, 7, 50, 133, 399):
        prefix = np.bincount([t // 1000 for t in drawn[:k]], minlength=3)
        assert np.all(np.abs(prefix - k * np.array([0.5, 0.25, 0.25])) <= 1)
    # each task's samples in turn; task 1 (7 samples) runs through its samples again and again
    task1 = [t % 1000 for t in drawn if t // 1000 == 1]
    assert task1 == [k % 7 for k in range(100)]
    assert blend.lengths.tolist() == [len(blend[i]) for i in range(len(blend))]


def test_a_blend_describes_itself_with_its_parts(tmp_path):
    parts = [MockDataset(30, 16, 50, seed=1), MockDataset(20, 16, 50, seed=2)]
    blend = BlendedDataset(parts, [0.3, 0.7], 64)
    again = open_descriptor(json.loads(json.dumps(blend.descriptor())))
    assert np.array_equal(again.lengths, blend.lengths)
    assert all(np.array_equal(again[i], blend[i]) for i in range(64))


def test_bad_blends_are_refused():
    parts = _tasks()
    with pytest.raises(ValueError, match="one non-negative weight per dataset"):
        BlendedDataset(parts, [1.0, 1.0])
    with pytest.raises(ValueError, match="one non-negative weight per dataset"):
        BlendedDataset(parts, [1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="same max_seq_len"):
        BlendedDataset([parts[0], TokenListDataset([[1, 2]], 8)], [1, 1])


def test_split_ranges_and_target_masks_pass_through():
    data = TokenListDataset([[k, k + 1] for k in range(100)], 4, targets=[[0, 1]] * 100)
    train, valid, test = split_dataset(data, "969, 30, 1")
    assert (len(train), len(valid), len(test)) == (97, 3, 0)
    assert valid[0].tolist() == [97, 98] and valid.target_mask(0).tolist() == [False, True]
    assert [len(s) for s in split_dataset(data, None)] == [100, 0, 0]
    with pytest.raises(ValueError, match="three non-negative weights"):
        split_dataset(data, "0,0,0")
    assert open_descriptor(split_dataset(MockDataset(10, 8, 5), "5,5,0")[1].descriptor())[0].tolist() == \
        split_dataset(MockDataset(10, 8, 5), "5,5,0")[1][0].tolist()


@pytest.mark.parametrize("split", ["90,5,5", "949,50,1", "969,30,1", "1,1,1", "100,0,0"])
def test_the_split_cuts_between_documents_where_megatron_cuts(split):
    """Windows of a long document all go with their document, and each split holds the documents
    megatron-core's own split matrix gives it (round(a N) to round(b N))."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=53)  # many longer than the 8-token windows
    data = TokenListDataset([[doc] * int(n) for doc, n in enumerate(lengths)], 8)
    assert len(data) > len(lengths)  # long documents became several samples
    parts = split_dataset(data, split)
    docs = [{int(part[i][0]) for i in range(len(part))} for part in parts]  # a sample's tokens name its document
    for bookends, mine in zip(convert_split_vector_to_split_matrix(parse_and_normalize_split(split)), docs):
        wanted = set() if bookends is None else set(range(int(round(bookends[0] * len(lengths))),
                                                          int(round(bookends[1] * len(lengths)))))
        assert mine == wanted
    assert sum(len(p) for p in parts) == len(data)
