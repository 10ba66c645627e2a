"""megatron_dynapipe.config.layout against megatron-core's own rank generator.

megatron-core builds its groups with two ``RankGenerator``s inside
``parallel_state.initialize_model_parallel``: the decoder one (tp, cp, dp, pp; ep=1) and the
expert one (tp=expert_tp, ep, dp=expert_dp, pp; cp=1).  These tests rebuild both exactly as that
function does and check every group kind, every rank's coordinates and the representative
ranks against them; one test also runs ``initialize_model_parallel`` itself on torch's fake
process group and reads back the groups of a few ranks.
"""

from __future__ import annotations

import itertools
import math
import random
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.parallel_state import RankGenerator

from megatron_dynapipe.config.layout import (
    GROUP_KINDS,
    ORDERS,
    DenseCoords,
    ExpertCoords,
    ParallelLayout,
    all_groups,
    dense_coords,
    dense_rank,
    expert_coords,
    expert_rank,
    group_ranks,
    rank_groups,
)
from megatron_dynapipe.tracer.representatives import reduction, representative_ranks

# our kind -> (which megatron generator, the token passed to RankGenerator.get_ranks)
MEGATRON_TOKENS = {
    "tp": ("decoder", "tp"),
    "cp": ("decoder", "cp"),
    "dp": ("decoder", "dp"),
    "dp-cp": ("decoder", "dp-cp"),
    "pp": ("decoder", "pp"),
    "tp-pp": ("decoder", "tp-pp"),
    "tp-cp": ("decoder", "tp-cp"),
    "tp-dp": ("decoder", "tp-dp"),
    "tp-dp-cp": ("decoder", "tp-dp-cp"),
    "ep": ("expert", "ep"),
    "expert-tp": ("expert", "tp"),
    "expert-dp": ("expert", "dp"),
    "expert-tp-ep": ("expert", "tp-ep"),
    "expert-tp-ep-pp": ("expert", "tp-ep-pp"),
}


def megatron_generators(layout: ParallelLayout) -> dict[str, RankGenerator]:
    """The two generators exactly as ``initialize_model_parallel`` constructs them."""
    decoder = RankGenerator(
        tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order=layout.order
    )
    expert = RankGenerator(
        tp=layout.expert_tp,
        ep=layout.ep,
        dp=layout.expert_dp,
        pp=layout.pp,
        cp=1,
        order=layout.order,
    )
    return {"decoder": decoder, "expert": expert}


def megatron_groups(layout: ParallelLayout) -> dict[str, list[list[int]]]:
    gens = megatron_generators(layout)
    out = {kind: gens[g].get_ranks(token) for kind, (g, token) in MEGATRON_TOKENS.items()}
    # initialize_model_parallel: one embedding / position-embedding group per pipeline group,
    # from the default rank selectors
    out["embedding"] = [ps.default_embedding_ranks(r) for r in out["pp"]]
    out["position-embedding"] = [ps.default_position_embedding_ranks(r) for r in out["pp"]]
    return out


