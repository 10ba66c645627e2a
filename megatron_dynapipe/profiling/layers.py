"""One tensor-parallel rank's layers of a GPT, built with megatron-core on this device.

The profiler times what one TP rank computes: a process of torch's fake process group plays rank
0 of ``tp`` (collectives return at once, so a layer's time is its compute alone; the cost model
prices communication separately, from the hidden size), and megatron-core builds the layers at
the sharded shapes of that TP size.  Transformer Engine's layer spec is used where TE is
installed, the local spec otherwise; each recompute type is built the way Megatron-LM builds it
(``--recompute-granularity selective`` / ``full --recompute-method uniform``).  Built with ``cp``
> 1 inside a real context-parallel group of local ranks (:mod:`.context_parallel`), the layers
run this rank's share of every row and attend through the group's ring.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from megatron_dynapipe.compat import cpu_compat
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.gpt.build import build_gpt, layer_spec, runs_packed, transformer_config, uses_transformer_engine
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["RECOMPUTE_GRANULARITY", "Parts", "fake_tp_rank", "build_parts"]

@contextlib.contextmanager
def fake_tp_rank(tp: int, device: torch.device) -> Iterator[None]:
    """This process as rank 0 of a ``tp``-way tensor-parallel group of the fake backend, with
    megatron-core's parallel state (and CPU mode off CUDA) for the duration."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised here; profile in a fresh process")
    on_cpu = device.type != "cuda"
    if on_cpu:
        cpu_compat.enable_cpu_mode()
    else:
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
        model_parallel_cuda_manual_seed(1234)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        if on_cpu:
            cpu_compat.disable_cpu_mode()


#: Megatron-LM's ``--recompute-granularity`` for each recompute type.
RECOMPUTE_GRANULARITY = {RecomputeType.NONE: None, RecomputeType.SELECTIVE: "selective", RecomputeType.FULL: "full"}


@dataclass
class Parts:
    """What one TP rank runs of a transformer layer and of the model's last stage.

    ``encoders[rc](x)`` maps hidden states ``[seq, mbs, hidden]`` to the same shape (one layer,
    recompute type ``rc`` as Megatron runs it); ``packed_encoders[rc](x, seq)`` the same layer on one
    packed row ``[mbs * seq, 1, hidden]`` of samples of ``seq`` tokens each attending to itself alone
    (megatron-core's THD format), where the attention core runs them (else there are none); on a
    rank of a context-parallel group of ``cp``, ``x`` is the rank's ``1 / cp`` of those tokens.
    ``postprocess(x, labels)`` is the final norm, the LM head and the per-token loss, and
    ``preprocess(tokens)`` the embedding of ``[mbs, seq]`` token ids (word and learned positions),
    both the same whatever the layers recompute.
    ``attention_core(query, key, value)`` is the layer's attention core alone without a mask
    (every query to every key, as context parallelism's ring attends other ranks' chunks), on
    ``[seq, mbs, heads, head_dim]`` queries and ``[seq, mbs, groups, head_dim]`` keys and values,
    ``core_widths`` those (heads, groups, head_dim) on this rank; None where the core was found not to
    run alone.
    Parameter counts are of this rank's shards.
    """

    encoders: dict[RecomputeType, Callable[[torch.Tensor], torch.Tensor]]
    packed_encoders: dict[RecomputeType, Callable[[torch.Tensor, int], torch.Tensor]]
    postprocess: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    preprocess: Callable[[torch.Tensor], torch.Tensor]
    attention_core: "Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None"
    core_widths: tuple[int, int, int]
    encoder_params: int
    embedding_params: int


