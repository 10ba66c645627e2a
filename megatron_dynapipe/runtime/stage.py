"""One pipeline stage of a GPT as Megatron-LM trains it, and one planned forward-backward of it.

``bench step`` times these steps against the cost model's predictions, and the profiler times
them to measure what a whole step adds per micro-batch to its layers' own times; both must run
the same thing, so both build it here.  Imports torch and megatron-core when called.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from megatron_dynapipe.compat import core
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.config.pipeline_split import PipelineSplit
from megatron_dynapipe.data.batch import PlannedBatch
from megatron_dynapipe.gpt.build import build_gpt, transformer_config, uses_transformer_engine, wrap_in_ddp

__all__ = ["build_training_chunks", "build_training_stage", "planned_step"]


def build_training_stage(spec: ModelSpec, *, dtype, device, pp: int = 1, tp: int = 1, num_layers: int | None = None):
    """This rank's stage of ``spec`` (``num_layers`` of the whole model, default all) wrapped in
    megatron-core's DDP as Megatron-LM trains it: local layer spec (TE's where TE runs), fp32
    gradient buffer, per-token loss, deallocated pipeline outputs, gradients finalised at the end
    of the step and not synchronised between micro-batches.  Needs megatron's parallel state."""
    return build_training_chunks(spec, dtype=dtype, device=device, pp=pp, tp=tp, num_layers=num_layers)[0]


def build_training_chunks(spec: ModelSpec, *, dtype, device, pp: int = 1, tp: int = 1, cp: int = 1,
                          num_layers: int | None = None, chunks: int = 1, split: PipelineSplit | None = None) -> list:
    """This rank's ``chunks`` model chunks of ``spec`` (an interleaved pipeline where ``chunks`` > 1,
    megatron's virtual pipeline size, which its parallel state must have been given), each built
    and wrapped as :func:`build_training_stage` builds one, and their hooks set on the configs as
    Megatron-LM's ``get_model`` sets them: one ``no_sync`` a chunk. With ``cp`` > 1 (the parallel
    state's context-parallel size) its attention runs over the CP group; ``split``: the stages'
    layers where the first or last has its own (Megatron-LM's ``--decoder-first-pipeline-num-layers``)."""
    use_te = uses_transformer_engine(device.type)
    virtual = dict(virtual_pipeline_model_parallel_size=chunks) if chunks > 1 else {}
    config = transformer_config(spec, dtype=dtype, tp=tp, pp=pp, cp=cp, num_layers=num_layers,
                                on_gpu=device.type == "cuda", use_te=use_te, calculate_per_token_loss=True,
                                deallocate_pipeline_outputs=True, **virtual,
                                **(split.transformer_fields() if split else {}))
    vp_stages = range(chunks) if chunks > 1 else [None]
    models = [build_gpt(spec, config, tp=tp, use_te=use_te, vp_stage=v, pre_process=core.is_first_stage(v),
                        post_process=core.is_last_stage(v)).to(device=device, dtype=dtype)
              for v in vp_stages]
    ddp = [wrap_in_ddp(model, config) for model in models]
    if chunks > 1:
        config.no_sync_func = [d.no_sync for d in ddp]
    return ddp


def planned_step(ddp, plan, tensors: list, device, *, forward_only: bool = False) -> Callable[[], list]:
    """A function running one forward-backward (or forward only) of ``plan`` over the
    micro-batches ``tensors`` (dicts of numpy arrays, as ``gpt_microbatch`` makes them) through
    DynaPipe's executor with Megatron-LM's GPT forward step; it returns the loss dicts. ``ddp``:
    the stage, or its list of model chunks."""
    import torch

    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.gpt.forward_step import pretrain_gpt_forward_step
    from megatron_dynapipe.runtime.provider import forward_backward_dynapipe

    on_device = [{k: torch.from_numpy(v).to(device) for k, v in mb.items()} for mb in tensors]
    shape = dict(model=ddp if isinstance(ddp, list) else [ddp], num_microbatches=len(on_device),
                 seq_length=plan.microbatches[0].seq_len, micro_batch_size=plan.microbatches[0].rows,
                 forward_only=forward_only)
    cuda_as_cpu = cpu_compat.cuda_as_cpu if device.type == "cpu" else contextlib.nullcontext

    def step() -> list:
        with cuda_as_cpu():
            return forward_backward_dynapipe(forward_step_func=pretrain_gpt_forward_step,
                                             data_iterator=iter([PlannedBatch(0, plan, on_device)]), **shape)

    return step
