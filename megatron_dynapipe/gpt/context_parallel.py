"""Context parallelism for megatron-core's local layer spec: the KV ring over the CP group.

Megatron-LM runs context parallelism (``--context-parallel-size``) through transformer-engine's
attention: each of the ``c`` ranks of a context-parallel group holds ``s / c`` tokens of every
sequence -- chunks ``r`` and ``2c - 1 - r`` of its ``2c`` equal chunks, for causal balance
(megatron-core's ``get_batch_on_this_cp_rank``) -- and attends to the whole sequence by passing
keys and values around the group's ring (``cp_comm_type p2p``, TE's ``AttnFuncWithCPAndKVP2P``).
megatron-core's local attention refuses ``context_parallel_size > 1``; :func:`ring_attention`
wraps a local attention core (megatron-core's, or :class:`~megatron_dynapipe.gpt.attention.SDPAttention`)
so that it runs under context parallelism without transformer-engine:

* **Real tensors** (the CPU over gloo, or a GPU without TE): the ``c - 1`` ring steps bring every
  other rank's keys and values, each step a send to the next rank and a receive from the previous
  one (backward passes their gradients the other way round the ring); the core then attends this
  rank's queries to the whole sequence, each query to the keys at or before its own position.
  Padded (``[s, b, ...]``) and packed (THD) micro-batches: a packed micro-batch's ``cu_seqlens``
  are the whole samples' (each a multiple of ``2c`` tokens), and each rank holds chunks ``r`` and
  ``2c - 1 - r`` of every sample, as transformer-engine splits them.
* **Shapes-only traces** (meta tensors, nothing computed): only the transfers and shapes matter.
  The core is built as for one rank, computes ``s / c`` queries against ``s / c`` keys, and records
  the ring's send/receive pairs as TE issues them (forward: ``c - 1`` steps of K and V; backward:
  ``c`` steps, K and V first, then with their gradients, the gradients alone last); the tracer
  prices the missing ``c - 1`` blocks of attention work (:mod:`megatron_dynapipe.tracer.shapes_only_costs`).

Imports torch and megatron-core.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType

from megatron_dynapipe.gpt.attention import SDPAttention, every_heads_keys, segment_bounds

__all__ = ["ring_attention", "batch_on_this_cp_rank", "sequence_chunk_positions"]

#: A rank's tokens of a sequence from which the CPU attends block by block: below it the blocks'
#: three kernel calls and their merge cost more than the score matrix they skip (forward and backward
#: on this project's 2-core CPU, 8 heads of 16, CP 2: 0.3 against 0.12 ms at 32 tokens a rank, even
#: at 128, 2.5 against 3.9 ms at 256 and 129 against 280 ms at 2048).
BLOCKWISE_MIN_TOKENS = 128


def ring_attention(core_class):
    """``core_class`` (a megatron-core local attention core) with context parallelism's KV ring."""

    class RingAttention(core_class):
        def __init__(self, config, *args, **kwargs):
            super().__init__(dataclasses.replace(config, context_parallel_size=1), *args, **kwargs)
            self.cp_size = config.context_parallel_size

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if query.is_meta:
                key, value = _KVRing.apply(key, value)
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias=attention_bias,
                                       packed_seq_params=_rank_shares(packed_seq_params, self.cp_size))
            if (attn_mask_type or self.attn_mask_type) != AttnMaskType.causal or attention_mask is not None \
                    or attention_bias is not None:
                raise ValueError("context parallelism without transformer-engine runs causal self-attention "
                                 "only (no attention mask or bias)")
            if self.training and self.attention_dropout.p:
                raise ValueError("context parallelism without transformer-engine draws no attention dropout: "
                                 "set --attention-dropout 0")
            blocks = _gather_over_ring(torch.stack((key, value)))  # each rank's [2, local tokens, ...]
            if packed_seq_params is None:
                return self._attend_whole(query, blocks, seq_dim=0)
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"context parallelism packs only the thd format, got {packed_seq_params.qkv_format!r}")
            return self._attend_packed(query, blocks, packed_seq_params.cu_seqlens_q)

        def _attend_whole(self, query, blocks, seq_dim):
            """This rank's queries ``[s/c, b, heads, dim]`` against the whole sequence's keys."""
            cp, rank = len(blocks), _cp_rank()
            key, value = _in_sequence_order(blocks, seq_dim=seq_dim + 1)
            if isinstance(self, SDPAttention) and query.device.type == "cpu" \
                    and query.size(seq_dim) >= BLOCKWISE_MIN_TOKENS:
                return self._attend_by_blocks(query, key, value, rank)
            q_pos = sequence_chunk_positions(query.size(seq_dim) * cp, cp, rank).to(query.device)
            k_pos = torch.arange(key.size(seq_dim), device=query.device)
            masked = (k_pos[None, :] > q_pos[:, None])[None, None]  # megatron masks out where True
            return super().forward(query, key, value, masked, AttnMaskType.padding)

        def _attend_by_blocks(self, query, key, value, rank):
            """``[s/c, b, heads, dim]`` queries, rank ``rank``'s two chunks, against the whole
            sequence's ``[s, b, groups, dim]`` keys and values: each chunk to the keys up to its end."""
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, tokens, dim]
            k, v = every_heads_keys(q, k, v)  # the CPU kernel takes no query groups
            out = _ChunkPairAttention.apply(q, k, v, rank, self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)

        def _attend_packed(self, query, blocks, cu_seqlens):
            """Packed ``[t/c, heads, dim]``: each sample's share against that sample's keys alone."""
            cp = len(blocks)
            sizes = [(b - a) // cp for a, b in _whole_chunks(segment_bounds(cu_seqlens), cp)]
            # split, not slices: one cat joins the samples' gradients (see SDPAttention._packed)
            shares = [block.split(sizes, dim=1) for block in blocks]  # [rank][sample]
            outs = [self._attend_whole(q.unsqueeze(1), [share[i].unsqueeze(2) for share in shares], seq_dim=0).squeeze(1)
                    for i, q in enumerate(query.split(sizes))]
            return torch.cat(outs, dim=0)

    RingAttention.__name__ = RingAttention.__qualname__ = f"Ring{core_class.__name__}"
    return RingAttention


def _rank_shares(params, cp: int):
    """A packed micro-batch's ``params`` (the whole samples' ``cu_seqlens``) as one rank of ``cp``
    holds it: each sample's ``1 / cp`` of its tokens, which a shapes-only core attends alone."""
    if params is None:
        return None
    _whole_chunks(segment_bounds(params.cu_seqlens_q), cp)
    cu_seqlens = params.cu_seqlens_q // cp
    return dataclasses.replace(params, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                               max_seqlen_q=params.max_seqlen_q and params.max_seqlen_q // cp,
                               max_seqlen_kv=params.max_seqlen_kv and params.max_seqlen_kv // cp)


class _ChunkPairAttention(torch.autograd.Function):
    """A context-parallel rank's two chunks of queries (``[b, heads, 2n, dim]``, chunks ``r`` and
    ``2c - 1 - r`` of the sequence) against the whole sequence's keys and values (``[b, heads, 2cn,
    dim]``), causally, by blocks of torch's CPU flash kernel: both chunks' diagonal blocks in one
    causal call, each chunk's keys before it in one call without a mask, the blocks' outputs merged
    by their log-sum-exp. Backward runs each block's kernel against the merged output and
    log-sum-exp, which gives that block's share of the gradient (transformer-engine's ring
    attention does the same on the GPU)."""

    @staticmethod
    def forward(ctx, query, key, value, rank, scale):
        n = query.size(2) // 2
        starts = (rank * n, key.size(2) - (rank + 1) * n)  # each chunk's first position
        chunks = query.split(n, dim=2)
        out, lse = _flash(torch.cat(chunks), _diagonal(key, starts, n), _diagonal(value, starts, n), True, scale)
        outs, lses = list(out.chunk(2)), list(lse.chunk(2))
        for i, start in enumerate(starts):
            if start:
                before_out, before_lse = _flash(chunks[i], key[:, :, :start], value[:, :, :start], False, scale)
                merged = torch.logaddexp(lses[i], before_lse)
                outs[i] = outs[i] * (lses[i] - merged).exp().unsqueeze(-1) \
                    + before_out * (before_lse - merged).exp().unsqueeze(-1)
                lses[i] = merged
        ctx.save_for_backward(query, key, value, *outs, *lses)
        ctx.starts, ctx.scale = starts, scale
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, *outs_lses = ctx.saved_tensors
        outs, lses = outs_lses[:2], outs_lses[2:]
        n, starts = query.size(2) // 2, ctx.starts
        chunks, grads = query.split(n, dim=2), grad.contiguous().split(n, dim=2)

        def block(grad, query, key, value, out, lse, causal):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, query, key, value, out, lse, 0.0, causal, scale=ctx.scale)

        dq, dk_diagonal, dv_diagonal = block(torch.cat(grads), torch.cat(chunks), _diagonal(key, starts, n),
                                             _diagonal(value, starts, n), torch.cat(outs), torch.cat(lses), True)
        dq = list(dq.chunk(2))
        dk, dv = torch.zeros_like(key), torch.zeros_like(value)
        for i, start in enumerate(starts):
            dk[:, :, start:start + n] += dk_diagonal.chunk(2)[i]
            dv[:, :, start:start + n] += dv_diagonal.chunk(2)[i]
            if start:
                dq_before, dk_before, dv_before = block(grads[i], chunks[i], key[:, :, :start], value[:, :, :start],
                                                        outs[i], lses[i], False)
                dq[i] = dq[i] + dq_before
                dk[:, :, :start] += dk_before
                dv[:, :, :start] += dv_before
        return torch.cat(dq, dim=2), dk, dv, None, None


def _diagonal(tensor, starts, n):
    """The keys (or values) of both chunks' diagonal blocks, ``n`` tokens from each of ``starts``,
    stacked on the batch dimension."""
    return torch.cat([tensor[:, :, start:start + n] for start in starts])


def _flash(query, key, value, causal: bool, scale):
    """torch's CPU flash attention: the output and each query's log-sum-exp of its scores."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)


#: The arrays of a GPT micro-batch laid out ``[rows, tokens]``, which context parallelism splits.
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def batch_on_this_cp_rank(batch: dict) -> dict:
    """This context-parallel rank's share of a micro-batch (``batch`` itself without context
    parallelism): chunks ``r`` and ``2c - 1 - r`` of every row of a padded one (megatron-core's
    split), of every sample of a packed one (``cu_seqlens``, which stay the whole samples', as
    transformer-engine's split takes them)."""
    cp = _group_size()
    if cp == 1:
        return batch
    present = {key: batch[key] for key in SEQUENCE_KEYS if batch.get(key) is not None}
    row = next(iter(present.values())).size(1)
    segments = segment_bounds(batch["cu_seqlens"]) if "cu_seqlens" in batch else [(0, row)]
    index = torch.cat([a + sequence_chunk_positions(b - a, cp, _cp_rank()) for a, b in _whole_chunks(segments, cp)])
    return {**batch, **{key: value.index_select(1, index.to(value.device)) for key, value in present.items()}}


def _whole_chunks(segments: list[tuple[int, int]], cp: int) -> list[tuple[int, int]]:
    """``segments`` ((start, end) of a row, or of a packed row's samples), each checked to split
    into ``2 cp`` equal chunks."""
    uneven = [b - a for a, b in segments if (b - a) % (2 * cp)]
    if uneven:
        raise ValueError(f"context parallelism splits each sequence into 2*CP={2 * cp} chunks, and one has "
                         f"{uneven[0]} tokens: pad every row and packed sample to a multiple of {2 * cp}")
    return segments


def sequence_chunk_positions(seq_length: int, cp: int, rank: int) -> torch.Tensor:
    """The positions, in a sequence of ``seq_length`` tokens, that context-parallel rank ``rank``
    of ``cp`` holds: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp`` equal chunks."""
    chunk = seq_length // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def _in_sequence_order(blocks, seq_dim):
    """Every rank's two chunks (``blocks[j]``, split along ``seq_dim``) put back in sequence order:
    chunk ``k`` of ``2c`` is the first half of rank ``k``'s block for ``k < c``, else the second
    half of rank ``2c - 1 - k``'s."""
    cp = len(blocks)
    halves = [block.chunk(2, dim=seq_dim) for block in blocks]
    ordered = [halves[k][0] for k in range(cp)] + [halves[2 * cp - 1 - k][1] for k in range(cp, 2 * cp)]
    return torch.cat(ordered, dim=seq_dim).unbind(0)


def _gather_over_ring(tensor):
    """Every context-parallel rank's ``tensor``, in rank order, brought by ``c - 1`` ring steps."""
    cp, rank = _group_size(), _cp_rank()
    blocks, arrived = [None] * cp, tensor
    blocks[rank] = tensor
    for step in range(1, cp):
        arrived = _RingStep.apply(arrived)
        blocks[(rank - step) % cp] = arrived
    return blocks


class _RingStep(torch.autograd.Function):
    """One ring step: this rank's tensor to the next rank, the previous rank's in; backward sends
    the gradient back to the previous rank and takes the next rank's."""

    @staticmethod
    def forward(ctx, tensor):
        return _exchange(tensor.contiguous(), +1)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), -1)


class _KVRing(torch.autograd.Function):
    """Passes K and V around the context-parallel ring (forward) and K, V and their gradients
    back (backward), returning its inputs unchanged: the transfers a shapes-only trace records."""

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

    return parallel_state.get_context_parallel_world_size() or 1  # 0 without torch.distributed: one rank


def _cp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_rank()


def _exchange(tensor: torch.Tensor, direction: int = +1) -> torch.Tensor:
    """One ring step: send ``tensor`` to the rank ``direction`` ahead in the group, receive as much
    from the rank as far behind; returns what arrived."""
    from megatron.core import parallel_state

    ranks = parallel_state.get_context_parallel_global_ranks()
    me = parallel_state.get_context_parallel_rank()
    group = parallel_state.get_context_parallel_group()
    arrived = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, ranks[(me + direction) % len(ranks)], group),
           dist.P2POp(dist.irecv, arrived, ranks[(me - direction) % len(ranks)], group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return arrived
