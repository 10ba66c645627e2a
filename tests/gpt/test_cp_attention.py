"""Context parallelism without transformer-engine: two gloo ranks each hold two of a sequence's
four chunks and pass keys and values around their ring; their loss sums and parameter gradients
add up to one rank's over the whole sequence (real tiny GPTs: the local and the SDPA core, padded
and packed micro-batches, learned and rotary positions, grouped-query attention)."""

import dataclasses

import numpy as np
import pytest

from megatron_dynapipe.data.microbatches import gpt_microbatch, packed_microbatch
from megatron_dynapipe.gpt.tiny import TINY_TEST_GPT
from megatron_dynapipe.local_ranks import run_local_ranks

from test_attention import packed_params, writes_of_shapes  # tests/gpt is on the path, as pytest collects it

CP = 2
# every sample a multiple of 2 x CP tokens, as a packed micro-batch under CP needs
PACKED_LENGTHS = (8, 20, 4, 12)  # 44 tokens in a row of 48: the last 4 are padding
SDPA_ROPE_GQA = dataclasses.replace(TINY_TEST_GPT, attention="sdpa", position_embedding_type="rope",
                                    num_query_groups=TINY_TEST_GPT.num_attention_heads // 2)
# (spec, whether the SDPA core attends block by block at these short test sequences)
SPECS = {"local": (TINY_TEST_GPT, False), "sdpa-rope-gqa": (SDPA_ROPE_GQA, False),
         "sdpa-rope-gqa-blockwise": (SDPA_ROPE_GQA, True)}


def _samples(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY_TEST_GPT.vocab_size, size=n) for n in lengths]


def _batches(packed: bool):
    """A padded micro-batch of three samples in rows of 24, and, where the core packs, a packed one."""
    out = {"padded": gpt_microbatch(_samples((24, 13, 7), seed=1), 24)}
    if packed:
        out["packed"] = packed_microbatch(_samples(PACKED_LENGTHS, seed=2), 48)
    return out


def _loss_and_grads(spec, batches):
    """Per batch: the loss-masked sum of this rank's per-token losses, its token count and the
    gradient of that sum with respect to every parameter (in the model's parameter order)."""
    import torch

    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.gpt.forward_step import pretrain_gpt_forward_step
    from megatron_dynapipe.gpt.tiny import build_tiny_gpt

    model = build_tiny_gpt(spec)
    out = {}
    for name, batch in batches.items():
        model.zero_grad()
        with cpu_compat.cuda_as_cpu():
            output, loss_func = pretrain_gpt_forward_step(iter([{k: torch.from_numpy(v) for k, v in batch.items()}]),
                                                          model)
            loss, tokens, _ = loss_func(output)
        loss.backward()
        out[name] = (float(loss), int(tokens), [p.grad.detach().clone() for p in model.parameters()])
    return out


def _run(rank, world_size, spec, packed, blockwise):
    """The whole sequence on each rank alone (model parallel sizes 1), then split over CP."""
    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.gpt import context_parallel
    from megatron_dynapipe.gpt.tiny import destroy_model_parallel, init_model_parallel

    if blockwise:
        context_parallel.BLOCKWISE_MIN_TOKENS = 1
    cpu_compat.enable_cpu_mode()
    results = {}
    for cp in (1, CP):
        init_model_parallel(1, 1, context_parallel_size=cp)
        try:
            results[cp] = _loss_and_grads(spec, _batches(packed))
        finally:
            destroy_model_parallel()
    return results


@pytest.fixture(scope="module", params=sorted(SPECS))
def cp_runs(request):
    spec, blockwise = SPECS[request.param]
    return run_local_ranks(_run, CP, spec, spec.attention == "sdpa", blockwise, timeout=240)


@pytest.mark.slow
def test_context_parallel_ranks_add_up_to_the_whole_sequence(cp_runs):
    import torch

    whole = cp_runs[0][1]
    assert cp_runs[1][1].keys() == whole.keys()
    for name, (loss, tokens, grads) in whole.items():
        shares = [run[CP][name] for run in cp_runs]
        assert sum(share[1] for share in shares) == tokens  # every real token on exactly one rank
        assert all(0 < share[1] < tokens for share in shares)
        torch.testing.assert_close(sum(share[0] for share in shares), loss, rtol=1e-5, atol=1e-5)
        for index, grad in enumerate(grads):
            # float32 sums taken in another order (two ranks' shares, or one rank's whole) differ by
            # rounding of the size of the terms summed, not of each element's result: an element
            # that cancels to near zero is held to the tensor's scale
            scale = float(grad.abs().max())
            torch.testing.assert_close(sum(share[2][index] for share in shares), grad, rtol=1e-4,
                                       atol=1e-6 + 1e-5 * scale, msg=lambda m: f"{name}, parameter {index}: {m}")