def sample_ranks(layout: ParallelLayout, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    edge = {0, min(1, layout.world_size - 1), layout.world_size // 2, layout.world_size - 1}
    return sorted(edge | {rng.randrange(layout.world_size) for _ in range(n)})


def check_against_megatron(layout: ParallelLayout, n_ranks: int = 24, seed: int = 0) -> None:
    ref = megatron_groups(layout)
    assert set(ref) == set(GROUP_KINDS)
    gens = megatron_generators(layout)
    # invariant megatron-core asserts; a layout we accept must satisfy it
    assert gens["decoder"].get_ranks("pp") == gens["expert"].get_ranks("pp")
    for kind in GROUP_KINDS:
        ours = all_groups(layout, kind)
        assert ours == [tuple(g) for g in ref[kind]], (layout, kind)
    ranks = sample_ranks(layout, n_ranks, seed)
    for kind in GROUP_KINDS:
        if kind in ("embedding", "position-embedding"):
            pp_of = {r: tuple(g) for g in ref["pp"] for r in g}
            for r in ranks:
                pp = list(pp_of[r])
                expect = (
                    ps.default_embedding_ranks(pp)
                    if kind == "embedding"
                    else ps.default_position_embedding_ranks(pp)
                )
                assert group_ranks(layout, r, kind) == tuple(expect)
            continue
        owner = {r: tuple(sorted(g)) for g in ref[kind] for r in g}
        for r in ranks:
            assert group_ranks(layout, r, kind) == owner[r], (layout, kind, r)
    for r in ranks[:6]:
        groups = rank_groups(layout, r)
        assert groups == {k: group_ranks(layout, r, k) for k in GROUP_KINDS}


def check_coords(layout: ParallelLayout, n_ranks: int = 24, seed: int = 0) -> None:
    gens = megatron_generators(layout)
    dense_tp = {r: i for g in gens["decoder"].get_ranks("tp") for i, r in enumerate(g)}
    dense_cp = {r: i for g in gens["decoder"].get_ranks("cp") for i, r in enumerate(g)}
    dense_dp = {r: i for g in gens["decoder"].get_ranks("dp") for i, r in enumerate(g)}
    dense_pp = {r: i for g in gens["decoder"].get_ranks("pp") for i, r in enumerate(g)}
    e_tp = {r: i for g in gens["expert"].get_ranks("tp") for i, r in enumerate(g)}
    e_ep = {r: i for g in gens["expert"].get_ranks("ep") for i, r in enumerate(g)}
    e_dp = {r: i for g in gens["expert"].get_ranks("dp") for i, r in enumerate(g)}
    for r in sample_ranks(layout, n_ranks, seed):
        c = dense_coords(layout, r)
        assert c == DenseCoords(dense_tp[r], dense_cp[r], dense_dp[r], dense_pp[r])
        assert dense_rank(layout, *c) == r
        e = expert_coords(layout, r)
        assert e == ExpertCoords(e_tp[r], e_ep[r], e_dp[r], dense_pp[r])
        assert expert_rank(layout, *e) == r


def check_representatives(layout: ParallelLayout) -> None:
    # dense: exactly the ranks with tp = cp = dp = 0, one per stage
    reps = representative_ranks(layout, moe=False)
    expected = [
        r
        for r in range(layout.world_size)
        if dense_coords(layout, r)[:3] == (0, 0, 0)
    ] if layout.world_size <= 1024 else [
        dense_rank(layout, 0, 0, 0, s) for s in range(layout.pp)
    ]
    assert sorted(reps.global_ranks) == sorted(expected)
    assert [r.stage for r in reps] == list(range(layout.pp))
    pp_groups = megatron_generators(layout)["decoder"].get_ranks("pp")
    for rep in reps:
        assert rep.coords == DenseCoords(0, 0, 0, rep.stage)
        assert rep.coords == dense_coords(layout, rep.global_rank)
        assert rep.ep_rank == 0
        # every stage of one pipeline: the reps form the pipeline group of rank 0
    assert list(reps.global_ranks) == pp_groups[0]
    if layout.order == "tp-cp-ep-dp-pp":
        assert list(reps.global_ranks) == [
            s * layout.tp * layout.cp * layout.dp for s in range(layout.pp)
        ]
    else:
        assert list(reps.global_ranks) == [s * layout.tp * layout.cp for s in range(layout.pp)]
    assert reps.reduction == layout.world_size / layout.pp == reduction(layout, reps)

    # MoE: one per (stage, ep rank), expert coordinates etp = edp = 0
    moe = representative_ranks(layout, moe=True)
    assert len(moe) == layout.pp * layout.ep
    assert len(set(moe.global_ranks)) == len(moe)
    assert sorted((r.stage, r.ep_rank) for r in moe) == list(
        itertools.product(range(layout.pp), range(layout.ep))
    )
    for rep in moe:
        assert rep.expert_coords == ExpertCoords(0, rep.ep_rank, 0, rep.stage)
        assert rep.coords == dense_coords(layout, rep.global_rank)
        assert rep.coords.pp == rep.stage
    # one EP group per stage: the reps of a stage are that stage's EP group of rank stage-0
    for stage in range(layout.pp):
        stage_ranks = tuple(sorted(r.global_rank for r in moe if r.stage == stage))
        assert stage_ranks == group_ranks(layout, stage_ranks[0], "ep")
    assert moe.reduction == layout.world_size / (layout.pp * layout.ep)

    # opting into every CP rank multiplies the dense set by CP
    every = representative_ranks(layout, moe=False, every_cp_rank=True)
    assert len(every) == layout.pp * layout.cp
    assert {r.coords.cp for r in every} == set(range(layout.cp))
    assert all(r.coords.tp == 0 and r.coords.dp == 0 for r in every)


# --------------------------------------------------------------------------------------------
# parametrised sweep

SWEEP = [
    # world, tp, pp, cp, ep, expert_tp, order
    (1, 1, 1, 1, 1, None, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 1, 1, None, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 1, 1, None, "tp-cp-ep-pp-dp"),
    (16, 2, 2, 2, 1, None, "tp-cp-ep-dp-pp"),
    (16, 2, 2, 2, 2, None, "tp-cp-ep-pp-dp"),  # dp-last: expert_tp*ep must equal tp*cp
    (24, 2, 3, 1, 1, None, "tp-cp-ep-dp-pp"),
    (24, 1, 3, 2, 2, None, "tp-cp-ep-dp-pp"),
    (32, 2, 2, 1, 4, 1, "tp-cp-ep-dp-pp"),
    (32, 2, 2, 1, 2, 1, "tp-cp-ep-pp-dp"),
    (48, 2, 2, 2, 2, 2, "tp-cp-ep-pp-dp"),
    (64, 4, 4, 1, 2, 2, "tp-cp-ep-dp-pp"),
    (64, 2, 2, 2, 4, 1, "tp-cp-ep-dp-pp"),
    (64, 1, 1, 4, 8, 2, "tp-cp-ep-pp-dp"),
    (96, 2, 4, 3, 2, None, "tp-cp-ep-dp-pp"),
    (128, 8, 8, 1, 1, None, "tp-cp-ep-pp-dp"),
    (256, 4, 8, 2, 4, 1, "tp-cp-ep-dp-pp"),
    (1024, 8, 4, 1, 8, 1, "tp-cp-ep-dp-pp"),
    (1024, 4, 8, 2, 2, None, "tp-cp-ep-pp-dp"),
    (2048, 8, 16, 2, 4, 2, "tp-cp-ep-dp-pp"),
    (4096, 4, 32, 1, 4, 1, "tp-cp-ep-pp-dp"),
    (8192, 8, 16, 1, 1, None, "tp-cp-ep-dp-pp"),
    (8192, 8, 32, 2, 8, 2, "tp-cp-ep-dp-pp"),
    (8192, 2, 2, 4, 8, 1, "tp-cp-ep-pp-dp"),
]


@pytest.mark.parametrize("world,tp,pp,cp,ep,etp,order", SWEEP)
@pytest.mark.slow
def test_sweep_matches_megatron(world, tp, pp, cp, ep, etp, order):
    layout = ParallelLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=etp, order=order)
    assert layout.tp * layout.pp * layout.cp * layout.dp == world
    assert layout.expert_tp * layout.ep * layout.pp * layout.expert_dp == world
    check_against_megatron(layout)
    check_coords(layout)
    check_representatives(layout)


# --------------------------------------------------------------------------------------------
# hypothesis


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def layouts(draw, max_world: int = 8192):
    sizes = st.sampled_from([1, 1, 2, 2, 3, 4, 4, 8, 16])
    tp, cp, pp = draw(sizes), draw(sizes), draw(st.sampled_from([1, 2, 3, 4, 8, 16, 32]))
    room = max_world // (tp * cp * pp)
    if room < 1:
        tp = cp = 1
        room = max_world // pp
    dp = draw(st.integers(1, min(room, 64)))
    world = tp * cp * pp * dp
    order = draw(st.sampled_from(ORDERS))
    if order.endswith("dp") and pp > 1:
        # megatron-core needs expert_tp * ep == tp * cp here
        etp = draw(st.sampled_from(_divisors(tp * cp)))
        ep = tp * cp // etp
    else:
        per_stage = world // pp
        etp = draw(st.sampled_from(_divisors(per_stage)))
        ep = draw(st.sampled_from(_divisors(per_stage // etp)))
    return ParallelLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=etp, order=order)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.integers(0, 2**16))
@pytest.mark.slow
def test_hypothesis_matches_megatron(layout, seed):
    check_against_megatron(layout, n_ranks=8, seed=seed)
    check_coords(layout, n_ranks=8, seed=seed)
    check_representatives(layout)


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_round_trip_and_group_structure(layout, data):
    """Pure properties, no megatron call: cheap enough for many more layouts."""
    rank = data.draw(st.integers(0, layout.world_size - 1))
    c = dense_coords(layout, rank)
    assert dense_rank(layout, *c) == rank
    e = expert_coords(layout, rank)
    assert expert_rank(layout, *e) == rank
    assert e.pp == c.pp
    groups = rank_groups(layout, rank)
    sizes = {
        "tp": layout.tp,
        "cp": layout.cp,
        "dp": layout.dp,
        "dp-cp": layout.dp * layout.cp,
        "pp": layout.pp,
        "tp-pp": layout.tp * layout.pp,
        "tp-cp": layout.tp * layout.cp,
        "tp-dp": layout.tp * layout.dp,
        "tp-dp-cp": layout.tp * layout.dp * layout.cp,
        "ep": layout.ep,
        "expert-tp": layout.expert_tp,
        "expert-dp": layout.expert_dp,
        "expert-tp-ep": layout.expert_tp * layout.ep,
        "expert-tp-ep-pp": layout.expert_tp * layout.ep * layout.pp,
        "embedding": min(2, layout.pp),
        "position-embedding": 1,
    }
    for kind, ranks in groups.items():
        assert len(ranks) == sizes[kind] == len(set(ranks)), kind
        assert list(ranks) == sorted(ranks)
        if kind not in ("embedding", "position-embedding"):
            assert rank in ranks
            # groups partition the world: every member maps back to the same group
            other = data.draw(st.sampled_from(ranks))
            assert group_ranks(layout, other, kind) == ranks
    # members of a group differ only on the group's axes
    for other in groups["dp-cp"]:
        oc = dense_coords(layout, other)
        assert (oc.tp, oc.pp) == (c.tp, c.pp)
    for other in groups["ep"]:
        oe = expert_coords(layout, other)
        assert (oe.etp, oe.edp, oe.pp) == (e.etp, e.edp, e.pp)
    # pipeline: stage s of the group is the member with pp coordinate s
    assert [dense_coords(layout, r).pp for r in groups["pp"]] == list(range(layout.pp))
    assert (rank in groups["embedding"]) == (c.pp in (0, layout.pp - 1))
    assert (rank in groups["position-embedding"]) == (c.pp == 0)


# --------------------------------------------------------------------------------------------
# the real initialize_model_parallel on torch's fake process group


FAKE_PG_CASES = [
    # world, tp, pp, cp, ep, etp, order, ranks to impersonate
    (16, 2, 2, 2, 1, None, "tp-cp-ep-dp-pp", [0, 5, 10, 15]),
    (32, 2, 4, 1, 4, 1, "tp-cp-ep-dp-pp", [0, 9, 17, 31]),
    (32, 2, 2, 2, 2, 2, "tp-cp-ep-pp-dp", [3, 12, 30]),
    (8192, 8, 16, 1, 1, None, "tp-cp-ep-dp-pp", [512]),
]


def test_initialize_model_parallel_on_fake_pg(monkeypatch):
    pytest.importorskip("torch")
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch fake process group unavailable: {exc}")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this test process")

    def ranks_of(group):
        return tuple(sorted(dist.get_process_group_ranks(group)))

    for world, tp, pp, cp, ep, etp, order, ranks in FAKE_PG_CASES:
        layout = ParallelLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=etp, order=order)
        for rank in ranks:
            # destroy_model_parallel() leaves these two behind; start each rank from None
            monkeypatch.setattr(ps, "_EMBEDDING_GLOBAL_RANKS", None)
            monkeypatch.setattr(ps, "_POSITION_EMBEDDING_GLOBAL_RANKS", None)
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            try:
                ps.initialize_model_parallel(
                    tensor_model_parallel_size=tp,
                    pipeline_model_parallel_size=pp,
                    context_parallel_size=cp,
                    expert_model_parallel_size=ep,
                    expert_tensor_parallel_size=etp,
                    order=order,
                    create_gloo_process_groups=False,
                )
                got = {
                    "tp": ranks_of(ps.get_tensor_model_parallel_group()),
                    "cp": ranks_of(ps.get_context_parallel_group()),
                    "dp": ranks_of(ps.get_data_parallel_group()),
                    "dp-cp": ranks_of(ps.get_data_parallel_group(with_context_parallel=True)),
                    "pp": ranks_of(ps.get_pipeline_model_parallel_group()),
                    "tp-pp": ranks_of(ps.get_model_parallel_group()),
                    "tp-cp": ranks_of(ps.get_tensor_and_context_parallel_group()),
                    "tp-dp": ranks_of(ps.get_tensor_and_data_parallel_group()),
                    "tp-dp-cp": ranks_of(
                        ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
                    ),
                    "ep": ranks_of(ps.get_expert_model_parallel_group()),
                    "expert-tp": ranks_of(ps.get_expert_tensor_parallel_group()),
                    "expert-dp": ranks_of(ps.get_expert_data_parallel_group()),
                    "expert-tp-ep": ranks_of(ps.get_expert_tensor_and_model_parallel_group()),
                    "expert-tp-ep-pp": ranks_of(
                        ps.get_expert_tensor_model_pipeline_parallel_group()
                    ),
                }
                ours = rank_groups(layout, rank)
                for kind, ranks_ in got.items():
                    assert ours[kind] == ranks_, (layout, rank, kind)
                # embedding groups: megatron only records them on member ranks
                for kind, attr in (
                    ("embedding", "_EMBEDDING_GLOBAL_RANKS"),
                    ("position-embedding", "_POSITION_EMBEDDING_GLOBAL_RANKS"),
                ):
                    recorded = getattr(ps, attr)
                    if rank in ours[kind]:
                        assert tuple(recorded) == ours[kind], (layout, rank, kind)
                    else:
                        assert recorded is None, (layout, rank, kind)
            finally:
                ps.destroy_model_parallel()
                dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# validation, speed


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=0), r"world_size must be a positive integer"),
        (dict(world_size=2**30), r"world_size 1,073,741,824 is over the 1,048,576 GPUs a layout may have"),
        (dict(world_size=8, tp=0), r"tp must be a positive integer"),
        (dict(world_size=8, tp=True), r"tp must be a positive integer"),
        (dict(world_size=8, pp=2.0), r"pp must be a positive integer"),
        (dict(world_size=8, cp=-2), r"cp must be a positive integer"),
        (dict(world_size=8, ep=0), r"ep must be a positive integer"),
        (dict(world_size=8, dp=0), r"dp must be a positive integer or left out, got 0"),
        (dict(world_size=8, expert_tp=0), r"expert_tp must be a positive integer or left out"),
        (dict(world_size=12, tp=8), r"world_size 12 is not divisible by tp·pp·cp = 8·1·1 = 8: make it a multiple of 8"),
        (dict(world_size=24, tp=2, pp=2, cp=4), r"not divisible by tp·pp·cp = 2·2·4 = 16"),
        (dict(world_size=16, tp=2, dp=4), r"dp 4 does not match world_size/\(tp·pp·cp\) = 16/2 = 8: pass dp 8"),
        (dict(world_size=24, tp=2, ep=8), r"not divisible by expert_tp·ep·pp = 2·8·1 = 16"),
        (dict(world_size=24, tp=3, expert_tp=2, ep=8), r"expert_tp·ep·pp = 2·8·1 = 16"),
        (dict(world_size=8, order="tp-dp-pp"), r"order tp-dp-pp is not a Megatron rank order: use one of"),
        (
            dict(world_size=32, tp=2, pp=2, ep=4, order="tp-cp-ep-pp-dp"),
            r"needs expert_tp·ep == tp·cp",
        ),
    ],
)
def test_invalid_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        ParallelLayout(**kwargs)
    assert "\n" not in str(info.value)


