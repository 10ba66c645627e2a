"""A tiny megatron-core GPT for CPU tests, with weights that do not depend on the parallel layout.

Weight equality across layouts
------------------------------
With ``use_cpu_initialization=True`` megatron-core draws every weight in full from the CPU
generator and keeps this rank's tensor-parallel slice, so TP changes nothing about the values.
Pipeline parallelism does: a later stage skips the draws of the layers it does not hold. So each
transformer layer is built right after seeding the CPU generator with ``seed + global layer
number`` (a :class:`~megatron.core.transformer.transformer_layer.TransformerLayer` subclass put
into the local layer spec, the extension point megatron-core provides). The embedding is drawn
first from ``seed`` on the first stage, exactly as in a single-process model; the output layer is
drawn after the last layer, from the generator state that layer's seed leaves behind, which is
the same on the last stage as in a single-process model (with tied embeddings megatron-core then
overwrites it with the first stage's word embedding anyway). So every stage of any (TP, PP,
virtual PP) layout holds exactly the corresponding slices of the single-process model's weights,
bit for bit, with no reference model or weight copying needed; :func:`reference_name` and
:func:`reference_shard` line a stage's parameters up with the single-process ones.

Process groups
--------------
:func:`init_model_parallel` runs megatron-core's ``initialize_model_parallel`` on an
already-initialised (gloo) default process group; :func:`destroy_model_parallel` tears it down.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta
from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)

from megatron_dynapipe.compat import cpu_compat
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.gpt.build import build_gpt, layer_spec, transformer_config

__all__ = [
    "TINY_TEST_GPT",
    "build_tiny_gpt",
    "destroy_model_parallel",
    "init_model_parallel",
    "make_transformer_config",
    "reference_name",
    "reference_shard",
]


#: The tests' GPT; fp32, no dropout (see :func:`make_transformer_config`). Word embedding and
#: output layer are tied, as in Megatron-LM's default GPT, which also exercises the
#: first/last-stage embedding group at PP>1.
TINY_TEST_GPT = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128,
                          max_sequence_length=64, name="tiny-test")
DEFAULT_SEED = 1234


def _deterministic(cfg: ModelSpec) -> ModelSpec:
    """``cfg`` as the tests build it: no dropout and the vocabulary as given (unpadded), so that
    losses and weights compare exactly between layouts."""
    return dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=1)


def make_transformer_config(cfg: ModelSpec, **overrides: Any) -> TransformerConfig:
    """An fp32 ``TransformerConfig`` for ``cfg`` without dropout at the current TP/PP/CP (and virtual
    PP) sizes, on the CPU without fused kernels or sequence parallelism. ``overrides`` go to
    TransformerConfig."""
    return transformer_config(
        _deterministic(cfg), dtype=torch.float32, tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(), cp=parallel_state.get_context_parallel_world_size(),
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        **overrides)


class _SeededTransformerLayer(TransformerLayer):
    """A TransformerLayer whose weights are drawn right after seeding the CPU generator with
    ``layer_seed + global layer number`` (1-based), independent of the pipeline stage."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, layer_seed: int, **kwargs):
        vp_stage = kwargs.get("vp_stage")
        pg_collection = kwargs.get("pg_collection")
        pp_rank = pg_collection.pp.rank() if pg_collection is not None else None
        offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        torch.manual_seed(layer_seed + layer_number + offset)
        super().__init__(config, submodules, layer_number, *args, **kwargs)