@pytest.mark.slow
def test_each_rank_holds_its_two_chunks(cp_runs):
    """The shares differ (each rank's chunks are its own), so the sums above are not one rank twice."""
    for name in cp_runs[0][CP]:
        assert cp_runs[0][CP][name][0] != pytest.approx(cp_runs[1][CP][name][0])


@pytest.mark.parametrize("cp", [2, 3])
def test_blockwise_attention_of_a_ranks_two_chunks(cp):
    """Each rank's two chunks attended block by block equal, with their gradients, a masked
    attention of those queries over the whole sequence in float64."""
    import torch

    from megatron_dynapipe.gpt.context_parallel import _ChunkPairAttention, sequence_chunk_positions

    n, scale = 5, 0.3
    generator = torch.Generator().manual_seed(cp)
    whole = [torch.randn(2, 3, 2 * cp * n, 4, generator=generator, dtype=torch.float64) for _ in range(3)]
    grad = torch.randn(2, 3, 2 * n, 4, generator=generator, dtype=torch.float64)
    for rank in range(cp):
        positions = sequence_chunk_positions(2 * cp * n, cp, rank)
        q, k, v = (x.clone().requires_grad_() for x in (whole[0][:, :, positions], whole[1], whole[2]))
        visible = torch.arange(2 * cp * n)[None, :] <= positions[:, None]
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
        expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
        q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
        out = _ChunkPairAttention.apply(q32, k32, v32, rank, scale)
        grads = torch.autograd.grad(out, (q32, k32, v32), grad.float())
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_a_shapes_only_rank_attends_each_packed_samples_share_alone():
    """On meta tensors the core attends a rank's ``1 / CP`` of each sample: its ``cu_seqlens`` are
    the whole samples' divided by CP (a sample split into 2 x CP chunks, or refused)."""
    from megatron_dynapipe.gpt.context_parallel import _rank_shares

    shares = _rank_shares(packed_params((8, 12, 4)), CP)
    assert shares.cu_seqlens_q.tolist() == shares.cu_seqlens_kv.tolist() == [0, 4, 10, 12]
    assert shares.max_seqlen_q == shares.max_seqlen_kv == 6 and shares.qkv_format == "thd"
    assert _rank_shares(None, CP) is None
    with pytest.raises(ValueError, match="multiple of 4"):
        _rank_shares(packed_params((6, 6)), CP)


def _ring_writes_in_backward(rank, world_size, lengths):
    """Backward of one rank's share of a packed row of ``lengths`` through the ring's SDPA core:
    how many ops wrote a tensor the size of the rank's whole share of queries, keys or values."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.gpt.attention import SDPAttention
    from megatron_dynapipe.gpt.build import transformer_config
    from megatron_dynapipe.gpt.context_parallel import ring_attention
    from megatron_dynapipe.gpt.tiny import destroy_model_parallel, init_model_parallel

    spec = dataclasses.replace(TINY_TEST_GPT, attention="sdpa", attention_dropout=0.0)
    heads, dim = spec.num_attention_heads, spec.hidden_size // spec.num_attention_heads
    share = sum(lengths) // CP
    cpu_compat.enable_cpu_mode()
    init_model_parallel(1, 1, context_parallel_size=CP)
    try:
        core = ring_attention(SDPAttention)(transformer_config(spec, dtype=torch.float32, cp=CP), layer_number=1,
                                            attn_mask_type=AttnMaskType.causal, attention_type="self")
        q, k, v = (torch.randn(share, heads, dim, requires_grad=True) for _ in range(3))
        out = core(q, k, v, None, packed_seq_params=packed_params(lengths))
        # queries; a rank's keys and values, stacked for the ring
        return writes_of_shapes({(share, heads, dim), (2, share, heads, dim)}, lambda: out.sum().backward())
    finally:
        destroy_model_parallel()
        cpu_compat.disable_cpu_mode()


@pytest.mark.slow
def test_a_packed_rows_ring_backward_does_not_write_the_whole_share_once_a_sample():
    """As on one rank (tests/gpt/test_attention.py), each sample's gradient reaches the rank's
    queries and the ring's keys and values without a tensor of the rank's whole share of its own:
    as many such writes for 8 samples as for 2."""
    few, many = (run_local_ranks(_ring_writes_in_backward, CP, lengths, timeout=240)
                 for lengths in ((16, 16), (4,) * 8))
    assert few == many, (few, many)