def test_invalid_layout_agrees_with_megatron():
    """The dp-last/expert mismatch we reject is one megatron-core's generators disagree on."""
    world, tp, pp, ep = 32, 2, 2, 4
    decoder = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-pp-dp")
    expert = RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-pp-dp")
    assert decoder.get_ranks("pp") != expert.get_ranks("pp")


def test_bad_queries():
    layout = ParallelLayout(16, tp=2, pp=2)
    with pytest.raises(ValueError, match="outside the job"):
        group_ranks(layout, 16, "tp")
    with pytest.raises(ValueError, match="outside the job"):
        dense_coords(layout, -1)
    with pytest.raises(ValueError, match="unknown group kind 'xx'"):
        group_ranks(layout, 0, "xx")
    with pytest.raises(ValueError, match="unknown group kind"):
        all_groups(layout, "data")
    with pytest.raises(ValueError, match=r"dp=4 is out of range; pass 0 <= dp < 4"):
        dense_rank(layout, dp=4)
    with pytest.raises(ValueError, match=r"ep=1 is out of range"):
        expert_rank(layout, ep=1)
    with pytest.raises(ValueError, match="no representative ranks"):
        reduction(layout, [])


def test_defaults_and_derived_sizes():
    layout = ParallelLayout(8192, tp=8, pp=16)
    assert (layout.dp, layout.expert_tp, layout.expert_dp, layout.cp, layout.ep) == (64, 8, 64, 1, 1)
    assert layout.order == "tp-cp-ep-dp-pp"
    assert not layout.is_moe
    assert ParallelLayout(8192, tp=8, pp=16) == layout and hash(ParallelLayout(8192, tp=8, pp=16)) == hash(layout)
    assert "DP=64" in layout.describe()
    moe = ParallelLayout(64, tp=2, pp=2, ep=4, expert_tp=1)
    assert moe.is_moe and moe.expert_dp == 8
    with pytest.raises(Exception):
        layout.tp = 4  # frozen


