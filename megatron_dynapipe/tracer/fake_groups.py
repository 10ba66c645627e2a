"""A fake rank's set-up at a cost that does not grow with W: only its own process groups.

Why
---
megatron-core's ``initialize_model_parallel`` builds every process group of the job on every
rank: torch's ``new_group`` must be entered by all ranks of the world, members or not, so the
function enumerates each kind of group with ``RankGenerator.get_ranks`` (pure Python over all W
ranks) and calls ``parallel_state.create_group`` -> ``torch.distributed.new_group`` for each one,
tens of thousands of calls at W = 8192.  A rank keeps only the groups it belongs to; for the
others ``new_group`` validates the ranks, takes a group name and returns
``GroupMember.NON_GROUP_MEMBER`` (megatron keeps none of those: every assignment in
``initialize_model_parallel`` sits under ``if rank in ranks``, and ``create_group`` only records
member groups in ``_global_process_group_list``).  A fake rank has no peers that need it to take
part, so that work is pure overhead, a few seconds per traced rank at W = 8192.

What
----
:func:`member_groups_only` is a context manager for the fake backend only that, while it is
active, replaces two functions of ``megatron.core.parallel_state`` (module attributes, put back on
exit):

* ``create_group``: a group that contains this rank is created by megatron's own function, as
  before; for a group that does not, the stand-in returns ``GroupMember.NON_GROUP_MEMBER`` at once,
  which is what ``torch.distributed.new_group`` returns there, after doing the two things the real
  call would have left behind: torch's group counter advances by one (it names groups, so this
  rank's groups keep the names ``"<n>"`` a full set-up gives them) and megatron's
  ``_global_process_group_list`` exists.  Calls with ``ranks=None`` or
  ``use_local_synchronization=True`` (which torch answers differently) go to megatron's function.
* ``generate_masked_orthogonal_rank_groups`` (what ``RankGenerator.get_ranks`` calls): the same
  lists of groups, in the same order, from one numpy transpose instead of a Python loop per rank.

So megatron-core still runs its own ``initialize_model_parallel`` and ends in exactly the state a
full set-up leaves (the same groups, ranks, group names and global lists); the loops over the
world remain, but each non-member iteration costs about a microsecond.

One more set-up step grows with W: ``get_megatron_optimizer`` checks that every rank has the same
parameter groups with ``torch.distributed.all_gather_object`` over the whole world, twice.  On the
fake backend that pickles the object into a tensor, all-gathers W copies (the fake all-gather
copies the input into every output) and unpickles W tensors: about 0.25 s per call at W = 8192.
:func:`symmetric_object_gathers` answers it as that call does, with W unpickled copies of this
rank's object, minus the tensors (a job of identical peers, as the recorder's fill assumes).

Guards: the stand-ins refuse to install (:class:`UpstreamChanged`) when the functions they replace
no longer look like the ones they were written against (parameters, the names ``create_group``
uses, the generator's output on small layouts compared with megatron's own), when the torch
internals they touch are gone, when the default process group is not the fake backend, or when
they are already installed.  Tests: ``tests/tracer/test_fake_groups.py`` compares a set-up under
:func:`member_groups_only` with megatron's unaided one, group for group, and the object gathers
with torch's.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from megatron_dynapipe.compat.patching import Patches, UpstreamChanged, check_signature

__all__ = [
    "FakeGroupStats",
    "masked_orthogonal_rank_groups",
    "member_groups_only",
    "symmetric_object_gathers",
]

#: ``parallel_state.create_group``'s parameters in megatron-core 0.16.
CREATE_GROUP_PARAMS = ("ranks", "timeout", "backend", "pg_options", "use_local_synchronization",
                       "group_desc")
#: Global names ``create_group`` must use: it calls ``torch.distributed.new_group`` and records
#: member groups in ``_global_process_group_list`` (the two effects the stand-in reproduces).
CREATE_GROUP_NAMES = ("new_group", "_global_process_group_list", "get_rank")
#: ``parallel_state.generate_masked_orthogonal_rank_groups``'s parameters.
GENERATOR_PARAMS = ("world_size", "parallel_size", "mask")
#: ``torch.distributed.all_gather_object``'s parameters.
ALL_GATHER_OBJECT_PARAMS = ("object_list", "obj", "group")

_MARK = "__dynapipe_fake_groups__"


@dataclass
class FakeGroupStats:
    """What happened while :func:`member_groups_only` was active."""

    rank: int
    #: calls passed on to megatron's ``create_group`` (groups that contain the rank, and the
    #: ``ranks=None`` / ``use_local_synchronization=True`` calls it answers itself)
    created: int = 0
    #: groups that do not, answered ``NON_GROUP_MEMBER`` without ``torch.distributed.new_group``
    skipped: int = 0


# ---------------------------------------------------------------------------------------------
# the rank generator


def masked_orthogonal_rank_groups(world_size: int, parallel_size: Sequence[int],
                                  mask: Sequence[bool]) -> Optional[list[list[int]]]:
    """megatron-core's ``generate_masked_orthogonal_rank_groups`` without the per-rank loop.

    Ranks are mixed-radix numbers over ``parallel_size`` (first axis fastest).  Group ``g``
    holds the ranks whose unmasked coordinates spell ``g`` (first unmasked axis fastest), listed
    with the first masked axis fastest: a C-order grid of the ranks over the reversed sizes,
    transposed so that the unmasked axes come first, reshaped to (groups, group size).  Returns
    ``None`` when ``world_size`` is not the product of the sizes (megatron's RankGenerator never
    asks for that; the caller falls back to megatron's function).
    """
    import numpy as np

    sizes = [int(s) for s in parallel_size]
    if len(mask) != len(sizes) or math.prod(sizes) != world_size:
        return None
    n = len(sizes)
    masked = [i for i in range(n) if mask[i]]
    unmasked = [i for i in range(n) if not mask[i]]
    grid = np.arange(world_size, dtype=np.int64).reshape(sizes[::-1] or [1])
    # numpy axis j is parallel axis n-1-j; in C order the last numpy axis varies fastest
    order = [n - 1 - i for i in reversed(unmasked)] + [n - 1 - i for i in reversed(masked)]
    group_size = math.prod(sizes[i] for i in masked)
    return grid.transpose(order or [0]).reshape(-1, group_size).tolist()


#: small layouts on which the generator must agree with megatron's before it stands in for it
_GENERATOR_PROBES = (
    (24, (2, 3, 4)),
    (48, (2, 1, 3, 1, 8)),
    (16, (2, 2, 2, 2)),
)


_GENERATORS_CHECKED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _check_generator(original) -> None:
    if original in _GENERATORS_CHECKED:  # once per process and function (~20 ms)
        return
    check_signature(original, GENERATOR_PARAMS, REVIEW)
    for world, sizes in _GENERATOR_PROBES:
        for bits in range(2 ** len(sizes)):
            mask = [bool(bits >> i & 1) for i in range(len(sizes))]
            if masked_orthogonal_rank_groups(world, sizes, mask) != original(world, list(sizes), mask):
                raise UpstreamChanged(
                    f"megatron-core's generate_masked_orthogonal_rank_groups{(world, sizes, mask)} "
                    "no longer gives the groups megatron_dynapipe.tracer.fake_groups computes; "
                    "update masked_orthogonal_rank_groups to its new numbering"
                )
    _GENERATORS_CHECKED.add(original)


# ---------------------------------------------------------------------------------------------
# create_group


REVIEW = "megatron_dynapipe/tracer/fake_groups.py"


def _check_create_group(original) -> None:
    check_signature(original, CREATE_GROUP_PARAMS, REVIEW)
    names = set(getattr(getattr(original, "__code__", None), "co_names", ()))
    missing = [name for name in CREATE_GROUP_NAMES if name not in names]
    if missing:
        raise UpstreamChanged(
            f"megatron-core's create_group no longer uses {missing}: it changed what it does "
            "around torch.distributed.new_group; update megatron_dynapipe.tracer.fake_groups"
        )


def _torch_internals():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    sentinel = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    if world is None or not isinstance(getattr(world, "group_count", None), int) or sentinel is None:
        raise UpstreamChanged(
            "torch.distributed no longer has _world.group_count or GroupMember.NON_GROUP_MEMBER, "
            "which megatron_dynapipe.tracer.fake_groups reproduces for non-member groups"
        )
    return world, sentinel


def _require_fake(what: str, because: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"{what} needs the fake process group initialised")
    backend = dist.get_backend()
    if backend != "fake":
        raise RuntimeError(
            f"{what} is for torch's fake backend only (this process group is {backend!r}): "
            f"on a real job {because}"
        )


# ---------------------------------------------------------------------------------------------
# the context managers


@contextlib.contextmanager
def member_groups_only() -> Iterator[FakeGroupStats]:
    """While active, megatron-core's ``parallel_state`` creates only the process groups this
    rank belongs to and enumerates groups without a Python loop per rank (module docstring).

    Only for the fake backend: on a real job every rank must enter every ``new_group``.  Wrap
    ``initialize_model_parallel`` and nothing else; yields a :class:`FakeGroupStats` that counts
    created and skipped groups.  Raises :class:`UpstreamChanged` before touching anything when
    megatron-core or torch changed what is replaced.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    _require_fake("member_groups_only", "every rank must take part in every new_group")
    create_group = vars(ps).get("create_group")
    generator = vars(ps).get("generate_masked_orthogonal_rank_groups")
    if create_group is None or generator is None:
        raise UpstreamChanged(
            "megatron.core.parallel_state has no create_group/generate_masked_orthogonal_rank_groups; "
            "update megatron_dynapipe.tracer.fake_groups"
        )
    if getattr(create_group, _MARK, False) or getattr(generator, _MARK, False):
        raise RuntimeError("member_groups_only is already active")
    _check_create_group(create_group)
    _check_generator(generator)
    world, non_member = _torch_internals()
    if not hasattr(ps, "_global_process_group_list"):
        raise UpstreamChanged("megatron.core.parallel_state has no _global_process_group_list")

    rank = dist.get_rank()
    stats = FakeGroupStats(rank)

    def create_member_group(ranks=None, timeout=None, backend=None, pg_options=None,
                            use_local_synchronization=False, group_desc=None):
        if ranks is None or use_local_synchronization or rank in ranks:
            stats.created += 1
            return create_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                                use_local_synchronization=use_local_synchronization,
                                group_desc=group_desc)
        # what create_group -> new_group leave behind on a non-member rank
        world.group_count += 1  # torch names groups "0", "1", ... in creation order
        if ps._global_process_group_list is None:
            ps._global_process_group_list = [None]  # None stands for the default group
        stats.skipped += 1
        return non_member

    def rank_groups(world_size, parallel_size, mask):
        groups = masked_orthogonal_rank_groups(world_size, parallel_size, mask)
        return generator(world_size, parallel_size, mask) if groups is None else groups

    for fn in (create_member_group, rank_groups):
        setattr(fn, _MARK, True)
    with Patches() as patches:
        patches.set(ps, "create_group", create_member_group)
        patches.set(ps, "generate_masked_orthogonal_rank_groups", rank_groups)
        yield stats


