"""Megatron's parallel layout as pure arithmetic: checks, rank <-> coordinates, process groups.

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

Nothing here imports torch or megatron: the command line checks layouts with it, the tracer uses
it before it pretends to be a rank, and the simulator places ranks on nodes with it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Sequence

__all__ = [
    "ORDERS",
    "GROUP_KINDS",
    "ParallelLayout",
    "DenseCoords",
    "ExpertCoords",
    "dense_coords",
    "dense_rank",
    "expert_coords",
    "expert_rank",
    "group_ranks",
    "rank_groups",
    "all_groups",
    "experts_problem",
    "layers_problem",
    "layout_problems",
    "model_problems",
    "shapes_only_problem",
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


#: the largest job a layout may describe: a million GPUs, some fifty times the largest trained so far;
#: past it a size is a typo, and tracing or searching it would run for hours before saying so
MAX_WORLD_SIZE = 2**20
#: the most sequences a global batch may hold (Megatron's --global-batch-size), for the same reason
MAX_GLOBAL_BATCH = 2**24


def is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


#: How a caller's users name the sizes; each surface passes its own (its flags, its line keys).
KWARG_NAMES = {"world_size": "world_size", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "dp": "dp",
               "expert_tp": "expert_tp", "order": "order", "num_experts": "num_experts",
               "seq_length": "seq_length"}


def layout_problems(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, dp: "int | None" = None,
                    expert_tp: "int | None" = None, order: str = ORDERS[0],
                    names: "dict[str, str] | None" = None) -> list[str]:
    """Why megatron-core's ``initialize_model_parallel`` would refuse this layout: one sentence
    per broken rule, naming the fix in the caller's own terms (``names``: size -> how its users
    write it, e.g. ``{"tp": "--fake-tp"}``); empty when the layout is valid. The one place these
    rules live: :class:`ParallelLayout`, trace configs, the fake-rank flags and ``plan`` use it."""
    n = {**KWARG_NAMES, **(names or {})}
    sizes = dict(world_size=world_size, tp=tp, pp=pp, cp=cp, ep=ep)
    problems = [f"{n[k]} must be a positive integer, got {v!r}" for k, v in sizes.items() if not is_positive_int(v)]
    problems += [f"{n[k]} must be a positive integer or left out, got {v!r}"
                 for k, v in (("dp", dp), ("expert_tp", expert_tp)) if v is not None and not is_positive_int(v)]
    if order not in ORDERS:
        problems.append(f"{n['order']} {order} is not a Megatron rank order: use one of {' or '.join(ORDERS)}")
    if not problems and world_size > MAX_WORLD_SIZE:
        problems.append(f"{n['world_size']} {world_size:,} is over the {MAX_WORLD_SIZE:,} GPUs a layout may have: "
                        "give the job's real size")
    if problems:
        return problems
    dense = tp * pp * cp
    if world_size % dense:
        problems.append(f"{n['world_size']} {world_size} is not divisible by {n['tp']}·{n['pp']}·{n['cp']} = "
                        f"{tp}·{pp}·{cp} = {dense}: make it a multiple of {dense} or change {n['tp']}, "
                        f"{n['pp']}, {n['cp']}")
        return problems
    if dp is not None and dp != world_size // dense:
        problems.append(f"{n['dp']} {dp} does not match {n['world_size']}/({n['tp']}·{n['pp']}·{n['cp']}) = "
                        f"{world_size}/{dense} = {world_size // dense}: pass {n['dp']} {world_size // dense} "
                        "or leave it out")
    expert = (expert_tp or tp) * ep * pp
    if world_size % expert:
        problems.append(f"{n['world_size']} {world_size} is not divisible by {n['expert_tp']}·{n['ep']}·{n['pp']} = "
                        f"{expert_tp or tp}·{ep}·{pp} = {expert}: make it a multiple of {expert} or change "
                        f"{n['expert_tp']}, {n['ep']}, {n['pp']}")
    elif not order.endswith("pp") and pp > 1 and world_size // expert != world_size // dense:
        # otherwise the dense and expert generators would disagree on the pipeline groups
        problems.append(f"{n['order']} {order} with {n['pp']} > 1 needs {n['expert_tp']}·{n['ep']} == "
                        f"{n['tp']}·{n['cp']} (expert DP {world_size // expert} != DP {world_size // dense}): "
                        f"change {n['expert_tp']}/{n['ep']} or use order {ORDERS[0]}")
    return problems


def layers_problem(num_layers: int, pp: int, what: str = "", pp_name: str = "pp") -> "str | None":
    """Megatron-LM splits layers evenly over the pipeline stages; None when ``pp`` divides them."""
    if num_layers % pp == 0:
        return None
    divisors = [p for p in range(1, num_layers + 1) if num_layers % p == 0]
    return (f"{num_layers} layers{what} do not split evenly into {pp_name} = {pp} pipeline stages: use {pp_name} "
            f"among {', '.join(map(str, divisors))}")


def model_problems(model, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, seq_length: "int | None" = None,
                   names: "dict[str, str] | None" = None, expert_tp: "int | None" = None,
                   even_layers: bool = True) -> list[str]:
    """Why ``model`` (a :class:`~megatron_dynapipe.config.model.ModelSpec`) cannot be split this way:
    layers evenly over PP (unless ``even_layers`` is False: the training options split them,
    :mod:`.pipeline_split`), heads and FFN width over TP, experts over EP (their linear biases only
    without expert TP), sequences over 2·CP."""
    n = {**KWARG_NAMES, **(names or {})}
    problems = [layers_problem(model.num_layers, pp, f" of model {model.label}", n["pp"]) if even_layers else None]
    if model.num_attention_heads % tp:
        problems.append(f"{model.num_attention_heads} attention heads of model {model.label} are not divisible by "
                        f"{n['tp']} = {tp}")
    elif model.ffn_hidden_size % tp:
        problems.append(f"FFN width {model.ffn_hidden_size} of model {model.label} is not divisible by {n['tp']} = {tp}")
    problems.append(experts_problem(model.num_experts, ep, n))
    if model.num_experts and model.add_bias_linear and (expert_tp or tp) > 1:
        problems.append(f"MoE with linear biases needs expert tensor parallelism 1 (megatron-core's rule), but it "
                        f"is {expert_tp or tp}{'' if expert_tp else ' (by default, TP)'}: add --disable-bias-linear, "
                        "or set expert TP 1 (etp=1 on a config line, --expert-tensor-parallel-size 1)")
    if seq_length is not None and cp > 1 and seq_length % (2 * cp):
        problems.append(f"{n['seq_length']} {seq_length} is not divisible by 2·{n['cp']} = {2 * cp}")
    return [p for p in problems if p]


def experts_problem(num_experts: int, ep: int, names: "dict[str, str] | None" = None) -> "str | None":
    n = {**KWARG_NAMES, **(names or {})}
    if ep > 1 and not num_experts:
        return f"{n['ep']} {ep} needs a mixture-of-experts model: give {_set(n['num_experts'], 'N')}, a multiple of {ep}"
    if num_experts and num_experts % ep:
        return (f"{_set(n['num_experts'], num_experts)} is not divisible by {n['ep']} {ep}: use a multiple of {ep}")
    return None


def shapes_only_problem(model) -> "str | None":
    """Why ``model`` cannot be traced shapes-only: dropless MoE sizes its all-to-alls by the
    routing, which meta tensors do not compute."""
    if model.num_experts and not (model.moe_expert_capacity_factor and model.moe_pad_expert_input_to_capacity):
        return ("shapes-only MoE needs fixed all-to-all sizes, and dropless routing sizes them from values "
                "meta tensors do not hold: add --moe-expert-capacity-factor F --moe-pad-expert-input-to-capacity "
                "(drop-and-pad), or trace with real compute (--real-compute)")
    return None


def _set(name: str, value: object) -> str:
    """``--flag 4``, ``key=4``, ``name 4``."""
    return f"{name}{value}" if name.endswith("=") else f"{name} {value}"


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel configuration of one Megatron job.

    ``dp`` is derived as ``world_size // (tp * pp * cp)`` when left ``None``; ``expert_tp``
    defaults to ``tp``.  The expert data-parallel size ``expert_dp`` is always derived:
    ``world_size // (expert_tp * ep * pp)``.  Invalid layouts raise a one-line ``ValueError``
    that says what to change (:func:`layout_problems`).
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
        problems = layout_problems(self.world_size, self.tp, self.pp, self.cp, self.ep, self.dp, self.expert_tp,
                                   self.order)
        if problems:
            raise ValueError(problems[0])
        object.__setattr__(self, "dp", self.world_size // (self.tp * self.pp * self.cp))
        if self.expert_tp is None:
            object.__setattr__(self, "expert_tp", self.tp)

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
