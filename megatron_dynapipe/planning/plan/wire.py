"""An execution plan's binary form, as it travels from the planning workers to the training ranks.

All little-endian: a 40-byte header (magic ``b"DPEP"``, u16 version, u16 flags, u32 stage,
num_stages, micro-batch count, total sample count, instruction count, u16 schedule-name length,
f64 predicted makespan, u16 model chunks a stage), the UTF-8 schedule name, then per micro-batch
u32 sequence length and u32 sample count, a u8 recompute per model chunk and micro-batch (chunk
by chunk), the u32 sample indices of all micro-batches in turn, then -- when flags bit 0
(:data:`PACKED`) says every micro-batch is packed -- the u32 token count of each of those samples
in turn, 9 bytes per instruction (:data:`~.instructions.ROW`: u8 op, u8 recompute, i16 peer, u32
micro-batch, u8 model chunk), and a CRC-32 of everything before it.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Sequence

import numpy as np

from megatron_dynapipe.planning.plan.instructions import ROW, Instructions, Op
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

__all__ = ["VERSION", "encode", "decode"]

VERSION = 2  # 2: model chunks (interleaved pipelines)
_MAGIC = b"DPEP"
# magic, version, flags, stage, num_stages, microbatches, samples, instructions, schedule bytes,
# predicted makespan, model chunks
_HEADER = struct.Struct("<4sHHIIIIIHdH")
_CRC = struct.Struct("<I")
_U32_MAX = 2**32 - 1
PACKED = 0x1


def encode(stage: int, num_stages: int, schedule: str, microbatches: Sequence[MicroBatch],
           recompute: Sequence[RecomputeType], rows: np.ndarray, predicted_makespan_ms: float,
           chunks: int = 1) -> bytes:
    """The bytes of a plan with these fields (``rows``: its instructions as :data:`ROW` rows;
    ``recompute``: one per model chunk and micro-batch, chunk by chunk)."""
    name = schedule.encode("utf-8")
    n = len(microbatches)
    if len(name) > 0xFFFF:
        raise ValueError("schedule name is longer than 65535 bytes")
    if num_stages > 0x7FFF:
        raise ValueError(f"{num_stages} stages do not fit the 16-bit peer field")
    if not 1 <= chunks <= 0xFF:
        raise ValueError(f"{chunks} model chunks a stage do not fit the 8-bit chunk field")
    seq_lens = np.array([mb.seq_len for mb in microbatches], dtype=np.int64)
    sizes = np.array([mb.size for mb in microbatches], dtype=np.int64)
    samples = np.fromiter((x for mb in microbatches for x in mb.samples), dtype=np.int64, count=int(sizes.sum()))
    packed = [mb.packed for mb in microbatches]
    if any(packed) and not all(packed):
        raise ValueError("a plan's micro-batches are all packed or all padded")
    flags = PACKED if any(packed) else 0
    lengths = np.fromiter((n for mb in microbatches for n in mb.packed_lengths), dtype=np.int64)
    for what, arr in (("sequence length", seq_lens), ("sample index", samples)):
        if arr.size and (arr.min() < 0 or arr.max() > _U32_MAX):
            raise ValueError(f"a micro-batch {what} is outside 0..{_U32_MAX}")
    header = _HEADER.pack(_MAGIC, VERSION, flags, stage, num_stages, n, samples.size, len(rows), len(name),
                          predicted_makespan_ms, chunks)
    body = b"".join([
        header,
        name,
        seq_lens.astype("<u4").tobytes(),
        sizes.astype("<u4").tobytes(),
        np.array([int(r) for r in recompute], dtype="u1").tobytes(),
        samples.astype("<u4").tobytes(),
        lengths.astype("<u4").tobytes(),
        rows.tobytes(),
    ])
    return body + _CRC.pack(zlib.crc32(body))


def decode(data: "bytes | bytearray | memoryview") -> dict[str, Any]:
    """The fields of the plan :func:`encode` wrote (``ExecutionPlan``'s keyword arguments);
    ValueError on anything else (wrong magic, version, truncated or trailing bytes, corrupted
    content)."""
    data = bytes(data)
    flags, stage, num_stages, n, n_samples, n_instr, sched_len, makespan, chunks = _header(data)
    pos = _HEADER.size

    def take(dtype: str, count: int) -> np.ndarray:
        nonlocal pos
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=pos)
        pos += arr.nbytes
        return arr

    try:
        schedule = data[pos: pos + sched_len].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"corrupted ExecutionPlan: schedule name is not UTF-8 ({exc})") from None
    pos += sched_len
    seq_lens = take("<u4", n).tolist()
    sizes = take("<u4", n).tolist()
    rc_codes = take("u1", n * chunks).tolist()
    samples = take("<u4", n_samples).tolist()
    lengths = take("<u4", n_samples).tolist() if flags & PACKED else None
    rows = np.frombuffer(data, dtype=ROW, count=n_instr, offset=pos)
    if sum(sizes) != n_samples:
        raise ValueError(f"corrupted ExecutionPlan: micro-batch sizes sum to {sum(sizes)}, not {n_samples}")
    microbatches, at = [], 0
    for seq_len, size in zip(seq_lens, sizes):
        packed = tuple(lengths[at: at + size]) if lengths is not None else ()
        microbatches.append(MicroBatch(tuple(samples[at: at + size]), seq_len, packed))
        at += size
    _check_codes(rc_codes, rows)
    rcs = list(RecomputeType)
    return dict(stage=stage, num_stages=num_stages, schedule=schedule, microbatches=microbatches,
                recompute=[rcs[r] for r in rc_codes], instructions=Instructions(rows),
                predicted_makespan_ms=makespan, chunks=chunks)


def _header(data: bytes) -> tuple:
    """The header's counts after checking magic, version, flags, length and checksum."""
    if data[:4] != _MAGIC:
        raise ValueError(f"not a serialised ExecutionPlan: expected magic {_MAGIC!r}, got {data[:4]!r}")
    if len(data) < 6:
        raise ValueError(f"truncated ExecutionPlan: {len(data)} bytes end inside the header")
    (version,) = struct.unpack_from("<H", data, 4)
    if version != VERSION:
        raise ValueError(f"unsupported ExecutionPlan format version {version}: this build reads version {VERSION}")
    if len(data) < _HEADER.size:
        raise ValueError(f"truncated ExecutionPlan: {len(data)} bytes, the header alone needs {_HEADER.size}")
    (_, _, flags, stage, num_stages, n, n_samples, n_instr, sched_len, makespan, chunks) = _HEADER.unpack_from(data, 0)
    if flags & ~PACKED:
        raise ValueError(f"unsupported ExecutionPlan flags {flags:#x}")
    per_sample = 8 if flags & PACKED else 4
    if chunks < 1:
        raise ValueError("corrupted ExecutionPlan: a stage holds no model chunk")
    expected = (_HEADER.size + sched_len + (8 + chunks) * n + per_sample * n_samples + ROW.itemsize * n_instr
                + _CRC.size)
    if len(data) < expected:
        raise ValueError(f"truncated ExecutionPlan: the header announces {expected} bytes, got {len(data)}")
    if len(data) > expected:
        raise ValueError(f"malformed ExecutionPlan: {len(data) - expected} trailing bytes after the announced "
                         f"{expected}")
    (crc,) = _CRC.unpack_from(data, expected - _CRC.size)
    if zlib.crc32(memoryview(data)[: expected - _CRC.size]) != crc:
        raise ValueError("corrupted ExecutionPlan: checksum mismatch")
    return flags, stage, num_stages, n, n_samples, n_instr, sched_len, makespan, chunks


def _check_codes(rc_codes: list[int], rows: np.ndarray) -> None:
    rc_values = {int(r) for r in RecomputeType}
    bad_rc = (set(rc_codes) | set(np.unique(rows["recompute"]).tolist())) - rc_values
    bad_ops = set(np.unique(rows["op"]).tolist()) - {int(o) for o in Op}
    if bad_rc or bad_ops:
        raise ValueError(f"corrupted ExecutionPlan: unknown op codes {sorted(bad_ops)} / recompute codes "
                         f"{sorted(bad_rc)}")