@contextlib.contextmanager
def symmetric_object_gathers() -> Iterator[None]:
    """While active, ``torch.distributed.all_gather_object`` on a fake group fills the list with
    unpickled copies of this rank's object, as the fake backend's own all-gather ends up doing,
    without building W tensors (module docstring).  Other groups go to the function that was
    bound before.  Only for the fake backend; wrap the optimizer's construction, not traced
    steps (the recorder sees the all-gather inside the real call).
    """
    import pickle

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _require_fake("symmetric_object_gathers", "every rank sends its own object")
    bound = dist.all_gather_object  # torch's, or a wrapper of it (shapes-only mode has one)
    if getattr(bound, _MARK, False):
        raise RuntimeError("symmetric_object_gathers is already active")
    check_signature(c10d.all_gather_object, ALL_GATHER_OBJECT_PARAMS, REVIEW)
    _, non_member = _torch_internals()

    def all_gather_object(object_list, obj, group=None):
        if group == non_member or dist.get_backend(group) != "fake":
            return bound(object_list, obj, group)
        blob = pickle.dumps(obj)
        for i in range(dist.get_world_size(group)):
            object_list[i] = pickle.loads(blob)
        return None

    setattr(all_gather_object, _MARK, True)
    with Patches() as patches:
        patches.set(dist, "all_gather_object", all_gather_object)
        yield