def build_parts(spec: ModelSpec, tp: int, dtype: torch.dtype, device: torch.device,
                recompute: Sequence[RecomputeType], cp: int = 1) -> Parts:
    """Build the parts inside :func:`fake_tp_rank` (or, ``cp`` > 1, on a rank of a real
    context-parallel group of ``cp``): a megatron-core TransformerBlock of one layer per recompute
    type and one GPTModel whose embedding and head are used."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_block import TransformerBlock

    use_te = uses_transformer_engine(device.type)
    layers = layer_spec(spec, use_te, context_parallel=cp > 1)

    def config(rc: RecomputeType):
        return transformer_config(spec, dtype=dtype, tp=tp, cp=cp, num_layers=1, on_gpu=device.type == "cuda",
                                  use_te=use_te, recompute=RECOMPUTE_GRANULARITY[rc])

    head = build_gpt(spec, config(RecomputeType.NONE), tp=tp, use_te=use_te, pre_process=True, post_process=True,
                     transformer_layer_spec=layers).to(device=device, dtype=dtype)
    rotary = _rotary_embeddings(getattr(head, "rotary_pos_emb", None), device)
    blocks = {rc: TransformerBlock(config(rc), layers, post_layer_norm=False, pre_process=True,
                                   post_process=False).to(device=device, dtype=dtype)
              for rc in recompute}

    def encoder(block):
        return lambda x: block(hidden_states=x, attention_mask=None, rotary_pos_emb=rotary(x.shape[0] * cp))

    def packed_encoder(block):
        return lambda x, seq: block(hidden_states=x, attention_mask=None, rotary_pos_emb=rotary(seq, packed=True),
                                    packed_seq_params=_equal_segments(x.shape[0] * cp, seq, device))

    core = next(iter(blocks.values())).layers[0].self_attention.core_attention  # recompute wraps it, not in it
    layer_config = config(RecomputeType.NONE)
    core_widths = (layer_config.num_attention_heads // tp, (layer_config.num_query_groups or
                   layer_config.num_attention_heads) // tp, layer_config.kv_channels)

    def attention_core(query, key, value):
        return core(query, key, value, None, attn_mask_type=AttnMaskType.no_mask)

    def postprocess(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = head.decoder.final_layernorm(x)
        weight = head.shared_embedding_or_output_weight() if head.share_embeddings_and_output_weights else None
        logits, _ = head.output_layer(hidden, weight=weight)
        return head.compute_language_model_loss(labels, logits)

    def preprocess(tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return head.embedding(input_ids=tokens, position_ids=positions)

    return Parts(
        encoders={rc: encoder(block) for rc, block in blocks.items()},
        packed_encoders={rc: packed_encoder(block) for rc, block in blocks.items()} if runs_packed(spec, device.type)
        else {},
        postprocess=postprocess, preprocess=preprocess, attention_core=attention_core, core_widths=core_widths,
        encoder_params=sum(p.numel() for p in head.decoder.layers[0].parameters()),
        embedding_params=sum(p.numel() for p in head.embedding.parameters()),
    )


def _equal_segments(tokens: int, seq: int, device: torch.device):
    """megatron-core's THD ``PackedSeqParams`` of a row of ``tokens`` cut into samples of ``seq``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = torch.arange(0, tokens + 1, seq, dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=seq, max_seqlen_kv=seq)


def _rotary_embeddings(rope, device: torch.device) -> Callable[[int], "torch.Tensor | None"]:
    """RoPE frequencies per sequence length -- under context parallelism a rank's share of a row,
    or all of it for a packed row's samples (megatron-core's ``packed_seq``, which picks the share
    sample by sample) -- computed once each: GPTModel computes them before its layers run, so they
    are no part of a layer's time."""
    cache: dict[tuple[int, bool], torch.Tensor] = {}

    def rotary(seq: int, packed: bool = False):
        if rope is None:
            return None
        if (seq, packed) not in cache:
            with _cuda_requests_here(device):
                cache[seq, packed] = rope(seq, packed_seq=packed)
        return cache[seq, packed]

    return rotary


def _cuda_requests_here(device: torch.device):
    """megatron-core asks for ``torch.cuda.current_device()`` in a few places; off CUDA they are
    answered with the CPU."""
    if device.type == "cuda":
        return contextlib.nullcontext()
    return cpu_compat.cuda_as_cpu()
