"""Megatron-LM's GPT forward step, shared by everything here that trains or traces a GPT the way
``pretrain_gpt.py`` does: the executor's training stage, ``bench step``, the profiler's whole-step
overhead and the fake-rank tracer."""

from __future__ import annotations

import torch

__all__ = ["pretrain_gpt_forward_step", "packed_seq_params"]


def pretrain_gpt_forward_step(data_iterator, model):
    """Megatron-LM's ``pretrain_gpt`` forward step, minus the data loader: tokens, labels and
    positions of one micro-batch (this context-parallel rank's share of them), the causal mask from
    megatron (``attention_mask=None``) or, for a packed micro-batch, its ``PackedSeqParams``; a
    per-token loss masked and summed, and the token count (the 3-tuple loss convention)."""
    from megatron_dynapipe.gpt.context_parallel import batch_on_this_cp_rank

    batch = batch_on_this_cp_rank(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=packed_seq_params(batch))
    loss_mask = batch["loss_mask"]

    def loss_func(per_token_loss):
        losses = per_token_loss.float().view(-1)
        loss = torch.sum(losses * loss_mask.view(-1))
        num_tokens = loss_mask.sum().to(torch.int)
        report = torch.cat([loss.detach().view(1), num_tokens.detach().view(1).float()])
        return loss, num_tokens, {"lm loss": report}

    return output, loss_func


def packed_seq_params(batch):
    """megatron-core's THD ``PackedSeqParams`` of a packed micro-batch (one that has ``cu_seqlens``,
    as :func:`~megatron_dynapipe.data.microbatches.packed_microbatch` builds it), else None."""
    if "cu_seqlens" not in batch:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = batch["cu_seqlens"].to(torch.int32)
    longest = int(batch["max_seqlen"].max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)