def build_tiny_gpt(
    cfg: ModelSpec = TINY_TEST_GPT,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    *,
    seed: int = DEFAULT_SEED,
    vp_stage: Optional[int] = None,
    **config_overrides: Any,
) -> GPTModel:
    """Build this rank's stage of the tiny GPT (megatron-core ``GPTModel``, local layer spec).

    Needs :func:`init_model_parallel` first and, without CUDA, CPU mode
    (:func:`megatron_dynapipe.compat.cpu_compat.enable_cpu_mode`). ``pre_process`` /
    ``post_process`` default to whether this rank (virtual stage ``vp_stage`` when interleaving)
    is the first / last pipeline stage. Seeds the CPU generator and megatron's RNG tracker with
    ``seed`` (so each call gives the same weights, in any order of chunks or stages).
    """
    if not torch.cuda.is_available() and not cpu_compat.is_enabled():
        raise RuntimeError("build_tiny_gpt without CUDA needs cpu_compat.enable_cpu_mode() first")
    virtual = vp_stage is not None
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(not virtual, vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(not virtual, vp_stage)
    config = make_transformer_config(cfg, **config_overrides)

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    spec = layer_spec(cfg, use_te=False, context_parallel=config.context_parallel_size > 1)
    spec = dataclasses.replace(
        spec, module=_SeededTransformerLayer, params={**spec.params, "layer_seed": seed}
    )
    return build_gpt(_deterministic(cfg), config, tp=parallel_state.get_tensor_model_parallel_world_size(),
                     use_te=False, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                     transformer_layer_spec=spec)


def random_micro_batches(count: int, micro_batch_size: int, seq_length: int, vocab_size: int,
                         seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` fixed-shape micro-batches of random tokens, the same on every rank for one
    ``seed``: tokens, next-token labels, a loss mask of ones and positions."""
    data = torch.randint(0, vocab_size, (count, micro_batch_size, seq_length + 1),
                         generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(seq_length).expand(micro_batch_size, seq_length).contiguous()
    return [{"tokens": d[:, :-1].contiguous(), "labels": d[:, 1:].contiguous(),
             "loss_mask": torch.ones(micro_batch_size, seq_length), "position_ids": positions} for d in data]


def mean_loss_forward_step(data_iterator, model):
    """A megatron-core forward step for :func:`random_micro_batches`: the causal mask comes from
    megatron (``attention_mask=None``), the loss is the mean per-token loss (2-tuple convention)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


# --------------------------------------------------------------------------------------------
# Lining stage parameters up with the single-process model
# --------------------------------------------------------------------------------------------

_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")


def reference_name(model: GPTModel, name: str) -> str:
    """The name that stage parameter ``name`` (from ``model.named_parameters()``) has in the
    single-process model: local layer indices become global ones, and a tied output weight on a
    later stage is the word embedding."""
    name = name.removeprefix("module.")
    match = _LAYER.search(name)
    if match:
        layer = model.decoder.layers[int(match.group(1))]
        global_index = layer.layer_number - 1
        name = name[: match.start(1)] + str(global_index) + name[match.end(1) :]
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        name = "embedding.word_embeddings.weight"
    return name


def reference_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This tensor-parallel rank's slice of the single-process tensor ``full`` for ``param``,
    as megatron-core splits it (``partition_dim``, contiguous chunks; stride 1 only)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    if getattr(param, "partition_stride", 1) != 1:
        raise NotImplementedError("strided tensor-parallel partitions are not supported")
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return torch.chunk(full, tp_size, dim=param.partition_dim)[tp_rank]


# --------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------


def init_model_parallel(
    tp: int = 1,
    pp: int = 1,
    *,
    virtual_pp: Optional[int] = None,
    timeout: timedelta = timedelta(seconds=60),
    **kwargs: Any,
) -> None:
    """Run megatron-core ``initialize_model_parallel(tp, pp, ...)`` on the already-initialised
    default process group (gloo on CPU); ``kwargs`` go to megatron-core."""
    if not torch.distributed.is_initialized():
        raise RuntimeError("init_model_parallel needs torch.distributed initialised (gloo on CPU)")
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("model parallel is already initialised; call destroy_model_parallel()")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_pp,
        distributed_timeout_minutes=max(1, int(round(timeout.total_seconds() / 60))),
        **kwargs,
    )


def destroy_model_parallel() -> None:
    """Tear down megatron-core's model-parallel state (process groups and buffers); the next
    :func:`build_tiny_gpt` re-seeds the RNG tracker."""
    parallel_state.destroy_model_parallel()
