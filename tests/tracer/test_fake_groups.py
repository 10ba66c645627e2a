"""megatron-core's group set-up for a fake rank, with only the rank's own groups created.

:func:`megatron_dynapipe.tracer.fake_groups.member_groups_only` must leave megatron-core in the
state its unaided ``initialize_model_parallel`` leaves: every group global (ranks, torch's group
name, description), every rank list, ``_global_process_group_list`` and torch's group counter.
At W = 8192 (too slow to compare against the unaided set-up over and over) the groups megatron
reports must be the ones :func:`~megatron_dynapipe.config.layout.rank_groups` computes, and the
number of groups created must not depend on W.
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings

import pytest

from megatron_dynapipe.config.layout import ParallelLayout, rank_groups

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core warns that transformer-engine/apex are absent
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_dynapipe.compat.patching import UpstreamChanged
from megatron_dynapipe.tracer.fake_groups import masked_orthogonal_rank_groups, member_groups_only

ORIGINAL_GENERATOR = ps.generate_masked_orthogonal_rank_groups
ORIGINAL_CREATE_GROUP = ps.create_group
ORIGINAL_ALL_GATHER_OBJECT = dist.all_gather_object


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def initialize(layout: ParallelLayout) -> None:
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        order=layout.order,
        create_gloo_process_groups=False,
    )


def _value(value):
    """A global of parallel_state by value: a process group by its ranks, torch name and
    description; containers element by element; anything else by its type."""
    if isinstance(value, dist.ProcessGroup):
        return ("group", tuple(dist.get_process_group_ranks(value)), c10d._world.pg_names[value],
                getattr(value, "group_desc", None))
    if isinstance(value, (list, tuple)):
        return [_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _value(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def snapshot() -> dict:
    """Everything megatron's set-up leaves in parallel_state (every upper-case global, the group
    list) and torch's group counter and names, by value."""
    out = {name: _value(value) for name, value in vars(ps).items()
           if re.fullmatch(r"_[A-Z0-9_]+", name)}
    out["_global_process_group_list"] = _value(ps._global_process_group_list)
    out["group_count"] = c10d._world.group_count
    out["pg_names"] = sorted(c10d._world.pg_names.values(), key=int)
    return out


def setup(layout: ParallelLayout, rank: int, accelerated: bool):
    with fake_world(rank, layout.world_size):
        start = time.perf_counter()
        if accelerated:
            with member_groups_only() as stats:
                initialize(layout)
        else:
            stats = None
            initialize(layout)
        seconds = time.perf_counter() - start
        return snapshot(), stats, seconds


# --------------------------------------------------------------------------------------------
# the rank generator


@pytest.mark.parametrize("sizes", [(2, 1, 4, 2), (8, 1, 1, 16, 64), (2, 3, 5), (1,), (4, 2, 2, 2, 2)])
def test_generator_gives_megatron_groups_in_megatron_order(sizes):
    import math

    world = math.prod(sizes)
    for bits in range(2 ** len(sizes)):
        mask = [bool(bits >> i & 1) for i in range(len(sizes))]
        assert masked_orthogonal_rank_groups(world, sizes, mask) == ORIGINAL_GENERATOR(world, list(sizes), mask)


def test_generator_declines_worlds_that_are_not_the_product():
    assert masked_orthogonal_rank_groups(10, [2, 3], [True, False]) is None


# --------------------------------------------------------------------------------------------
# the same state as megatron's unaided set-up


SMALL = [
    ParallelLayout(64, tp=2, pp=4, cp=2),
    ParallelLayout(64, tp=2, pp=2, ep=4, expert_tp=1),
    ParallelLayout(64, tp=4, pp=1, ep=2),
    ParallelLayout(64, tp=2, pp=4, ep=2, expert_tp=1, order="tp-cp-ep-pp-dp"),
]


