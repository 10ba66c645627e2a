"""One tensor-parallel rank's layers of a GPT, built with megatron-core on this device.

The profiler times what one TP rank computes: a process of torch's fake process group plays rank
0 of ``tp`` (collectives return at once, so a layer's time is its compute alone; the cost model
prices communication separately, from the hidden size), and megatron-core builds the layers at
the sharded shapes of that TP size.  Transformer Engine's layer spec is used where TE is
installed, the local spec otherwise; each recompute type is built the way Megatron-LM builds it
(``--recompute-granularity selective`` / ``full --recompute-method uniform``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from ..models import ModelSpec
from ..planning.types import RecomputeType

__all__ = ["DTYPES", "Parts", "fake_tp_rank", "build_parts", "layer_spec", "transformer_config", "uses_transformer_engine"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def uses_transformer_engine(device: torch.device) -> bool:
    """TE's layer spec where TE can run (installed, on CUDA); the local spec otherwise."""
    if device.type != "cuda":
        return False
    try:
        import transformer_engine  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def fake_tp_rank(tp: int, device: torch.device) -> Iterator[None]:
    """This process as rank 0 of a ``tp``-way tensor-parallel group of the fake backend, with
    megatron-core's parallel state (and CPU mode off CUDA) for the duration."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..compat import cpu_compat

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


def transformer_config(spec: ModelSpec, tp: int, dtype: torch.dtype, device: torch.device,
                       recompute: RecomputeType, use_te: bool, *, num_layers: int = 1, pp: int = 1):
    """The TransformerConfig Megatron-LM would build from the model's flags at this TP size
    (``num_layers`` over ``pp`` pipeline stages; one layer for the profiler)."""
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=num_layers, pipeline_model_parallel_size=pp, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.query_groups, ffn_hidden_size=spec.ffn_hidden_size,
        normalization=spec.normalization, gated_linear_unit=spec.swiglu,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=device.type != "cuda", gradient_accumulation_fusion=False,
        sequence_parallel=use_te and tp > 1,
    )
    if spec.swiglu:
        fields["activation_func"] = torch.nn.functional.silu
    if not use_te:  # fused kernels need CUDA with apex or TE
        fields.update(masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                      apply_rope_fusion=False, persist_layer_norm=False)
    if recompute is RecomputeType.SELECTIVE:
        fields.update(recompute_granularity="selective")
    elif recompute is RecomputeType.FULL:
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(**fields)


@dataclass
class Parts:
    """What one TP rank runs of a transformer layer and of the model's last stage.

    ``encoders[rc](x)`` maps hidden states ``[seq, mbs, hidden]`` to the same shape (one layer,
    recompute type ``rc`` as Megatron runs it); ``postprocess(x, labels)`` is the final norm, the
    LM head and the per-token loss, the same whatever the layers recompute.  Parameter counts
    are of this rank's shards.
    """

    encoders: dict[RecomputeType, Callable[[torch.Tensor], torch.Tensor]]
    postprocess: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    encoder_params: int
    embedding_params: int


def build_parts(spec: ModelSpec, tp: int, dtype: torch.dtype, device: torch.device,
                recompute: Sequence[RecomputeType]) -> Parts:
    """Build the parts inside :func:`fake_tp_rank`: a megatron-core TransformerBlock of one layer
    per recompute type and one GPTModel whose embedding and head are used."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlock

    use_te = uses_transformer_engine(device)
    layers = layer_spec(use_te)
    head = GPTModel(transformer_config(spec, tp, dtype, device, RecomputeType.NONE, use_te), layers,
                    vocab_size=spec.vocab_size, max_sequence_length=spec.max_sequence_length,
                    pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=spec.share_embeddings_and_output_weights,
                    position_embedding_type=spec.position_embedding_type).to(device=device, dtype=dtype)
    rotary = _rotary_embeddings(getattr(head, "rotary_pos_emb", None), device)
    blocks = {rc: TransformerBlock(transformer_config(spec, tp, dtype, device, rc, use_te), layers,
                                   post_layer_norm=False, pre_process=True, post_process=False).to(device=device,
                                                                                                  dtype=dtype)
              for rc in recompute}

    def encoder(block):
        return lambda x: block(hidden_states=x, attention_mask=None, rotary_pos_emb=rotary(x.shape[0]))

    def postprocess(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = head.decoder.final_layernorm(x)
        weight = head.shared_embedding_or_output_weight() if head.share_embeddings_and_output_weights else None
        logits, _ = head.output_layer(hidden, weight=weight)
        return head.compute_language_model_loss(labels, logits)

    return Parts(
        encoders={rc: encoder(block) for rc, block in blocks.items()}, postprocess=postprocess,
        encoder_params=sum(p.numel() for p in head.decoder.layers[0].parameters()),
        embedding_params=sum(p.numel() for p in head.embedding.parameters()),
    )


def _rotary_embeddings(rope, device: torch.device) -> Callable[[int], "torch.Tensor | None"]:
    """RoPE frequencies per sequence length, computed once each: GPTModel computes them before
    its layers run, so they are no part of a layer's time."""
    cache: dict[int, torch.Tensor] = {}

    def rotary(seq: int):
        if rope is None:
            return None
        if seq not in cache:
            with _cuda_requests_here(device):
                cache[seq] = rope(seq)
        return cache[seq]

    return rotary


def _cuda_requests_here(device: torch.device):
    """megatron-core asks for ``torch.cuda.current_device()`` in a few places; off CUDA they are
    answered with the CPU."""
    if device.type == "cuda":
        return contextlib.nullcontext()
    from ..compat import cpu_compat

    return cpu_compat.cuda_as_cpu()


def layer_spec(use_te: bool):
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec()
