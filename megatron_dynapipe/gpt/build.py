"""A :class:`~megatron_dynapipe.config.model.ModelSpec` as megatron-core builds it.

The one place that turns a model description into megatron-core's ``TransformerConfig``, layer
spec and ``GPTModel``, as Megatron-LM's ``pretrain_gpt.py`` does from the same flags: the tracer,
the profiler, ``bench step`` and the test GPT all build through here, so a flag honoured once is
honoured everywhere.  Imports torch and megatron-core when called.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_dynapipe.config.model import ModelSpec

__all__ = ["transformer_config", "layer_spec", "with_local_attention", "with_core_attention", "build_gpt", "wrap_in_ddp",
           "uses_transformer_engine", "runs_packed", "RECOMPUTE_CHOICES"]

#: Megatron-LM's ``--recompute-granularity`` values (``None``: no recomputation).
RECOMPUTE_CHOICES = (None, "selective", "full")


def uses_transformer_engine(device_type: str) -> bool:
    """Whether transformer-engine's layer spec runs here: TE installed and the device CUDA."""
    if device_type != "cuda":
        return False
    try:
        import transformer_engine  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return True


def runs_packed(spec: ModelSpec, device_type: str) -> bool:
    """Whether the model's attention core runs packed (THD) micro-batches here: a fused core (SDPA,
    which also stands in for transformer-engine's), or transformer-engine's; megatron-core's local
    core refuses them."""
    return spec.fused_attention or uses_transformer_engine(device_type)


def transformer_config(spec: ModelSpec, *, dtype, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                       expert_tp: Optional[int] = None, num_layers: Optional[int] = None,
                       on_gpu: bool = False, use_te: bool = False, initialize: bool = True,
                       recompute: Optional[str] = None, **overrides: Any):
    """The ``TransformerConfig`` of ``spec`` at this layout (``num_layers`` defaults to the
    model's; the profiler builds one).  ``initialize=False`` skips drawing weights (meta tensors);
    ``recompute`` is "selective", "full" (uniform, one layer a chunk) or None.  Without
    transformer-engine there is no fused kernel; sequence parallelism (an override) builds the
    local spec's norms as :class:`SequenceParallelTorchNorm`."""
    import torch
    from megatron.core.transformer import TransformerConfig

    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, got {recompute!r}")
    fields: dict[str, Any] = dict(
        num_layers=num_layers or spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.query_groups,
        kv_channels=spec.kv_channels, ffn_hidden_size=spec.ffn_hidden_size,
        normalization=spec.normalization, gated_linear_unit=spec.swiglu, add_bias_linear=spec.add_bias_linear,
        hidden_dropout=spec.hidden_dropout, attention_dropout=spec.attention_dropout,
        init_method_std=spec.init_method_std,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=expert_tp or tp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu, perform_initialization=initialize,
        gradient_accumulation_fusion=False, sequence_parallel=use_te and tp > 1,
    )
    if spec.swiglu:
        fields["activation_func"] = torch.nn.functional.silu
    if not use_te:  # fused kernels need CUDA with apex or TE
        fields.update(masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                      apply_rope_fusion=False, persist_layer_norm=False)
    if recompute == "selective":
        fields.update(recompute_granularity="selective")
    elif recompute == "full":
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if spec.num_experts:
        fields.update(
            num_moe_experts=spec.num_experts, moe_router_topk=min(spec.moe_router_topk, spec.num_experts),
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size,
            moe_token_dispatcher_type=spec.moe_token_dispatcher_type, moe_grouped_gemm=False,
            moe_aux_loss_coeff=1e-2, moe_expert_capacity_factor=spec.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=spec.moe_pad_expert_input_to_capacity)
    fields.update(overrides)
    return TransformerConfig(**fields)


def layer_spec(spec: ModelSpec, use_te: bool, context_parallel: bool = False):
    """Megatron-LM's layer spec for ``spec``: transformer-engine's when it runs, else the local one
    with ``spec.attention``'s attention core (:func:`with_local_attention`)."""
    from megatron.core.models.gpt import gpt_layer_specs

    experts = spec.num_experts or None
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts)
    local = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, normalization=spec.normalization)
    return with_local_attention(local, spec.attention, context_parallel)


