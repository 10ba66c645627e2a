"""GPT micro-batch arrays, and the sample ids that travel instead of tokens."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_dynapipe.data import MICROBATCH_KEYS
from megatron_dynapipe.data.microbatches import decode_sample_ids, encode_sample_ids, gpt_microbatch


def test_gpt_microbatch_labels_mask_and_positions():
    arrays = gpt_microbatch([np.array([5, 6, 7]), np.array([9])], seq_len=4, pad_token_id=0)
    assert set(arrays) == set(MICROBATCH_KEYS)
    assert arrays["tokens"].tolist() == [[5, 6, 7, 0], [9, 0, 0, 0]]
    assert arrays["labels"].tolist() == [[6, 7, 0, 0], [0, 0, 0, 0]]
    # no loss on the last real token (its next token is not in the sample) nor on padding
    assert arrays["loss_mask"].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert arrays["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
    assert arrays["tokens"].dtype == np.int64 and arrays["loss_mask"].dtype == np.float32
    with pytest.raises(ValueError, match="does not fit"):
        gpt_microbatch([np.arange(5)], seq_len=4)


def test_target_masks_drop_the_loss_where_a_token_is_not_predicted():
    # a prompt (tokens 5, 6) then an answer (7, 8): only 7 and 8 are targets
    arrays = gpt_microbatch([np.array([5, 6, 7, 8]), np.array([1, 2])], seq_len=6,
                            targets=[np.array([0, 0, 1, 1], bool), None])
    assert arrays["labels"][0].tolist() == [6, 7, 8, 0, 0, 0]
    assert arrays["loss_mask"].tolist() == [[0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]]


def test_sample_id_wire_format_roundtrip_and_corruption():
    blob = encode_sample_ids(7, 1, [(2, 8), (1, 16)], [3, 2**40, 5], [4, 8, 12])
    decoded = decode_sample_ids(blob)
    assert (decoded.iteration, decoded.dp_rank, decoded.shapes) == (7, 1, [(2, 8), (1, 16)])
    assert [i.tolist() for i in decoded.ids] == [[3, 2**40], [5]]
    assert [n.tolist() for n in decoded.lengths] == [[4, 8], [12]]
    assert len(encode_sample_ids(0, 0, [(1000, 4096)], range(1000), [4096] * 1000)) < 13_000  # 12 bytes a sample
    broken = bytearray(blob)
    broken[-6] ^= 0xFF
    with pytest.raises(ValueError, match="checksum"):
        decode_sample_ids(bytes(broken))
    with pytest.raises(ValueError, match="not a sample-id blob"):
        decode_sample_ids(b"DPMB" + blob[4:])
    with pytest.raises(ValueError, match="sizes sum to 3, got 2 ids"):
        encode_sample_ids(0, 0, [(3, 8)], [1, 2], [4, 4])
    # pieces (samples cut as Megatron's data path cuts them) carry their first token too
    pieces = decode_sample_ids(encode_sample_ids(7, 1, [(2, 8), (1, 16)], [3, 3, 5], [4, 8, 12], [0, 4, 9]))
    assert [a.tolist() for a in pieces.starts] == [[0, 4], [9]] and decoded.starts is None
    assert len(encode_sample_ids(0, 0, [(1000, 4096)], range(1000), [4096] * 1000, [0] * 1000)) < 17_000
    with pytest.raises(ValueError, match="got 3 ids, 3 lengths and 2 starts"):
        encode_sample_ids(0, 0, [(3, 8)], [1, 2, 3], [4, 4, 4], [0, 0])
