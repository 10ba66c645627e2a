"""The SDPA attention core against megatron-core's own unfused one, and packed (THD) micro-batches
against their samples run alone: real tiny GPTs, one process each."""

import dataclasses

import numpy as np
import pytest

from megatron_dynapipe.data.microbatches import gpt_microbatch, packed_microbatch
from megatron_dynapipe.gpt.tiny import TINY_TEST_GPT
from megatron_dynapipe.local_ranks import run_local_ranks

LENGTHS = (5, 17, 30, 12)  # 64 tokens, packed into a row of 72: the last 8 are padding


def _run(rank, world_size, spec, batches):
    """Per batch: the model's per-token losses and the gradient of their loss-masked sum."""
    import torch

    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.gpt.forward_step import packed_seq_params
    from megatron_dynapipe.gpt.tiny import build_tiny_gpt, destroy_model_parallel, init_model_parallel

    cpu_compat.enable_cpu_mode()
    init_model_parallel(1, 1)
    try:
        model = build_tiny_gpt(spec)
        out = []
        for batch in batches:
            tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
            model.zero_grad()
            with cpu_compat.cuda_as_cpu():
                losses = model(tensors["tokens"], tensors["position_ids"], None, labels=tensors["labels"],
                               packed_seq_params=packed_seq_params(tensors))
            (losses * tensors["loss_mask"]).sum().backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            out.append((losses.detach().numpy(), grads.numpy()))
        return out
    finally:
        destroy_model_parallel()
        cpu_compat.disable_cpu_mode()


def _assert_grads_close(actual, expected):
    """fp32 gradients summed in another order: equal to 1e-5 of the largest."""
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def _samples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY_TEST_GPT.vocab_size, n) for n in lengths]


def _spec(**fields):
    return dataclasses.replace(TINY_TEST_GPT, max_sequence_length=128, **fields)


@pytest.mark.parametrize("fields", [{}, {"num_query_groups": 2}], ids=["mha", "gqa"])
def test_sdpa_core_computes_what_megatrons_unfused_core_computes(fields):
    batch = gpt_microbatch(_samples((40, 23, 9)), 40)
    [[(local_loss, local_grad)]], [[(sdpa_loss, sdpa_grad)]] = (
        run_local_ranks(_run, 1, _spec(attention=attention, **fields), [batch], timeout=300)
        for attention in ("local", "sdpa"))
    np.testing.assert_allclose(sdpa_loss, local_loss, rtol=1e-5, atol=1e-6)
    _assert_grads_close(sdpa_grad, local_grad)


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_packed_samples_attend_to_themselves_alone(position):
    """A packed row's per-token losses are each sample's losses run alone through the unfused core
    (no attention across samples, positions from 0), and its gradient is the sum of theirs."""
    samples = _samples(LENGTHS, seed=1)
    packed = packed_microbatch(samples, 72)
    [(packed_loss, packed_grad)] = run_local_ranks(
        _run, 1, _spec(attention="sdpa", position_embedding_type=position), [packed], timeout=300)[0]
    alone = run_local_ranks(_run, 1, _spec(attention="local", position_embedding_type=position),
                            [gpt_microbatch([s], len(s)) for s in samples], timeout=300)[0]
    starts = np.cumsum((0,) + LENGTHS)
    for (loss, _), start, n in zip(alone, starts, LENGTHS):
        np.testing.assert_allclose(packed_loss[0, start:start + n - 1], loss[0, :n - 1], rtol=1e-5, atol=1e-6)
    _assert_grads_close(packed_grad, sum(grad for _, grad in alone))


def test_packed_microbatch_arrays():
    samples = [np.array([7, 8, 9]), np.array([4, 5])]
    mb = packed_microbatch(samples, 8, pad_token_id=0, targets=[None, np.array([0, 1])])
    assert mb["tokens"].tolist() == [[7, 8, 9, 4, 5, 0, 0, 0]]
    assert mb["labels"].tolist() == [[8, 9, 0, 5, 0, 0, 0, 0]]
    # the last token of a sample predicts nothing; the second sample's target mask keeps its token 1
    assert mb["loss_mask"].tolist() == [[1, 1, 0, 1, 0, 0, 0, 0]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert mb["cu_seqlens"].tolist() == [0, 3, 5, 8] and mb["max_seqlen"].tolist() == [3]
    full = packed_microbatch(samples, 5)
    assert full["cu_seqlens"].tolist() == [0, 3, 5]
    with pytest.raises(ValueError, match="do not fit"):
        packed_microbatch(samples, 4)