@pytest.mark.parametrize("layout", SMALL, ids=lambda l: l.describe())
def test_state_equals_the_unaided_setup(layout):
    for rank in (0, 5, layout.world_size // 2 + 3, layout.world_size - 1):
        full, _, _ = setup(layout, rank, accelerated=False)
        fast, stats, _ = setup(layout, rank, accelerated=True)
        assert fast == full, f"rank {rank}"
        assert stats.rank == rank and stats.skipped > 0
        # exactly this rank's groups were made (pg_names has the default group too)
        assert stats.created == len(full["pg_names"]) - 1
        assert full["group_count"] == 1 + stats.created + stats.skipped
    assert ps.create_group is ORIGINAL_CREATE_GROUP
    assert ps.generate_masked_orthogonal_rank_groups is ORIGINAL_GENERATOR


# --------------------------------------------------------------------------------------------
# W = 8192


def megatron_groups(rank: int) -> dict:
    """The groups megatron-core reports for this rank, keyed as tracer.topology names them."""
    def ranks(group):
        return tuple(sorted(dist.get_process_group_ranks(group)))

    out = {
        "tp": ranks(ps.get_tensor_model_parallel_group()),
        "pp": ranks(ps.get_pipeline_model_parallel_group()),
        "dp": ranks(ps.get_data_parallel_group()),
        "dp-cp": ranks(ps.get_data_parallel_group(with_context_parallel=True)),
        "cp": ranks(ps.get_context_parallel_group()),
        "tp-pp": ranks(ps.get_model_parallel_group()),
        "tp-cp": ranks(ps.get_tensor_and_context_parallel_group()),
        "tp-dp": ranks(ps.get_tensor_and_data_parallel_group()),
        "tp-dp-cp": ranks(ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
        "ep": ranks(ps.get_expert_model_parallel_group()),
        "expert-tp": ranks(ps.get_expert_tensor_parallel_group()),
        "expert-dp": ranks(ps.get_expert_data_parallel_group()),
        "expert-tp-ep": ranks(ps.get_expert_tensor_and_model_parallel_group()),
        "expert-tp-ep-pp": ranks(ps.get_expert_tensor_model_pipeline_parallel_group()),
    }
    # megatron keeps the embedding groups on their members only
    for kind, group in (("embedding", ps._EMBEDDING_GROUP), ("position-embedding", ps._POSITION_EMBEDDING_GROUP)):
        out[kind] = None if group is None else ranks(group)
    return out


BIG = [
    ParallelLayout(8192, tp=8, pp=16),
    ParallelLayout(8192, tp=2, pp=2),
    ParallelLayout(8192, tp=2, pp=4, ep=8, expert_tp=1),
    ParallelLayout(8192, tp=4, pp=8, cp=2, ep=2, order="tp-cp-ep-pp-dp"),
]


@pytest.mark.parametrize("layout", BIG, ids=lambda l: l.describe())
def test_groups_at_8192_are_the_topologys(layout):
    created = set()
    for rank in (0, 1, 3000, 4097, 8191):
        with fake_world(rank, layout.world_size):
            with member_groups_only() as stats:
                initialize(layout)
            got = megatron_groups(rank)
        expected = rank_groups(layout, rank)
        for kind, value in got.items():
            if kind in ("embedding", "position-embedding") and rank not in expected[kind]:
                assert value is None, (rank, kind)
            else:
                assert value == expected[kind], (rank, kind)
        created.add(stats.created)
        assert stats.created <= 20 and stats.created + stats.skipped > layout.world_size
    assert max(created) - min(created) <= 2  # embedding groups: first/last stages have more


def test_groups_created_do_not_grow_with_the_world():
    counts = {}
    for world in (1024, 8192):
        layout = ParallelLayout(world, tp=8, pp=4)
        with fake_world(8, world):
            with member_groups_only() as stats:
                initialize(layout)
        counts[world] = stats.created
    assert counts[1024] == counts[8192]


# --------------------------------------------------------------------------------------------
# guards


def test_refuses_backends_other_than_fake():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="fake backend only"):
            with member_groups_only():
                pass
    finally:
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="initialised"):
        with member_groups_only():
            pass


def test_refuses_an_upstream_create_group_that_changed(monkeypatch):
    def create_group(ranks=None, timeout=None, backend=None, pg_options=None, group_desc=None):
        return dist.new_group(ranks)

    monkeypatch.setattr(ps, "create_group", create_group)
    with fake_world(0, 8), pytest.raises(UpstreamChanged, match="takes"):
        with member_groups_only():
            pass
    assert ps.create_group is create_group

    def same_signature(ranks=None, timeout=None, backend=None, pg_options=None,
                       use_local_synchronization=False, group_desc=None):
        return dist.new_group(ranks)  # no longer records member groups

    monkeypatch.setattr(ps, "create_group", same_signature)
    with fake_world(0, 8), pytest.raises(UpstreamChanged, match="_global_process_group_list"):
        with member_groups_only():
            pass


