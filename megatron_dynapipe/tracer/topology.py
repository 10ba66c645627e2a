"""Megatron's parallel layout as pure arithmetic: rank <-> coordinates, groups, representative ranks.

Megatron-core numbers ranks with two mixed-radix "rank generators" that share one world:

* the **dense** generator (attention, embeddings, everything that is not an expert) over
  ``tp, cp, dp, pp``;
* the **expert** generator (MoE layers) over ``etp, ep, edp, pp``,

both laid out in the order given by ``order`` (first token varies fastest).  With the default
order ``"tp-cp-ep-dp-pp"``::

    global = tp  + TP  * (cp + CP * (dp  + DP  * pp))      # dense; ep is skipped (size 1 there)
    global = etp + ETP * (ep + EP * (edp + EDP * pp))      # expert; cp is skipped (size 1 there)

A process group of a *kind* (say ``"dp-cp"``) is the set of ranks that share every coordinate
except the ones the kind names.  Everything here is computed from one rank's coordinates, so a
query for one rank of an 8192-rank job costs microseconds and never enumerates the world; only
:func:`all_groups` walks every group, in the same order megatron-core creates them.

Nothing here imports torch or megatron: the tracer uses it before it pretends to be a rank, and
the planner may use it without either installed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, NamedTuple, Sequence

__all__ = [
    "ORDERS",
    "GROUP_KINDS",
    "ParallelLayout",
    "DenseCoords",
    "ExpertCoords",
    "RepresentativeRank",
    "Representatives",
    "dense_coords",
    "dense_rank",
    "expert_coords",
    "expert_rank",
    "group_ranks",
    "rank_groups",
    "all_groups",
    "representative_ranks",
    "reduction",
]

#: Rank orders megatron-core supports (``initialize_model_parallel(order=...)``).
ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")

# kind -> (generator, axes of that generator the group spans).  Dense axes: tp cp dp pp;
# expert axes: etp ep edp pp.  The comment names megatron-core's generator token.
_AXIS_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("dense", ("tp",)),  # decoder 'tp'       -> tensor model parallel
    "cp": ("dense", ("cp",)),  # decoder 'cp'       -> context parallel
    "dp": ("dense", ("dp",)),  # decoder 'dp'       -> data parallel (without CP)
    "dp-cp": ("dense", ("cp", "dp")),  # decoder 'dp-cp' -> data parallel with CP (grad reduce)
    "pp": ("dense", ("pp",)),  # decoder 'pp'       -> pipeline
    "tp-pp": ("dense", ("tp", "pp")),  # decoder 'tp-pp' -> model parallel
    "tp-cp": ("dense", ("tp", "cp")),  # decoder 'tp-cp'
    "tp-dp": ("dense", ("tp", "dp")),  # decoder 'tp-dp'
    "tp-dp-cp": ("dense", ("tp", "cp", "dp")),  # decoder 'tp-dp-cp'
    "ep": ("expert", ("ep",)),  # expert 'ep'         -> expert model parallel
    "expert-tp": ("expert", ("etp",)),  # expert 'tp'  -> expert tensor parallel
    "expert-dp": ("expert", ("edp",)),  # expert 'dp'  -> expert data parallel
    "expert-tp-ep": ("expert", ("etp", "ep")),  # expert 'tp-ep' -> expert tensor+model parallel
    "expert-tp-ep-pp": ("expert", ("etp", "ep", "pp")),  # expert 'tp-ep-pp'
}

#: Every group kind :func:`group_ranks` and :func:`all_groups` understand.
GROUP_KINDS: tuple[str, ...] = tuple(_AXIS_KINDS) + ("embedding", "position-embedding")


def _is_pos_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel configuration of one Megatron job.

    ``dp`` is derived as ``world_size // (tp * pp * cp)`` when left ``None``; ``expert_tp``
    defaults to ``tp``.  The expert data-parallel size ``expert_dp`` is always derived:
    ``world_size // (expert_tp * ep * pp)``.  Invalid layouts raise a one-line ``ValueError``
    that says what to change.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int | None = None
    expert_tp: int | None = None
    order: str = "tp-cp-ep-dp-pp"

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not _is_pos_int(value):
                raise ValueError(f"{name} must be a positive int, got {value!r}; pass e.g. {name}=1")
        for name in ("dp", "expert_tp"):
            value = getattr(self, name)
            if value is not None and not _is_pos_int(value):
                raise ValueError(
                    f"{name} must be a positive int or None, got {value!r}; pass None to derive it"
                )
        if self.order not in ORDERS:
            raise ValueError(f"order {self.order!r} is not supported; use one of {', '.join(ORDERS)}")

        model = self.tp * self.pp * self.cp
        if self.world_size % model:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by tp*pp*cp = {model}; "
                f"make world_size a multiple of {model} or change tp/pp/cp"
            )
        dp = self.world_size // model
        if self.dp is None:
            object.__setattr__(self, "dp", dp)
        elif self.dp != dp:
            raise ValueError(
                f"dp={self.dp} does not match world_size/(tp*pp*cp) = {dp}; "
                f"pass dp={dp} or dp=None to derive it"
            )

        if self.expert_tp is None:
            object.__setattr__(self, "expert_tp", self.tp)
        expert_model = self.expert_tp * self.ep * self.pp
        if self.world_size % expert_model:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by expert_tp*ep*pp = {expert_model}; "
                f"make world_size a multiple of {expert_model} or change expert_tp/ep/pp"
            )
        # megatron-core requires this when pp is not the outermost axis, otherwise the dense and
        # expert generators would disagree on the pipeline groups.
        if not self.order.endswith("pp") and self.pp > 1 and self.expert_dp != self.dp:
            raise ValueError(
                f"order {self.order!r} with pp>1 needs expert_tp*ep == tp*cp "
                f"(expert dp {self.expert_dp} != dp {self.dp}); change expert_tp/ep "
                f"or use order 'tp-cp-ep-dp-pp'"
            )

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert layers: ``world_size // (expert_tp * ep * pp)``."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)  # type: ignore[operator]

    @property
    def is_moe(self) -> bool:
        return self.ep > 1 or self.expert_tp != self.tp

    def describe(self) -> str:
        text = f"W={self.world_size} TP={self.tp} PP={self.pp} CP={self.cp} DP={self.dp}"
        if self.is_moe:
            text += f" EP={self.ep} ETP={self.expert_tp} EDP={self.expert_dp}"
        if self.order != ORDERS[0]:
            text += f" order={self.order}"
        return text


class DenseCoords(NamedTuple):
    """Coordinates of a rank in the dense (non-expert) generator."""

    tp: int
    cp: int
    dp: int
    pp: int


class ExpertCoords(NamedTuple):
    """Coordinates of a rank in the expert generator."""

    etp: int
    ep: int
    edp: int
    pp: int


@dataclass(frozen=True)
class _Generator:
    """One mixed-radix numbering: axis names from fastest to slowest, their sizes and strides."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def coords(self, rank: int) -> tuple[int, ...]:
        return tuple((rank // stride) % size for size, stride in zip(self.sizes, self.strides))

    def rank(self, coords: Sequence[int]) -> int:
        return sum(c * stride for c, stride in zip(coords, self.strides))

    def group(self, rank: int, axes: tuple[str, ...]) -> tuple[int, ...]:
        """Ranks sharing every coordinate of ``rank`` except those on ``axes`` (sorted)."""
        base = rank
        spans = []
        for axis in axes:
            i = self.axes.index(axis)
            size, stride = self.sizes[i], self.strides[i]
            base -= ((rank // stride) % size) * stride
            spans.append((size, stride))
        ranks = [base]
        for size, stride in spans:  # each span is independent: a sum of offsets per axis
            ranks = [r + k * stride for k in range(size) for r in ranks]
        return tuple(sorted(ranks))

    def all_groups(self, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Every group spanning ``axes``, ordered as megatron-core's ``get_ranks`` yields them."""
        other = [i for i, a in enumerate(self.axes) if a not in axes]
        # the group index varies the remaining axes with the first one fastest
        ranges = [range(self.sizes[i]) for i in reversed(other)]
        groups = []
        for values in itertools.product(*ranges):
            base = sum(v * self.strides[i] for v, i in zip(values, reversed(other)))
            groups.append(self.group(base, axes))
        return groups


def _make_generator(order: str, sizes: dict[str, int], rename: dict[str, str]) -> _Generator:
    axes, axis_sizes = [], []
    for token in order.split("-"):
        name = rename.get(token, token)
        if name in sizes:
            axes.append(name)
            axis_sizes.append(sizes[name])
    strides, stride = [], 1
    for size in axis_sizes:
        strides.append(stride)
        stride *= size
    return _Generator(tuple(axes), tuple(axis_sizes), tuple(strides))


@lru_cache(maxsize=256)
def _generators(layout: ParallelLayout) -> tuple[_Generator, _Generator]:
    dense = _make_generator(
        layout.order, {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp}, {}
    )
    expert = _make_generator(
        layout.order,
        {"etp": layout.expert_tp, "ep": layout.ep, "edp": layout.expert_dp, "pp": layout.pp},
        {"tp": "etp", "dp": "edp"},
    )
    return dense, expert


def _check_rank(layout: ParallelLayout, rank: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < layout.world_size:
        raise ValueError(
            f"rank {rank!r} is outside the job; pass 0 <= rank < world_size={layout.world_size}"
        )


def _check_coords(names: Sequence[str], sizes: Sequence[int], values: Sequence[int]) -> None:
    for name, size, value in zip(names, sizes, values):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < size:
            raise ValueError(f"{name}={value!r} is out of range; pass 0 <= {name} < {size}")


def dense_coords(layout: ParallelLayout, rank: int) -> DenseCoords:
    """``(tp, cp, dp, pp)`` of ``rank`` in the dense generator."""
    _check_rank(layout, rank)
    gen = _generators(layout)[0]
    c = dict(zip(gen.axes, gen.coords(rank)))
    return DenseCoords(c["tp"], c["cp"], c["dp"], c["pp"])


def dense_rank(layout: ParallelLayout, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
    """Global rank of the dense coordinates ``(tp, cp, dp, pp)``; inverse of :func:`dense_coords`."""
    sizes = (layout.tp, layout.cp, layout.dp, layout.pp)
    _check_coords(("tp", "cp", "dp", "pp"), sizes, (tp, cp, dp, pp))  # type: ignore[arg-type]
    gen = _generators(layout)[0]
    c = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    return gen.rank([c[a] for a in gen.axes])


def expert_coords(layout: ParallelLayout, rank: int) -> ExpertCoords:
    """``(etp, ep, edp, pp)`` of ``rank`` in the expert generator."""
    _check_rank(layout, rank)
    gen = _generators(layout)[1]
    c = dict(zip(gen.axes, gen.coords(rank)))
    return ExpertCoords(c["etp"], c["ep"], c["edp"], c["pp"])


def expert_rank(layout: ParallelLayout, etp: int = 0, ep: int = 0, edp: int = 0, pp: int = 0) -> int:
    """Global rank of the expert coordinates; inverse of :func:`expert_coords`."""
    _check_coords(
        ("etp", "ep", "edp", "pp"),
        (layout.expert_tp, layout.ep, layout.expert_dp, layout.pp),  # type: ignore[arg-type]
        (etp, ep, edp, pp),
    )
    gen = _generators(layout)[1]
    c = {"etp": etp, "ep": ep, "edp": edp, "pp": pp}
    return gen.rank([c[a] for a in gen.axes])


def _check_kind(kind: str) -> None:
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group kind {kind!r}; use one of {', '.join(GROUP_KINDS)}")


def _embedding(pp_group: tuple[int, ...], kind: str) -> tuple[int, ...]:
    # megatron-core's default_embedding_ranks / default_position_embedding_ranks
    if kind == "position-embedding" or len(pp_group) == 1:
        return (pp_group[0],)
    return (pp_group[0], pp_group[-1])


def group_ranks(layout: ParallelLayout, rank: int, kind: str) -> tuple[int, ...]:
    """Sorted global ranks of the ``kind`` group that ``rank`` belongs to.

    ``"embedding"`` and ``"position-embedding"`` are the groups megatron-core derives from the
    rank's pipeline group (first and last stage; first stage).  Megatron builds one per pipeline
    group but only ranks on those stages are members: a middle-stage rank gets the group of its
    pipeline here, and ``rank in group_ranks(...)`` tells whether it is a member.
    """
    _check_kind(kind)
    _check_rank(layout, rank)
    dense, expert = _generators(layout)
    if kind in ("embedding", "position-embedding"):
        return _embedding(dense.group(rank, ("pp",)), kind)
    gen_name, axes = _AXIS_KINDS[kind]
    return (dense if gen_name == "dense" else expert).group(rank, axes)


def rank_groups(layout: ParallelLayout, rank: int) -> dict[str, tuple[int, ...]]:
    """Every group of ``rank``: ``{kind: sorted global ranks}`` for all :data:`GROUP_KINDS`."""
    _check_rank(layout, rank)
    dense, expert = _generators(layout)
    out = {}
    for kind, (gen_name, axes) in _AXIS_KINDS.items():
        out[kind] = (dense if gen_name == "dense" else expert).group(rank, axes)
    out["embedding"] = _embedding(out["pp"], "embedding")
    out["position-embedding"] = _embedding(out["pp"], "position-embedding")
    return out


def all_groups(layout: ParallelLayout, kind: str) -> list[tuple[int, ...]]:
    """All groups of ``kind`` in the job, in the order megatron-core creates them.

    Enumerates the whole world: meant for tests and small layouts, not per-rank queries.
    """
    _check_kind(kind)
    dense, expert = _generators(layout)
    if kind in ("embedding", "position-embedding"):
        return [_embedding(g, kind) for g in dense.all_groups(("pp",))]
    gen_name, axes = _AXIS_KINDS[kind]
    return (dense if gen_name == "dense" else expert).all_groups(axes)


# --------------------------------------------------------------------------------------------
# representative ranks


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
