"""Context parallelism's communication for megatron-core's local layer spec, in shapes-only traces.

Megatron-LM runs context parallelism (``--context-parallel-size``) through transformer-engine's
attention: each of the ``c`` ranks of a context-parallel group holds ``s / c`` tokens (two
chunks, for causal balance) and attends to the whole sequence by passing key and value around
the group's ring (``cp_comm_type p2p``, TE's ``AttnFuncWithCPAndKVP2P``):

* forward: ``c - 1`` steps, each sending this rank's K and V to the next rank of the ring and
  receiving the previous rank's, while the attention of the step before is computed;
* backward: ``c`` steps, sending K and V first, then K, V and their gradients, and finally the
  gradients alone, back to the rank they belong to.

megatron-core's local attention refuses ``context_parallel_size > 1``.  A shapes-only trace
(meta tensors, nothing computed) needs only those transfers and the right shapes:
:func:`ring_attention` wraps an attention core so that it is built as for one rank and records
the ring's batched send/receive pairs on the context-parallel group, as TE issues them.  The
core's own arithmetic stays local (``s / c`` queries against ``s / c`` keys); the tracer prices
the missing ``c - 1`` blocks of attention work (:mod:`megatron_dynapipe.tracer.shapes_only_costs`).
Real tensors are refused: numbers need transformer-engine.  Imports torch and megatron-core.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

__all__ = ["ring_attention"]


def ring_attention(core_class):
    """``core_class`` (a megatron-core attention core) with context parallelism's KV ring."""

    class RingAttention(core_class):
        def __init__(self, config, *args, **kwargs):
            super().__init__(dataclasses.replace(config, context_parallel_size=1), *args, **kwargs)
            self.cp_size = config.context_parallel_size

        def forward(self, query, key, value, *args, **kwargs):
            if not query.is_meta:
                raise RuntimeError("context parallelism without transformer-engine runs in shapes-only traces "
                                   "only: install transformer-engine on CUDA to compute it")
            key, value = _KVRing.apply(key, value)
            return super().forward(query, key, value, *args, **kwargs)

    RingAttention.__name__ = RingAttention.__qualname__ = f"Ring{core_class.__name__}"
    return RingAttention


class _KVRing(torch.autograd.Function):
    """Passes K and V around the context-parallel ring (forward) and K, V and their gradients
    back (backward), returning its inputs unchanged."""

    @staticmethod
    def forward(ctx, key, value):
        kv = torch.stack((key, value))
        ctx.kv_shape, ctx.dtype, ctx.device = kv.shape, kv.dtype, kv.device
        for _ in range(_group_size() - 1):
            _exchange(kv)
        return key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx, dkey, dvalue):
        kv = torch.empty(ctx.kv_shape, dtype=ctx.dtype, device=ctx.device)
        dkv = torch.stack((dkey, dvalue))
        steps = _group_size()
        for step in range(steps):
            # K and V first, then K, V and the gradients so far, last the gradients alone
            _exchange(kv if step == 0 else dkv if step == steps - 1 else torch.cat((kv, dkv)))
        return dkey, dvalue


def _group_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size()


def _exchange(tensor: torch.Tensor) -> None:
    """One ring step: send ``tensor`` to the next rank of the group, receive as much from the previous."""
    from megatron.core import parallel_state

    ranks = parallel_state.get_context_parallel_global_ranks()
    me = parallel_state.get_context_parallel_rank()
    group = parallel_state.get_context_parallel_group()
    ops = [dist.P2POp(dist.isend, tensor, ranks[(me + 1) % len(ranks)], group),
           dist.P2POp(dist.irecv, torch.empty_like(tensor), ranks[(me - 1) % len(ranks)], group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
