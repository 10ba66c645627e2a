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
@pytest.mark.slow
def test_sdpa_core_computes_what_megatrons_unfused_core_computes(fields):
    batch = gpt_microbatch(_samples((40, 23, 9)), 40)
    [[(local_loss, local_grad)]], [[(sdpa_loss, sdpa_grad)]] = (
        run_local_ranks(_run, 1, _spec(attention=attention, **fields), [batch], timeout=300)
        for attention in ("local", "sdpa"))
    np.testing.assert_allclose(sdpa_loss, local_loss, rtol=1e-5, atol=1e-6)
    _assert_grads_close(sdpa_grad, local_grad)


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
@pytest.mark.slow
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


def _varlen_kernel_and_loop(rank, world_size, spec, lengths, device):
    """A packed row through the SDPA core twice, by torch's varlen kernel and by the per-sample
    loop: per path the output and the gradients of q, k and v (bf16 on CUDA)."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dynapipe.gpt import attention
    from megatron_dynapipe.gpt.build import transformer_config
    from megatron_dynapipe.gpt.tiny import destroy_model_parallel, init_model_parallel

    init_model_parallel(1, 1)
    try:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        config = transformer_config(spec, dtype=dtype, on_gpu=device == "cuda")
        core = attention.SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                      attention_type="self")
        heads, dim = spec.num_attention_heads, spec.hidden_size // spec.num_attention_heads
        tokens = sum(lengths)
        torch.manual_seed(0)
        q, k, v = (torch.randn(tokens, n, dim, dtype=dtype, device=device)
                   for n in (heads, spec.num_query_groups or heads, spec.num_query_groups or heads))
        grad = torch.randn(tokens, heads * dim, dtype=dtype, device=device)
        params = packed_params(lengths, device)
        kernel, out = attention._VARLEN, []
        for attention._VARLEN in (kernel, None):
            inputs = [x.clone().requires_grad_() for x in (q, k, v)]
            core(*inputs, None, packed_seq_params=params).backward(grad)
            with torch.no_grad():
                result = core(q, k, v, None, packed_seq_params=params)
            out.append([t.float().cpu().numpy() for t in (result, *(x.grad for x in inputs))])
        attention._VARLEN = kernel
        return out
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("fields", [{}, {"num_query_groups": 2}], ids=["mha", "gqa"])
def test_the_cuda_varlen_kernel_computes_what_the_per_sample_loop_computes(fields):
    import torch

    from megatron_dynapipe.gpt.attention import _VARLEN

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch's varlen attention is a flash kernel")
    if _VARLEN is None:
        pytest.skip(f"torch {torch.__version__} has no causal varlen_attn with a softmax scale")
    if "num_query_groups" in fields and not _VARLEN.gqa:  # both paths would be the loop: nothing compared
        pytest.skip(f"torch {torch.__version__}'s varlen_attn takes no enable_gqa: GQA runs the per-sample loop")
    spec = _spec(attention="sdpa", attention_dropout=0.0, **fields)  # the kernel runs without dropout
    [[kernel, loop]] = run_local_ranks(_varlen_kernel_and_loop, 1, spec, LENGTHS, "cuda", timeout=300)
    for got, expected in zip(kernel, loop):  # bf16: equal to a few units in the last place
        np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


def packed_params(lengths, device="cpu"):
    """megatron-core's THD ``PackedSeqParams`` of one row of samples of ``lengths``."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(np.cumsum((0,) + tuple(lengths)), dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                           max_seqlen_kv=max(lengths))


def writes_of_shapes(shapes, run) -> int:
    """How many ops ``run()`` dispatches whose output tensor has one of ``shapes``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Writes(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.count += isinstance(out, torch.Tensor) and tuple(out.shape) in shapes
            return out

    with Writes() as writes:
        run()
    return writes.count


def _row_sized_writes_in_backward(rank, world_size, spec, lengths):
    """Backward of a packed row of ``lengths`` through the SDPA core's per-sample loop (the CPU's):
    how many ops wrote a tensor the size of the whole row's queries."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dynapipe.gpt import attention
    from megatron_dynapipe.gpt.build import transformer_config
    from megatron_dynapipe.gpt.tiny import destroy_model_parallel, init_model_parallel

    init_model_parallel(1, 1)
    try:
        core = attention.SDPAttention(transformer_config(spec, dtype=torch.float32), layer_number=1,
                                      attn_mask_type=AttnMaskType.causal, attention_type="self")
        heads, dim = spec.num_attention_heads, spec.hidden_size // spec.num_attention_heads
        q, k, v = (torch.randn(sum(lengths), heads, dim, requires_grad=True) for _ in range(3))
        out = core(q, k, v, None, packed_seq_params=packed_params(lengths))
        return writes_of_shapes({tuple(q.shape)}, lambda: out.sum().backward())
    finally:
        destroy_model_parallel()


@pytest.mark.slow
def test_a_packed_rows_backward_does_not_write_the_whole_row_once_a_sample():
    """Each sample's gradient reaches the row's q, k and v without a row-sized tensor of its own
    (a slice's backward makes one for each sample and adds it in: n samples, n row-sized fills and
    adds per input), so the row-sized writes do not grow with the number of samples."""
    spec = _spec(attention="sdpa", attention_dropout=0.0)
    few, many = (run_local_ranks(_row_sized_writes_in_backward, 1, spec, lengths, timeout=300)[0]
                 for lengths in ((16, 16), (4,) * 8))
    assert few == many, (few, many)
