"""GPT micro-batches: the sample ids that travel, and the arrays every rank builds; numpy only.

Sample-id wire format (:func:`encode_sample_ids`, little-endian): header ``b"DPID"``, u16
version, u16 flags, u32 iteration, u32 DP rank, u32 micro-batch count; per micro-batch u32 size
and u32 padded length; u64 dataset index of every sample in turn; u32 token count of every sample
(what rank 0 planned with: a rank whose copy of the dataset disagrees stops); where flags is 1
(pieces: samples cut as Megatron's data path cuts them, ``TrainingSpec.documents``), u32 first
token of every piece in its sample; CRC-32 of everything before it. Twelve bytes a sample (sixteen
a piece), whatever its length: every rank reads its own samples from the dataset (as Megatron's
ranks do) and rebuilds the identical tensors with :func:`gpt_microbatch`. A piece is a sample of
its own: the prediction of the token after its last is lost, as at a sample's end.

GPT micro-batch semantics (:func:`gpt_microbatch`), for a sample of ``L`` tokens ``t`` padded to
``S``: ``tokens[j] = t[j]`` (``pad_token_id`` for ``j >= L``); ``labels[j] = t[j + 1]`` for
``j < L - 1``, ``pad_token_id`` after; ``loss_mask[j] = 1.0`` for ``j < L - 1`` when token ``j + 1``
is a prediction target (every one, unless the sample has a target mask: SFT prompts are not), 0
on the last real token (its next token is not in the sample) and on padding; ``position_ids[j] =
j`` for every ``j < S``. Padding sits at the right, so causal attention keeps real tokens from
seeing it and no attention mask is needed.

A packed micro-batch (:func:`packed_microbatch`, THD in megatron-core's terms) is one row: its
samples back to back, then padding up to ``seq_len``. Each sample keeps the arrays it has alone
(its own labels, loss mask and positions counted from 0), and ``cu_seqlens`` (int32, the
cumulative bounds of the samples and of the padding, as one more segment) makes every sample
attend to itself alone; ``max_seqlen`` is its longest segment. Under context parallelism every
sample is padded at its right to a multiple of ``2 x CP`` tokens first (``sample_multiple``): each
rank holds two of its ``2 x CP`` equal chunks.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["SampleIds", "decode_sample_ids", "encode_sample_ids", "gpt_microbatch", "packed_microbatch"]


def gpt_microbatch(samples: Sequence[np.ndarray], seq_len: int, pad_token_id: int = 0,
                   targets: "Sequence[np.ndarray | None] | None" = None) -> dict[str, np.ndarray]:
    """The four GPT arrays of one micro-batch (module docstring: semantics), each
    ``[len(samples), seq_len]``: int64 tokens, labels and position ids, float32 loss mask.
    ``targets[row]``: the sample's per-token target mask, or None (every token is one)."""
    n = len(samples)
    tokens = np.full((n, seq_len), pad_token_id, dtype=np.int64)
    labels = np.full((n, seq_len), pad_token_id, dtype=np.int64)
    loss_mask = np.zeros((n, seq_len), dtype=np.float32)
    for row, sample in enumerate(samples):
        length = len(sample)
        if length > seq_len:
            raise ValueError(f"a sample of {length} tokens does not fit a micro-batch padded to {seq_len}")
        tokens[row, :length] = sample
        labels[row, : length - 1] = sample[1:]
        mask = None if targets is None else targets[row]
        loss_mask[row, : length - 1] = 1.0 if mask is None else np.asarray(mask[1:length], dtype=np.float32)
    position_ids = np.broadcast_to(np.arange(seq_len, dtype=np.int64), (n, seq_len)).copy()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def packed_microbatch(samples: Sequence[np.ndarray], seq_len: int, pad_token_id: int = 0,
                      targets: "Sequence[np.ndarray | None] | None" = None,
                      sample_multiple: int = 1) -> dict[str, np.ndarray]:
    """The GPT arrays of one packed micro-batch (module docstring), each ``[1, seq_len]``, with
    ``cu_seqlens`` and ``max_seqlen`` for megatron-core's ``PackedSeqParams``; each sample padded
    to a multiple of ``sample_multiple`` tokens."""
    lengths = [-(-len(sample) // sample_multiple) * sample_multiple for sample in samples]
    used = sum(lengths)
    if used > seq_len:
        raise ValueError(f"samples of {used} tokens do not fit a packed micro-batch of {seq_len}")
    segments = lengths + ([seq_len - used] if used < seq_len else [])  # the padding is a segment too
    out = {"tokens": np.full((1, seq_len), pad_token_id, dtype=np.int64),
           "labels": np.full((1, seq_len), pad_token_id, dtype=np.int64),
           "loss_mask": np.zeros((1, seq_len), dtype=np.float32)}
    if samples:  # each sample's arrays as it has them alone
        alone = [gpt_microbatch([sample], length, pad_token_id, None if targets is None else [targets[row]])
                 for row, (sample, length) in enumerate(zip(samples, lengths))]
        for key, array in out.items():
            array[0, :used] = np.concatenate([a[key][0] for a in alone])
    out["position_ids"] = np.concatenate([np.arange(n, dtype=np.int64) for n in segments])[None, :]
    out["cu_seqlens"] = np.concatenate([[0], np.cumsum(segments)]).astype(np.int32)
    out["max_seqlen"] = np.array([max(segments)], dtype=np.int32)
    return out


_MAGIC = b"DPID"
_VERSION = 1
_PIECES = 1  # flags: the samples are pieces, and their first tokens follow the lengths
_HEADER = struct.Struct("<4sHHIII")
_CRC = struct.Struct("<I")


@dataclass
class SampleIds:
    """One DP rank's micro-batches of one iteration, as dataset indices."""

    iteration: int
    dp_rank: int
    shapes: list[tuple[int, int]]  # (size, padded length) per micro-batch
    ids: list[np.ndarray]  # per micro-batch, the dataset index of each sample
    lengths: list[np.ndarray]  # per micro-batch, each sample's token count as planned
    #: per micro-batch, each piece's first token in its sample; None where samples are whole
    starts: "list[np.ndarray] | None" = None


def encode_sample_ids(iteration: int, dp_rank: int, shapes: Sequence[tuple[int, int]], ids: Sequence[int],
                      lengths: Sequence[int], starts: "Sequence[int] | None" = None) -> bytes:
    """Wire format of one DP rank's micro-batches (module docstring); ``ids`` and ``lengths``
    (and ``starts``, where the samples are pieces) list every micro-batch's samples in turn."""
    if sum(size for size, _ in shapes) != len(ids) or len(ids) != len(lengths) or \
            (starts is not None and len(starts) != len(ids)):
        raise ValueError(f"micro-batch sizes sum to {sum(s for s, _ in shapes)}, got {len(ids)} ids, "
                         f"{len(lengths)} lengths" + ("" if starts is None else f" and {len(starts)} starts"))
    body = b"".join([
        _HEADER.pack(_MAGIC, _VERSION, 0 if starts is None else _PIECES, int(iteration), int(dp_rank), len(shapes)),
        np.asarray(shapes, dtype="<u4").reshape(-1).tobytes(),
        np.asarray(ids, dtype="<u8").tobytes(),
        np.asarray(lengths, dtype="<u4").tobytes(),
        b"" if starts is None else np.asarray(starts, dtype="<u4").tobytes(),
    ])
    return body + _CRC.pack(zlib.crc32(body))


def decode_sample_ids(blob: "bytes | memoryview") -> SampleIds:
    """Parse :func:`encode_sample_ids` output; ValueError on anything malformed."""
    data = bytes(blob)
    if len(data) < _HEADER.size + _CRC.size or data[:4] != _MAGIC:
        raise ValueError("not a sample-id blob (bad magic or truncated header)")
    _, version, flags, iteration, dp_rank, n = _HEADER.unpack_from(data, 0)
    if version != _VERSION or flags not in (0, _PIECES):
        raise ValueError(f"unsupported sample-id blob version {version} (flags {flags:#x})")
    (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    if zlib.crc32(memoryview(data)[: len(data) - _CRC.size]) != crc:
        raise ValueError("corrupted sample-id blob: checksum mismatch")
    pos = _HEADER.size
    if pos + 8 * n + _CRC.size > len(data):
        raise ValueError("malformed sample-id blob: sizes disagree with its length")
    shapes = [tuple(s) for s in np.frombuffer(data, "<u4", 2 * n, pos).reshape(n, 2).tolist()]
    pos += 8 * n
    total = int(sum(size for size, _ in shapes))
    if pos + (16 if flags else 12) * total + _CRC.size != len(data):
        raise ValueError("malformed sample-id blob: sizes disagree with its length")
    ids = np.frombuffer(data, "<u8", total, pos).astype(np.int64)
    lengths = np.frombuffer(data, "<u4", total, pos + 8 * total).astype(np.int64)
    starts = np.frombuffer(data, "<u4", total, pos + 12 * total).astype(np.int64) if flags else None
    bounds = np.cumsum([0] + [size for size, _ in shapes])

    def per_microbatch(values):
        return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    return SampleIds(iteration, dp_rank, shapes, per_microbatch(ids), per_microbatch(lengths),
                     None if starts is None else per_microbatch(starts))