def test_representatives_of_a_large_job():
    layout = ParallelLayout(8192, tp=8, pp=16)
    reps = representative_ranks(layout)
    assert reps.global_ranks == tuple(512 * s for s in range(16))
    assert reps.reduction == 512.0
    assert reps[1].global_rank == 512 and reps[1].coords == DenseCoords(0, 0, 0, 1)
    moe = representative_ranks(ParallelLayout(8192, tp=8, pp=16, ep=8, expert_tp=1), moe=True)
    assert len(moe) == 128 and moe.reduction == 64.0
    # etp=1, ep=8 spans one dense TP group: EP rank k sits on dense tp=k
    assert [r.coords.tp for r in moe if r.stage == 3] == list(range(8))
    # CP: one CP rank by default
    cp = representative_ranks(ParallelLayout(8192, tp=8, pp=8, cp=4))
    assert len(cp) == 8 and all(r.coords.cp == 0 for r in cp)


def test_one_rank_queries_answer_for_that_rank_alone():
    """A rank's groups come from its coordinates (how long that takes is bench_topology's)."""
    layout = ParallelLayout(8192, tp=1, pp=2, cp=1)  # dp groups of 4096 ranks: the worst case
    for rank in (0, 4095, 4096, 8191):
        groups = rank_groups(layout, rank)
        assert groups["dp"] == tuple(range(rank // 4096 * 4096, rank // 4096 * 4096 + 4096))
        assert groups["pp"] == (rank % 4096, rank % 4096 + 4096)
    layout = ParallelLayout(8192, tp=8, pp=16, ep=8, expert_tp=1)
    assert rank_groups(layout, 512)["tp"] == tuple(range(512, 520))
    assert math.isclose(representative_ranks(layout).reduction, 512.0)