def with_local_attention(local_layer_spec, attention: str, context_parallel: bool):
    """megatron-core's local layer spec with the core ``attention`` names ("local": its own
    unfused core, "sdpa": :class:`~megatron_dynapipe.gpt.attention.SDPAttention`, which stands
    in for "transformer_engine"'s fused core too), which under context parallelism passes keys and
    values round the CP group's ring (:mod:`megatron_dynapipe.gpt.context_parallel`)."""
    core = local_layer_spec.submodules.self_attention.submodules.core_attention
    if attention != "local":
        from megatron_dynapipe.gpt.attention import SDPAttention

        core = SDPAttention
    if context_parallel:
        from megatron_dynapipe.gpt.context_parallel import ring_attention

        core = ring_attention(core)
    return with_core_attention(local_layer_spec, core)


def with_core_attention(local_layer_spec, core):
    """megatron-core's local layer spec (``get_gpt_layer_local_spec``'s) with ``core`` as its
    attention core."""
    import dataclasses

    attention = local_layer_spec.submodules.self_attention
    submodules = dataclasses.replace(attention.submodules, core_attention=core)
    layer = dataclasses.replace(local_layer_spec.submodules,
                                self_attention=dataclasses.replace(attention, submodules=submodules))
    return dataclasses.replace(local_layer_spec, submodules=layer)


def build_gpt(spec: ModelSpec, config, *, tp: int, use_te: bool, pre_process: bool, post_process: bool,
              vp_stage: Optional[int] = None, transformer_layer_spec=None):
    """This rank's stage of the GPT (vocabulary padded as Megatron-LM pads it at this TP)."""
    from megatron.core.models.gpt import GPTModel

    if transformer_layer_spec is None:
        transformer_layer_spec = layer_spec(spec, use_te, context_parallel=config.context_parallel_size > 1)
        if config.sequence_parallel and not use_te:
            transformer_layer_spec = _sequence_parallel_block(transformer_layer_spec, config, vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=transformer_layer_spec,
        vocab_size=spec.padded_vocab_size(tp), max_sequence_length=spec.max_sequence_length,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=spec.share_embeddings_and_output_weights,
        position_embedding_type=spec.position_embedding_type, vp_stage=vp_stage)


def wrap_in_ddp(model, config, ddp_config=None):
    """``model`` in megatron-core's DDP as Megatron-LM's ``get_model`` wraps it (an fp32 gradient
    buffer unless ``ddp_config`` says otherwise), its gradients finalised at the end of a step and
    not synchronised between micro-batches (``config``'s hooks for the schedules)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp = DistributedDataParallel(config, ddp_config or DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp


class SequenceParallelTorchNorm:
    """megatron-core's torch norm (``WrappedTorchNorm``) in a sequence-parallel layer.

    A norm works token by token, so a sequence shard normalises as the whole sequence would; what
    sequence parallelism needs of a norm is that its weights be marked ``sequence_parallel``, so
    that ``finalize_model_grads`` all-reduces their gradients over TP (transformer-engine's and
    apex's norms mark them).  ``WrappedTorchNorm`` does not mark them and so refuses the setting;
    this builds it without the setting and marks them."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        import copy

        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = copy.copy(config)  # a shallow copy: TransformerConfig's checks do not run again
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def _sequence_parallel_block(local_layer_spec, config, vp_stage: Optional[int]):
    """The local spec's transformer block with :class:`SequenceParallelTorchNorm` for every norm
    (the layers' and the final one)."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    norms = {f.name: SequenceParallelTorchNorm for f in dataclasses.fields(local_layer_spec.submodules)
             if getattr(local_layer_spec.submodules, f.name) is WrappedTorchNorm}
    layer = dataclasses.replace(local_layer_spec, submodules=dataclasses.replace(local_layer_spec.submodules, **norms))
    layers = [layer] * get_num_layers_to_build(config, vp_stage)
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelTorchNorm))
