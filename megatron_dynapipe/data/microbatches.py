"""GPT micro-batches as arrays and as bytes; numpy only.

Micro-batch wire format (:func:`encode_microbatches`, little-endian): header ``b"DPMB"``, u16
version, u16 flags = 0, u32 iteration, u32 DP rank, u32 micro-batch count, i64 pad token id, u8
token byte width (4 or 8); per micro-batch u32 size and u32 padded length; u32 token count of
every sample in turn; the samples' tokens, concatenated; CRC-32 of everything before it. Only the
real tokens travel (4 bytes a token instead of about 28 for the four padded tensors); every rank
rebuilds the identical tensors with :func:`gpt_microbatch`.

GPT micro-batch semantics (:func:`gpt_microbatch`), for a sample of ``L`` tokens ``t`` padded to
``S``: ``tokens[j] = t[j]`` (``pad_token_id`` for ``j >= L``); ``labels[j] = t[j + 1]`` for
``j < L - 1``, ``pad_token_id`` after; ``loss_mask[j] = 1.0`` for ``j < L - 1`` and 0 on the last
real token (its next token is not in the sample) and on padding; ``position_ids[j] = j`` for
every ``j < S``. Padding sits at the right, so causal attention keeps real tokens from seeing it
and no attention mask is needed.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["gpt_microbatch", "encode_microbatches", "decode_microbatches", "DecodedMicrobatches"]


def gpt_microbatch(samples: Sequence[np.ndarray], seq_len: int, pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """The four GPT arrays of one micro-batch (module docstring: semantics), each
    ``[len(samples), seq_len]``: int64 tokens, labels and position ids, float32 loss mask."""
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
        loss_mask[row, : length - 1] = 1.0
    position_ids = np.broadcast_to(np.arange(seq_len, dtype=np.int64), (n, seq_len)).copy()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


_MB_MAGIC = b"DPMB"
_MB_VERSION = 1
_MB_HEADER = struct.Struct("<4sHHIIIqB")
_CRC = struct.Struct("<I")


def encode_microbatches(iteration: int, dp_rank: int, shapes: Sequence[tuple[int, int]],
                        samples: Sequence[np.ndarray], pad_token_id: int = 0) -> bytes:
    """Wire format of one DP rank's micro-batches (module docstring). ``shapes[m]`` is
    ``(size, padded length)``; ``samples`` holds the token arrays of all micro-batches in turn."""
    if sum(size for size, _ in shapes) != len(samples):
        raise ValueError(f"micro-batch sizes sum to {sum(s for s, _ in shapes)}, got {len(samples)} samples")
    lengths = np.array([len(s) for s in samples], dtype="<u4")
    tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in samples]) if samples else np.zeros(0, np.int64)
    if tokens.size and (tokens.min() < 0):
        raise ValueError("token ids must be non-negative")
    width = 4 if not tokens.size or tokens.max() < 2**31 else 8
    body = b"".join([
        _MB_HEADER.pack(_MB_MAGIC, _MB_VERSION, 0, int(iteration), int(dp_rank), len(shapes),
                        int(pad_token_id), width),
        np.asarray(shapes, dtype="<u4").reshape(-1).tobytes(),
        lengths.tobytes(),
        tokens.astype("<i4" if width == 4 else "<i8").tobytes(),
    ])
    return body + _CRC.pack(zlib.crc32(body))


@dataclass
class DecodedMicrobatches:
    iteration: int
    dp_rank: int
    pad_token_id: int
    shapes: list[tuple[int, int]]
    samples: list[list[np.ndarray]]  # per micro-batch, the real tokens of each sample

    def arrays(self) -> list[dict[str, np.ndarray]]:
        """The GPT arrays of every micro-batch (:func:`gpt_microbatch`)."""
        return [gpt_microbatch(s, seq_len, self.pad_token_id) for s, (_, seq_len) in zip(self.samples, self.shapes)]


def decode_microbatches(blob: "bytes | memoryview") -> DecodedMicrobatches:
    """Parse :func:`encode_microbatches` output; ValueError on anything malformed."""
    data = bytes(blob)
    if len(data) < _MB_HEADER.size + _CRC.size or data[:4] != _MB_MAGIC:
        raise ValueError("not a micro-batch blob (bad magic or truncated header)")
    (_, version, flags, iteration, dp_rank, n, pad, width) = _MB_HEADER.unpack_from(data, 0)
    if version != _MB_VERSION or flags:
        raise ValueError(f"unsupported micro-batch blob version {version} (flags {flags:#x})")
    (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    if zlib.crc32(memoryview(data)[: len(data) - _CRC.size]) != crc:
        raise ValueError("corrupted micro-batch blob: checksum mismatch")
    pos = _MB_HEADER.size
    shapes = np.frombuffer(data, "<u4", 2 * n, pos).reshape(n, 2).tolist()
    pos += 8 * n
    total = int(sum(size for size, _ in shapes))
    lengths = np.frombuffer(data, "<u4", total, pos).astype(np.int64)
    pos += 4 * total
    count = int(lengths.sum())
    if pos + width * count + _CRC.size != len(data):
        raise ValueError("malformed micro-batch blob: sizes disagree with its length")
    tokens = np.frombuffer(data, "<i4" if width == 4 else "<i8", count, pos).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    flat = [tokens[bounds[i]: bounds[i + 1]] for i in range(total)]
    per_mb, at = [], 0
    for size, _ in shapes:
        per_mb.append(flat[at: at + size])
        at += size
    return DecodedMicrobatches(iteration, dp_rank, pad, [tuple(s) for s in shapes], per_mb)
