"""What one pipeline stage of one data-parallel rank runs for one global batch: an
:class:`ExecutionPlan` (its micro-batches, their recompute and the stage's instructions), its
well-formedness check and a readable summary; :mod:`.wire` is its binary form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_dynapipe.planning.plan import wire
from megatron_dynapipe.planning.plan.instructions import Instruction, Instructions, Op, as_recompute
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

__all__ = ["ExecutionPlan"]


class _Where:
    """Lazily formatted "stage s plan, instruction #i ..." prefix of validation errors."""

    __slots__ = ("plan", "index", "instruction")

    def __init__(self, plan: str, index: int, instruction: Instruction):
        self.plan, self.index, self.instruction = plan, index, instruction

    def __format__(self, spec: str) -> str:
        return f"{self.plan}, instruction #{self.index} {self.instruction}"


@dataclass
class ExecutionPlan:
    """What one pipeline stage of one data-parallel rank runs for one global batch.

    ``chunks``: the model chunks the stage holds (an interleaved pipeline: chunk c of stage s is
    virtual stage ``c * num_stages + s``); ``recompute`` has one choice per chunk and micro-batch,
    chunk by chunk (:meth:`recompute_of`). Its binary form is :mod:`.wire`'s (:meth:`to_bytes`,
    :meth:`from_bytes`).
    """

    stage: int
    num_stages: int
    schedule: str
    microbatches: list[MicroBatch]
    recompute: list[RecomputeType]
    instructions: Instructions  # any sequence of Instruction is taken
    predicted_makespan_ms: float = 0.0
    chunks: int = 1
    VERSION: ClassVar[int] = wire.VERSION

    def __post_init__(self) -> None:
        self.microbatches = list(self.microbatches)
        self.recompute = [as_recompute(r) for r in self.recompute]
        self.instructions = Instructions.of(self.instructions)
        self.predicted_makespan_ms = float(self.predicted_makespan_ms)
        if not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage {self.stage} is outside a pipeline of {self.num_stages} stages")
        if self.chunks < 1:
            raise ValueError(f"a stage holds at least one model chunk, got {self.chunks}")
        if len(self.recompute) != self.chunks * len(self.microbatches):
            per_chunk = f" on each of {self.chunks} model chunks" if self.chunks > 1 else ""
            raise ValueError(
                f"{len(self.recompute)} recompute choices for {len(self.microbatches)} micro-batches{per_chunk}"
            )

    def recompute_of(self, microbatch: int, chunk: int = 0) -> RecomputeType:
        """The recompute choice of ``microbatch`` on model chunk ``chunk``."""
        return self.recompute[chunk * len(self.microbatches) + microbatch]

    # -- structure ---------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ValueError unless the instructions are a well-formed plan for this stage.

        Checks: micro-batch ids, chunks and peers in range; comm ops name another stage and other
        ops none; every START has exactly one later FINISH and every FINISH an earlier START; each
        micro-batch has exactly one FORWARD and one BACKWARD on every model chunk, with the plan's
        recompute choice; a FORWARD has its input (LOAD_INPUT or RECV_ACT_FINISH) before it; a
        BACKWARD has its FORWARD and, except on the last virtual stage, its RECV_GRAD_FINISH
        before it; FREE_BUFFER at most once, after the BACKWARD.
        """
        n, where = len(self.microbatches), f"stage {self.stage} plan"
        last = (self.chunks - 1, self.num_stages - 1)  # the last virtual stage's (chunk, stage)
        forwards: dict[tuple[int, int], int] = {}  # by (chunk, micro-batch)
        backwards: dict[tuple[int, int], int] = {}
        inputs: set[tuple[int, int]] = set()
        grads: set[tuple[int, int]] = set()
        freed: set[tuple[int, int]] = set()
        open_transfers: dict[tuple, int] = {}
        closed: set[tuple] = set()
        for i, ins in enumerate(self.instructions):
            op, m, c = ins.op, ins.microbatch, ins.chunk
            key = (c, m)
            here = _Where(where, i, ins)
            if m >= n:
                raise ValueError(f"{here}: micro-batch {m} does not exist (the plan has {n})")
            if c >= self.chunks:
                raise ValueError(f"{here}: model chunk {c} does not exist (the stage holds {self.chunks})")
            if op.is_comm:
                if not 0 <= ins.peer < self.num_stages or ins.peer == self.stage:
                    raise ValueError(f"{here}: peer must be another stage in 0..{self.num_stages - 1}")
            elif ins.peer != -1:
                raise ValueError(f"{here}: only communication ops name a peer")
            if op.is_start:
                transfer = ins.transfer
                if transfer in open_transfers or transfer in closed:
                    raise ValueError(f"{here}: the same transfer is started twice")
                open_transfers[transfer] = i
            elif op.is_finish:
                transfer = ins.transfer
                if transfer not in open_transfers:
                    raise ValueError(f"{here}: FINISH without an earlier matching START")
                del open_transfers[transfer]
                closed.add(transfer)
                if op == Op.RECV_ACT_FINISH:
                    inputs.add(key)
                elif op == Op.RECV_GRAD_FINISH:
                    grads.add(key)
            elif op == Op.LOAD_INPUT:
                inputs.add(key)
            elif op == Op.FORWARD:
                if key in forwards:
                    raise ValueError(f"{here}: second FORWARD of micro-batch {m} (first at #{forwards[key]})")
                if key not in inputs:
                    raise ValueError(f"{here}: FORWARD before its input (LOAD_INPUT or RECV_ACT_FINISH)")
                forwards[key] = i
            elif op == Op.BACKWARD:
                if key in backwards:
                    raise ValueError(f"{here}: second BACKWARD of micro-batch {m} (first at #{backwards[key]})")
                if key not in forwards:
                    raise ValueError(f"{here}: BACKWARD before the FORWARD of micro-batch {m}")
                if (c, self.stage) != last and key not in grads:
                    raise ValueError(f"{here}: BACKWARD before its RECV_GRAD_FINISH")
                backwards[key] = i
            elif op == Op.FREE_BUFFER:
                if key in freed or key not in backwards:
                    raise ValueError(f"{here}: FREE_BUFFER must come once, after the BACKWARD")
                freed.add(key)
            if op.is_compute and ins.recompute != self.recompute_of(m, c):
                raise ValueError(
                    f"{here}: recompute {ins.recompute.label} differs from the plan's "
                    f"{self.recompute_of(m, c).label} for micro-batch {m}"
                )
        if open_transfers:
            transfer, i = min(open_transfers.items(), key=lambda kv: kv[1])
            raise ValueError(f"{where}: instruction #{i} {self.instructions[i]} is never finished")
        # a BACKWARD implies its FORWARD
        missing = sorted({m for c in range(self.chunks) for m in range(n) if (c, m) not in backwards})
        if missing:
            raise ValueError(f"{where}: micro-batches {missing[:10]} lack a FORWARD or BACKWARD")

    # -- serialisation -----------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """Compact binary form (:mod:`.wire`, the class docstring); :meth:`from_bytes` reads it back."""
        return wire.encode(self.stage, self.num_stages, self.schedule, self.microbatches, self.recompute,
                           self.instructions.rows, self.predicted_makespan_ms, self.chunks)

    @classmethod
    def from_bytes(cls, data: "bytes | bytearray | memoryview") -> "ExecutionPlan":
        """Parse :meth:`to_bytes` output; ValueError on anything else (wrong magic, version,
        truncated or trailing bytes, corrupted content)."""
        return cls(**wire.decode(data))

    # -- display -----------------------------------------------------------------------------

    def summary(self, max_rows: "int | None" = None) -> str:
        """Header, micro-batch table and the instructions, one row per compute op (a row ends at
        the FORWARD/BACKWARD that the communication before it serves)."""
        tokens = sum(mb.tokens for mb in self.microbatches)
        lines = [
            f"ExecutionPlan stage {self.stage}/{self.num_stages} schedule={self.schedule} "
            f"micro-batches={len(self.microbatches)} tokens={tokens} instructions={len(self.instructions)} "
            f"predicted={self.predicted_makespan_ms:.3f} ms" + (f" chunks={self.chunks}" if self.chunks > 1 else "")
        ]
        for m, mb in enumerate(self.microbatches):
            shape = f"{mb.size} packed in {mb.seq_len}" if mb.packed else f"{mb.size} x {mb.seq_len}"
            recompute = "/".join(self.recompute_of(m, c).label for c in range(self.chunks))  # chunk by chunk
            lines.append(f"  mb {m:>3}: {shape} ({mb.tokens} tokens) recompute={recompute}")
        rows: list[str] = []
        row: list[str] = []
        for ins in self.instructions:
            row.append(str(ins))
            if ins.op.is_compute:
                rows.append(" ".join(row))
                row = []
        if row:
            rows.append(" ".join(row))
        shown = rows if max_rows is None else rows[:max_rows]
        lines += [f"  | {r}" for r in shown]
        if len(shown) < len(rows):
            lines.append(f"  | ... {len(rows) - len(shown)} more rows")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


