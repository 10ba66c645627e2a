"""The ranks whose traces stand for a whole job (dense: one per pipeline stage; MoE: one per stage
x expert-parallel rank), chosen from the layout's rank arithmetic (:mod:`megatron_dynapipe.config.layout`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

from megatron_dynapipe.config.layout import (
    DenseCoords,
    ExpertCoords,
    ParallelLayout,
    dense_coords,
    dense_rank,
    expert_coords,
    expert_rank,
)

__all__ = ["RepresentativeRank", "Representatives", "representative_ranks", "reduction"]


class RepresentativeRank(NamedTuple):
    """One rank the tracer pretends to be.

    ``stage`` is its pipeline stage, ``ep_rank`` its expert-parallel rank (0 for dense models),
    ``coords`` its dense coordinates and ``expert_coords`` its expert-generator coordinates.
    """

    global_rank: int
    stage: int
    ep_rank: int
    coords: DenseCoords
    expert_coords: ExpertCoords


@dataclass(frozen=True)
class Representatives(Sequence[RepresentativeRank]):
    """The ranks to trace for one layout, sorted by (stage, ep_rank); behaves as a sequence."""

    layout: ParallelLayout
    ranks: tuple[RepresentativeRank, ...]

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[RepresentativeRank]:
        return iter(self.ranks)

    def __getitem__(self, index):  # type: ignore[override]
        return self.ranks[index]

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return tuple(r.global_rank for r in self.ranks)

    @property
    def reduction(self) -> float:
        """Ranks in the job per rank traced (``world_size / len(self)``)."""
        return self.layout.world_size / len(self.ranks)


def representative_ranks(
    layout: ParallelLayout, moe: bool = False, *, every_cp_rank: bool = False
) -> Representatives:
    """The ranks whose traces stand for the whole job.

    **Dense** (``moe=False``): one rank per pipeline stage, the one with ``tp = cp = dp = 0``
    (``stage * TP * CP * DP`` under ``tp-cp-ep-dp-pp``, ``stage * TP * CP`` under
    ``tp-cp-ep-pp-dp``).  Ranks of one stage that differ only in TP or DP coordinate run the same
    shapes (TP shards are equal by construction) and the same collectives on same-sized groups.

    **MoE** (``moe=True``): one rank per pipeline stage x expert-parallel rank, chosen in the
    expert generator with ``etp = edp = 0``; different EP ranks hold different experts and may
    route different token counts, so each is traced.  Their dense coordinates are reported in
    ``coords`` (they need not be ``tp = dp = 0``: e.g. ``expert_tp=1, tp=2`` puts EP rank 1 on
    dense ``tp=1``).

    **Context parallel: one CP rank is traced (``cp = 0``).**  With CP, Megatron gives every
    CP rank the same number of tokens (sequence split into 2*CP chunks, rank i keeps chunks
    i and 2*CP-1-i, so causal-attention work is balanced), so all CP ranks build the same
    model, run the same GEMM/norm/MLP shapes and issue the same collectives: the same ring of
    CP-1 KV send/recv steps of equal size, and the same all-reduces over the equally sized
    ``dp-cp`` and ``tp`` groups.  The only asymmetry is inside ring attention: at each step a
    rank attends either with all of its queries to half of the incoming KV or with half of its
    queries to all of it, depending on whether the KV came from an earlier or later CP rank;
    both halves cost the same FLOPs and bytes, so the traced cost of ``cp = 0`` is that of
    every CP rank.  Tracing each CP rank would multiply the work by CP for no new information;
    pass ``every_cp_rank=True`` when exact per-op attention shapes of each CP rank are needed:
    each chosen rank is then joined by the ranks that differ from it only in the dense ``cp``
    coordinate (``ep_rank`` is always the rank's own expert-parallel coordinate).
    """
    cp_values = range(layout.cp) if every_cp_rank else (0,)
    ep_values = range(layout.ep) if moe else (0,)
    chosen: dict[int, RepresentativeRank] = {}
    for stage in range(layout.pp):
        for ep in ep_values:
            if moe:
                base = expert_rank(layout, etp=0, ep=ep, edp=0, pp=stage)
            else:
                base = dense_rank(layout, pp=stage)
            c = dense_coords(layout, base)
            for cp in cp_values:
                rank = dense_rank(layout, tp=c.tp, cp=cp, dp=c.dp, pp=c.pp) if cp else base
                ec = expert_coords(layout, rank)
                rep = RepresentativeRank(rank, stage, ec.ep if moe else 0, dense_coords(layout, rank), ec)
                chosen.setdefault(rank, rep)
    ranks = tuple(sorted(chosen.values(), key=lambda r: (r.stage, r.ep_rank, r.coords.cp)))
    return Representatives(layout, ranks)


def reduction(layout: ParallelLayout, reps: Sequence[RepresentativeRank]) -> float:
    """Ranks in the job per rank traced."""
    if not reps:
        raise ValueError("no representative ranks; pass the result of representative_ranks()")
    return layout.world_size / len(reps)
