"""megatron-core as the runtime calls it: every call ``runtime/`` makes into megatron-core goes
through here (``tests/test_architecture.py`` holds it to that), by keyword where megatron-core
takes positionals, so a change of an upstream signature is mended in this one place. Where the
supported versions differ, :mod:`.upstream` bridges them; this module only names the surface.

Each function imports megatron-core when called: importing the runtime does not import it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from megatron_dynapipe.compat import upstream

__all__ = ["CoreSchedule", "core_forward_backward_func", "is_first_stage", "is_last_stage", "model_config",
           "model_type", "original_get_forward_backward_func", "pipeline_group", "pipeline_rank", "process_groups",
           "transformer_blocks"]

process_groups = upstream.process_groups
core_forward_backward_func = upstream.core_forward_backward_func


def original_get_forward_backward_func() -> Callable:
    """megatron-core's own ``get_forward_backward_func`` (the function: what the patch rebinds)."""
    from megatron.core.pipeline_parallel import schedules

    return schedules.get_forward_backward_func


def pipeline_group():
    """This rank's pipeline-parallel group, from megatron-core's parallel state."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def pipeline_rank() -> int:
    """This rank's pipeline stage, from megatron-core's parallel state."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank()


def is_first_stage(vp_stage: Optional[int]) -> bool:
    """Whether this rank's model chunk ``vp_stage`` (None: the rank's one chunk) holds the embedding."""
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)


def is_last_stage(vp_stage: Optional[int]) -> bool:
    """Whether this rank's model chunk ``vp_stage`` (None: the rank's one chunk) computes the loss."""
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)


def model_config(model):
    """The TransformerConfig a (possibly wrapped) megatron-core model runs with."""
    from megatron.core.utils import get_model_config

    return get_model_config(model)


def model_type(model):
    """megatron-core's ModelType of a (possibly wrapped) model."""
    from megatron.core.utils import get_model_type

    return get_model_type(model)


def transformer_blocks(modules) -> Iterator:
    """The megatron-core TransformerBlocks among ``modules``."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    return (module for module in modules if isinstance(module, TransformerBlock))


class CoreSchedule:
    """The functions of megatron-core's ``pipeline_parallel.schedules`` a plan is run with, one
    method each: a micro-batch's forward and backward as its 1F1B runs them, the shape of what a
    stage sends, and the step's bookkeeping around them."""

    def __init__(self):
        from megatron.core.pipeline_parallel import schedules

        self._schedules = schedules

    def forward(self, *, forward_step_func: Callable, microbatch: dict, model, num_microbatches: int,
                input_tensor, forward_data_store: list, config, cp_size: int, collect_non_loss_data: bool,
                first_val_step: Optional[bool], forward_only: bool, first_of_chunk: bool, microbatch_index: int,
                vp_stage: Optional[int], is_last_stage: bool) -> tuple[Any, Any]:
        """megatron-core's ``forward_step`` of one micro-batch on one model chunk: (output, tokens)."""
        schedules = self._schedules
        return schedules.forward_step(
            forward_step_func, iter([microbatch]), model, num_microbatches, input_tensor, forward_data_store,
            config, cp_size, collect_non_loss_data=collect_non_loss_data,
            is_first_microbatch=schedules.check_first_val_step(first_val_step, forward_only, first_of_chunk),
            current_microbatch=microbatch_index, vp_stage=vp_stage, is_last_stage=is_last_stage)

    def backward(self, *, input_tensor, output_tensor, output_tensor_grad, model_type, config):
        """megatron-core's ``backward_step``: the gradient of the chunk's input (None on the first)."""
        return upstream.backward_step(self._schedules, input_tensor, output_tensor, output_tensor_grad,
                                      model_type, config)

    def activation_shape(self, *, seq_length: int, micro_batch_size: int, config, tp_group, cp_group):
        """The shapes of the activations a stage sends for such a micro-batch (:func:`.upstream.activation_shape`)."""
        return upstream.activation_shape(self._schedules, seq_length=seq_length, micro_batch_size=micro_batch_size,
                                         config=config, tp_group=tp_group, cp_group=cp_group)

    def deallocate_output(self, output, *, deallocate: bool) -> None:
        """Free a sent activation's data, keeping its autograd node (``--deallocate-pipeline-outputs``)."""
        self._schedules.deallocate_output_tensor(output, deallocate)

    def clear_embedding_buffer(self, config, models: list, *, is_last_stage: bool):
        """Start of a step: the embedding's activation buffer cleared; the embedding module back."""
        return self._schedules.clear_embedding_activation_buffer(config, models, is_last_stage)

    def finish_embedding_wgrad(self, config, embedding_module, *, is_last_stage: bool, tp_group) -> None:
        """End of a step: the embedding's deferred weight-gradient GEMMs."""
        self._schedules.finish_embedding_wgrad_compute(config, embedding_module, is_last_stage, tp_group)

    def reset_activation_offloading(self) -> None:
        """End of a step with fine-grained activation offloading: its state reset."""
        self._schedules.off_interface.reset()