def test_refuses_an_upstream_generator_that_numbers_differently(monkeypatch):
    def reversed_groups(world_size, parallel_size, mask):
        return [list(reversed(g)) for g in ORIGINAL_GENERATOR(world_size, parallel_size, mask)]

    monkeypatch.setattr(ps, "generate_masked_orthogonal_rank_groups", reversed_groups)
    with fake_world(0, 8), pytest.raises(UpstreamChanged, match="numbering"):
        with member_groups_only():
            pass
    assert ps.generate_masked_orthogonal_rank_groups is reversed_groups


def test_refuses_missing_torch_internals(monkeypatch):
    from megatron_dynapipe.tracer.fake_groups import _torch_internals

    assert _torch_internals() == (c10d._world, dist.GroupMember.NON_GROUP_MEMBER)
    # checked directly: without these, torch.distributed itself stops working
    monkeypatch.delattr(dist.GroupMember, "NON_GROUP_MEMBER")
    with pytest.raises(UpstreamChanged, match="NON_GROUP_MEMBER"):
        _torch_internals()
    monkeypatch.undo()
    monkeypatch.setattr(c10d, "_world", object())
    with pytest.raises(UpstreamChanged, match="group_count"):
        _torch_internals()


def test_is_not_reentrant_and_puts_everything_back_after_an_error():
    with fake_world(0, 8):
        with pytest.raises(ZeroDivisionError):
            with member_groups_only():
                assert ps.create_group is not ORIGINAL_CREATE_GROUP
                with pytest.raises(RuntimeError, match="already active"):
                    with member_groups_only():
                        pass
                1 / 0
    assert ps.create_group is ORIGINAL_CREATE_GROUP
    assert ps.generate_masked_orthogonal_rank_groups is ORIGINAL_GENERATOR


# --------------------------------------------------------------------------------------------
# the optimizer's object all-gather


KEYS = [((("wd_mult", 1.0), ("lr_mult", 1.0)), None), ((("wd_mult", 0.0),), "decoupled")]


def test_object_gathers_give_what_the_fake_backend_gives():
    from megatron_dynapipe.tracer.fake_groups import symmetric_object_gathers

    with fake_world(5, 16):
        sub = dist.new_group([4, 5, 6])
        other = dist.new_group([0, 1])  # not a member: NON_GROUP_MEMBER
        expected = {}
        for name, group, size in (("world", None, 16), ("sub", sub, 3)):
            expected[name] = [None] * size
            dist.all_gather_object(expected[name], KEYS, group=group)
        with symmetric_object_gathers():
            assert dist.all_gather_object is not ORIGINAL_ALL_GATHER_OBJECT
            for name, group, size in (("world", None, 16), ("sub", sub, 3)):
                got = [None] * size
                dist.all_gather_object(got, KEYS, group)
                assert got == expected[name] == [KEYS] * size
                assert len({id(x) for x in got}) == size and all(x is not KEYS for x in got)
            untouched = ["x", "y"]
            with pytest.warns(UserWarning, match="does not belong"):
                assert dist.all_gather_object(untouched, KEYS, group=other) is None
            assert untouched == ["x", "y"]
            with pytest.raises(RuntimeError, match="already active"):
                with symmetric_object_gathers():
                    pass
        assert dist.all_gather_object is ORIGINAL_ALL_GATHER_OBJECT


def test_object_gathers_keep_a_wrapper_they_replace_and_refuse_real_backends(monkeypatch):
    from megatron_dynapipe.tracer.fake_groups import symmetric_object_gathers

    calls = []

    def wrapper(*args, **kwargs):  # as shapes-only mode's MetaMode binds one
        calls.append(args)
        return ORIGINAL_ALL_GATHER_OBJECT(*args, **kwargs)

    monkeypatch.setattr(dist, "all_gather_object", wrapper)
    with fake_world(0, 4):
        with symmetric_object_gathers():
            out = [None] * 4
            dist.all_gather_object(out, 7)
        assert out == [7] * 4 and not calls and dist.all_gather_object is wrapper

        monkeypatch.setattr(c10d, "all_gather_object", lambda object_list, obj: None)
        with pytest.raises(UpstreamChanged, match="takes"):
            with symmetric_object_gathers():
                pass
        assert dist.all_gather_object is wrapper
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="fake backend only"):
            with symmetric_object_gathers():
                pass
    finally:
        dist.destroy_process_group()
