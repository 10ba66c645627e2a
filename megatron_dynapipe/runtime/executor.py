"""Run one pipeline stage's :class:`~megatron_dynapipe.planning.plan.ExecutionPlan` in Megatron.

:func:`run_plan` walks the stage's instructions in order, each on the model chunk it names (one
chunk a stage, or megatron-core's list of V chunks of an interleaved pipeline; what the stage
keeps of a micro-batch is keyed by (chunk, micro-batch)):

* ``LOAD_INPUT(m)`` / ``RECV_ACT_FINISH(m)`` -- the input of ``F(m)``: the micro-batch's data on
  the first stage, the received activation elsewhere;
* ``FORWARD(m)`` -- megatron-core's own ``forward_step`` (so the loss is scaled as Megatron
  scales it, per token with ``config.calculate_per_token_loss``) with an iterator over the one
  micro-batch dict, so a ``forward_step(data_iterator, model)`` that calls ``next`` works as is;
* ``BACKWARD(m)`` -- megatron-core's ``backward_step``;
* STARTs -- sends and receives (:mod:`.p2p`) of tensors whose shapes come from the plan
  (``plan.microbatches[m]`` and the model's hidden size, as megatron-core's ``get_tensor_shapes``
  computes them), so there is no shape hand-shake; all STARTs between two compute ops are posted
  together, before the next FINISH or compute op; FINISHes wait for their transfer;
* ``FREE_BUFFER(m)`` -- drops what the stage keeps of ``m``.

With ``ExecutorOptions.timeline`` a list, every instruction run is appended to it as a
:class:`TimedInstruction` (``bench step --chrome-trace``): where a step's time went, compute and
waits, rank by rank. On CUDA each instruction then ends with a synchronize, which the step pays.

Recompute per micro-batch
-------------------------
megatron-core decides activation recompute from global settings: ``TransformerBlock.forward``
reads ``config.recompute_granularity == 'full'`` (with ``recompute_method`` /
``recompute_num_layers``) on every call, and each attention module reads its
``checkpoint_core_attention`` flag (set from ``recompute_granularity == 'selective'`` at
construction) on every call. :class:`RecomputeSwitch` sets exactly those attributes for the
duration of one FORWARD or BACKWARD and puts the originals back afterwards: ``NONE`` -- neither;
``SELECTIVE`` -- core attention checkpointed (megatron's selective recompute); ``FULL`` -- whole
layers checkpointed (``recompute_method`` of the config, else ``uniform`` with one layer per
checkpoint). The recomputation itself is megatron-core's (``tensor_parallel.checkpoint``), so
gradients are those of the plain forward; the switch checks at first use that the installed
megatron-core still reads these attributes at forward time.

Gradients and results
---------------------
As in megatron-core's 1F1B: gradient synchronisation (``config.no_sync_func``; with model
chunks, Megatron-LM's list of one per chunk) stays off until the stage's last backward, then
``config.finalize_model_grads_func`` runs over every chunk with the number of tokens when
``calculate_per_token_loss``. Returns the list of loss dicts on the last stage and
``[]`` elsewhere. With ``forward_only``, only activations flow (the plan's gradient transfers,
backwards and their waits are skipped on every stage together, which keeps the plans
deadlock-free: only waits are removed).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_dynapipe.compat import core, upstream
from megatron_dynapipe.compat.patching import check_spots
from megatron_dynapipe.data.batch import PlannedBatch
from megatron_dynapipe.planning.plan import ExecutionPlan, Op
from megatron_dynapipe.planning.types import RecomputeType
from megatron_dynapipe.runtime.p2p import PipelineChannels, PipelineCommError, Transfer

__all__ = [
    "ExecutorOptions",
    "PipelineCommError",
    "PlanMismatchError",
    "HANDLERS",
    "RecomputeSwitch",
    "StageRunner",
    "TimedInstruction",
    "run_plan",
]


class PlanMismatchError(ValueError):
    """The plan, the PlannedBatch and this rank's place in the pipeline disagree."""


@dataclass
class ExecutorOptions:
    """``comm_timeout_s``: how long a pipeline FINISH may wait (None: the process group's
    timeout). ``validate_plans``: check each plan's structure before running it. ``timeline``:
    where a list, every instruction run is appended to it (module docstring)."""

    comm_timeout_s: Optional[float] = None
    validate_plans: bool = True
    timeline: Optional[list] = None


@dataclass(frozen=True)
class TimedInstruction:
    """An instruction as one stage ran it: ``start`` and ``end`` in seconds of ``time.perf_counter``
    (one clock for every process of a machine on Linux, so local ranks' timelines line up)."""

    instruction: Any  # planning.plan.Instruction
    start: float
    end: float


# --------------------------------------------------------------------------------------------
# Per-micro-batch recompute
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _check_recompute_reads() -> None:
    check_spots(upstream.RECOMPUTE_READS, review="megatron_dynapipe/runtime/executor.py:RecomputeSwitch")


class RecomputeSwitch:
    """Sets a megatron-core model's recompute for one micro-batch (see the module docstring).

    ``with switch(RecomputeType.FULL): ...`` -- the config attributes the transformer blocks read
    and the attention modules' ``checkpoint_core_attention`` flags are set on entry and restored
    on exit.
    """

    def __init__(self, model: "torch.nn.Module | Iterable[torch.nn.Module]"):
        models = [model] if isinstance(model, torch.nn.Module) else list(model)
        modules = [module for m in models for module in m.modules()]
        configs = {id(block.config): block.config for block in core.transformer_blocks(modules)}
        self.attention: list[torch.nn.Module] = [m for m in modules if hasattr(m, "checkpoint_core_attention")]
        self.configs = list(configs.values())
        # the model as built already runs without recompute: NONE then needs no switching
        self._rests_at_none = (all(c.recompute_granularity is None for c in self.configs)
                               and not any(m.checkpoint_core_attention for m in self.attention))

    def _settings(self, rc: RecomputeType) -> tuple[list[tuple[Any, str, Any]], bool]:
        attrs = []
        for config in self.configs:
            granularity = {RecomputeType.NONE: None, RecomputeType.SELECTIVE: "selective",
                           RecomputeType.FULL: "full"}[rc]
            attrs.append((config, "recompute_granularity", granularity))
            if rc == RecomputeType.FULL:
                if config.recompute_method is None:
                    attrs.append((config, "recompute_method", "uniform"))
                if config.recompute_num_layers is None:
                    attrs.append((config, "recompute_num_layers", 1))
        return attrs, rc == RecomputeType.SELECTIVE

    @contextlib.contextmanager
    def __call__(self, rc: RecomputeType):
        rc = RecomputeType(rc)
        if rc == RecomputeType.NONE and self._rests_at_none:
            yield
            return
        if rc != RecomputeType.NONE:
            _check_recompute_reads()
        attrs, core_attention = self._settings(rc)
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in attrs]
        saved_flags = [m.checkpoint_core_attention for m in self.attention]
        try:
            for obj, name, value in attrs:
                setattr(obj, name, value)
            for m in self.attention:
                m.checkpoint_core_attention = core_attention
            yield
        finally:
            for obj, name, value in reversed(saved):
                setattr(obj, name, value)
            for m, flag in zip(self.attention, saved_flags):
                m.checkpoint_core_attention = flag


# --------------------------------------------------------------------------------------------
# The executor
# --------------------------------------------------------------------------------------------

_GRADIENT_OPS = frozenset({Op.BACKWARD, Op.RECV_GRAD_START, Op.RECV_GRAD_FINISH,
                           Op.SEND_GRAD_START, Op.SEND_GRAD_FINISH})


_CHANNELS: dict = {}


def _channels(pp_group, device: torch.device, timeout: Optional[float], chunks: int) -> PipelineChannels:
    """One PipelineChannels per (pipeline group, device, timeout, chunks), kept across iterations."""
    key = (id(pp_group), str(device), timeout, chunks)
    cached = _CHANNELS.get(key)
    if cached is None or cached.pp_group is not pp_group:
        cached = _CHANNELS[key] = PipelineChannels(pp_group, device=device, timeout=timeout, chunks=chunks)
    return cached


def _check_batch(batch: PlannedBatch, channels: PipelineChannels, chunks: int) -> ExecutionPlan:
    plan = batch.plan
    where = f"pipeline stage {channels.stage} (global rank {channels.rank})"
    if plan.num_stages != channels.num_stages or plan.stage != channels.stage:
        raise PlanMismatchError(
            f"{where} received the plan of stage {plan.stage} of {plan.num_stages}: the pipeline has "
            f"{channels.num_stages} stages; the data pipeline must hand each rank its own stage's plan"
        )
    if plan.chunks != chunks:
        raise PlanMismatchError(
            f"{where} received a plan of {plan.chunks} model chunk(s) a stage for a model of {chunks}: plan with "
            f"the model's virtual pipeline size (TrainingSpec(chunks={chunks}), --num-virtual-stages-per-pipeline-rank)")
    n = len(plan.microbatches)
    if len(batch.microbatches) != n:
        raise PlanMismatchError(
            f"{where}: the PlannedBatch holds {len(batch.microbatches)} micro-batches, its plan {n}"
        )
    for m, (shape, data) in enumerate(zip(plan.microbatches, batch.microbatches)):
        expected = (shape.rows, shape.seq_len)
        for key, tensor in data.items():
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tuple(tensor.shape) != expected:
                raise PlanMismatchError(
                    f"{where}: micro-batch {m} {key!r} has shape {tuple(tensor.shape)}, its plan says "
                    f"{expected} (rows x padded sequence length)"
                )
    return plan


def run_plan(
    *,
    forward_step_func: Callable,
    batch: PlannedBatch,
    model: "torch.nn.Module | list[torch.nn.Module]",
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    force_all_reduce: bool = False,
    options: Optional[ExecutorOptions] = None,
    pg_collection=None,
) -> list:
    """Run this rank's stage of ``batch.plan`` on ``model`` (one chunk, possibly DDP-wrapped, or
    the list of the stage's model chunks, as many as the plan's ``chunks``).

    The arguments mean what they mean for megatron-core's ``forward_backward_*`` functions.
    Returns the list of loss dicts (or, with ``collect_non_loss_data``, of the loss function's
    data) on the last stage and ``[]`` elsewhere; the loss is divided by the plan's number of
    micro-batches where megatron-core divides by ``num_microbatches``.
    """
    runner = StageRunner(forward_step_func=forward_step_func, batch=batch, model=model,
                         forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                         first_val_step=first_val_step, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
                         options=options, pg_collection=pg_collection)
    return runner.run(force_all_reduce=force_all_reduce)


class StageRunner:
    """One stage's run of one plan. What the instructions share (the tensors each micro-batch
    keeps, open transfers, token count) lives in fields; each :class:`Op` has one handler in
    :data:`HANDLERS`, called as ``handler(runner, index, instruction)``."""

    def __init__(self, *, forward_step_func: Callable, batch: PlannedBatch, model, forward_only: bool = False,
                 collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None,
                 adjust_tensor_shapes_fn: Optional[Callable] = None,
                 options: Optional[ExecutorOptions] = None, pg_collection=None):
        options = options or ExecutorOptions()
        self.models = list(model) if isinstance(model, (list, tuple)) else [model]
        self.core = core.CoreSchedule()
        self.forward_step_func, self.batch = forward_step_func, batch
        self.forward_only, self.collect_non_loss_data = forward_only, collect_non_loss_data
        self.first_val_step, self.adjust_tensor_shapes_fn = first_val_step, adjust_tensor_shapes_fn
        self.config = core.model_config(self.models[0])
        self.pg_collection = pg_collection if pg_collection is not None else core.process_groups()
        params = next(self.models[0].parameters(), None)
        self.device = params.device if params is not None else torch.device("cpu")
        self.channels = _channels(self.pg_collection.pp, self.device, options.comm_timeout_s, len(self.models))
        self.plan = _check_batch(batch, self.channels, len(self.models))
        if options.validate_plans:
            self.plan.validate()
        self.stage = self.channels.stage
        self.next_stage = (self.stage + 1) % self.channels.num_stages  # where activations go
        self.is_last = self.stage == self.channels.num_stages - 1  # holds the last virtual stage
        self.dtype = self.config.pipeline_dtype or (params.dtype if params is not None else torch.float32)
        self.model_type = core.model_type(self.models[0])
        self.switch = RecomputeSwitch(self.models)
        self.last_backward = max((i for i, ins in enumerate(self.plan.instructions) if ins.op == Op.BACKWARD),
                                 default=-1)
        # per (chunk, micro-batch): its input (None on the first virtual stage), output, gradients
        self.inputs: dict[tuple[int, int], Optional[torch.Tensor]] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.output_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], Optional[torch.Tensor]] = {}
        self.transfers: dict[tuple, Transfer] = {}  # started, not finished
        self.pending: list[Transfer] = []  # started since the last compute op, not yet posted
        self.finished_early: set[tuple] = set()  # sends a BACKWARD had to wait for
        self.forward_data_store: list = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.forwarded_chunks: set[int] = set()  # megatron's "first micro-batch" is per model chunk
        self.no_sync: Optional[contextlib.ExitStack] = None
        self.embedding_module = None
        self.timeline = options.timeline
        self.finish_work = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

    def holds_last_virtual_stage(self, chunk: int) -> bool:
        """Whether ``chunk`` of this stage is the pipeline's last virtual stage (computes the loss)."""
        return self.is_last and chunk == self.plan.chunks - 1

    # -- the run ------------------------------------------------------------------------------
    def run(self, force_all_reduce: bool = False) -> list:
        self._begin()
        for i, ins in enumerate(self.plan.instructions):
            self.step(i, ins)
        self._post_pending()
        if self.transfers:  # cannot happen for a validated plan: every START has its FINISH
            leftover = ", ".join(t.describe() for t in self.transfers.values())
            raise RuntimeError(f"pipeline stage {self.stage}: the plan ended with transfers still open: {leftover}")
        self._end(force_all_reduce)
        return self.forward_data_store

    def step(self, i: int, ins) -> None:
        """Run instruction ``i``. STARTs are collected and posted together before the next
        FINISH or compute op."""
        if self.forward_only and ins.op in _GRADIENT_OPS:
            return
        if not ins.op.is_start:
            self._post_pending()
        if self.timeline is None:
            HANDLERS[ins.op](self, i, ins)
            return
        start = time.perf_counter()
        HANDLERS[ins.op](self, i, ins)
        self.finish_work()
        self.timeline.append(TimedInstruction(ins, start, time.perf_counter()))

    def _begin(self) -> None:
        config = self.config
        if config.finalize_model_grads_func is not None and not self.forward_only:
            self.embedding_module = self.core.clear_embedding_buffer(config, self.models, is_last_stage=self.is_last)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        if not self.forward_only:  # gradient sync waits for the last backward
            self.no_sync = contextlib.ExitStack()
            for no_sync in _hooks(config.no_sync_func):
                self.no_sync.enter_context(no_sync())

    def _end(self, force_all_reduce: bool) -> None:
        config = self.config
        if not self.forward_only:
            if self.no_sync is not None:
                self._leave_no_sync()
                if config.grad_sync_func is not None:
                    for grad_sync, model in zip(_hooks(config.grad_sync_func), self.models):
                        grad_sync(model.parameters())
            if config.finalize_model_grads_func is not None:
                self.core.finish_embedding_wgrad(config, self.embedding_module, is_last_stage=self.is_last,
                                                 tp_group=self.pg_collection.tp)
                config.finalize_model_grads_func(
                    self.models, self.total_num_tokens if config.calculate_per_token_loss else None,
                    pg_collection=self.pg_collection, force_all_reduce=force_all_reduce)
            if getattr(config, "fine_grained_activation_offloading", False):
                self.core.reset_activation_offloading()
        if config.timers is not None:
            config.timers("forward-backward").stop()

    def _leave_no_sync(self) -> None:
        self.no_sync.close()
        self.no_sync = None

    def _post_pending(self) -> None:
        if self.pending:
            self.channels.post(self.pending)
            self.pending = []

    def shape_of(self, m: int) -> tuple[int, ...]:
        """Micro-batch ``m``'s activation shape, as megatron-core's ``get_tensor_shapes`` says."""
        mb = self.plan.microbatches[m]
        shapes = self.core.activation_shape(seq_length=mb.seq_len, micro_batch_size=mb.rows, config=self.config,
                                            tp_group=self.pg_collection.tp, cp_group=self.pg_collection.cp)
        if self.adjust_tensor_shapes_fn is not None:
            shapes, send = self.adjust_tensor_shapes_fn(shapes, list(shapes))
            if len(shapes) != 1 or list(send) != list(shapes):
                raise NotImplementedError("DynaPipe exchanges one tensor of one shape per micro-batch")
        return tuple(shapes[0])

    def _deallocate_output(self, key: tuple[int, int]) -> None:
        self.core.deallocate_output(self.outputs[key], deallocate=self.config.deallocate_pipeline_outputs)

    # -- STARTs ---------------------------------------------------------------------------------
    def _start(self, i: int, ins, tensor: torch.Tensor) -> None:
        transfer = self.channels.transfer(ins, tensor if tensor.is_contiguous() else tensor.contiguous(),
                                          where=f"plan instruction #{i} {ins}")
        self.transfers[ins.transfer] = transfer
        self.pending.append(transfer)

    def recv_start(self, i: int, ins) -> None:
        self._start(i, ins, torch.empty(self.shape_of(ins.microbatch), requires_grad=True, device=self.device,
                                        dtype=self.dtype))

    def send_act_start(self, i: int, ins) -> None:
        tensor, expected = self.outputs[_key(ins)], self.shape_of(ins.microbatch)
        if tuple(tensor.shape) != expected or tensor.dtype != self.dtype:
            raise PlanMismatchError(
                f"pipeline stage {self.stage}: {_name(ins)}'s output is {tuple(tensor.shape)} "
                f"{tensor.dtype}, the plan's activation is {expected} {self.dtype} (sequence x batch x "
                "hidden): the micro-batch's tensors do not have the plan's shape")
        self._start(i, ins, tensor)

    def send_grad_start(self, i: int, ins) -> None:
        tensor = self.input_grads[_key(ins)]
        if tensor is None:
            raise RuntimeError(f"pipeline stage {self.stage}: {_name(ins)}'s input received no gradient")
        self._start(i, ins, tensor)

    # -- FINISHes -------------------------------------------------------------------------------
    def _wait(self, key: tuple, i: int, ins) -> torch.Tensor:
        return self.channels.finish(self.transfers.pop(key), where=f"plan instruction #{i} {ins}")

    def recv_act_finish(self, i: int, ins) -> None:
        self.inputs[_key(ins)] = self._wait(ins.transfer, i, ins)

    def recv_grad_finish(self, i: int, ins) -> None:
        self.output_grads[_key(ins)] = self._wait(ins.transfer, i, ins)

    def send_act_finish(self, i: int, ins) -> None:
        if ins.transfer in self.finished_early:  # the BACKWARD waited for it and freed the output
            self.finished_early.discard(ins.transfer)
            return
        self._wait(ins.transfer, i, ins)
        if self.forward_only:
            self.outputs.pop(_key(ins), None)
        else:
            self._deallocate_output(_key(ins))

    def send_grad_finish(self, i: int, ins) -> None:
        self._wait(ins.transfer, i, ins)

    # -- compute and buffers --------------------------------------------------------------------
    def load_input(self, i: int, ins) -> None:
        self.inputs[_key(ins)] = None

    def forward(self, i: int, ins) -> None:
        key, m, chunk = _key(ins), ins.microbatch, ins.chunk
        is_last = self.holds_last_virtual_stage(chunk)
        with self.switch(ins.recompute):
            output, num_tokens = self.core.forward(
                forward_step_func=self.forward_step_func, microbatch=self.batch.microbatches[m],
                model=self.models[chunk], num_microbatches=len(self.plan.microbatches), input_tensor=self.inputs[key],
                forward_data_store=self.forward_data_store, config=self.config, cp_size=self.pg_collection.cp.size(),
                collect_non_loss_data=self.collect_non_loss_data, first_val_step=self.first_val_step,
                forward_only=self.forward_only, first_of_chunk=chunk not in self.forwarded_chunks,
                microbatch_index=m, vp_stage=chunk if self.plan.chunks > 1 else None, is_last_stage=is_last)
        self.forwarded_chunks.add(chunk)
        self.total_num_tokens += num_tokens
        if self.forward_only:
            self.inputs.pop(key)
            if not is_last:
                self.outputs[key] = output
        else:
            self.outputs[key] = output

    def backward(self, i: int, ins) -> None:
        key = _key(ins)
        send = (Op.SEND_ACT_START, ins.microbatch, self.next_stage, ins.chunk)
        if send in self.transfers:  # a plan that finishes the send later: the backward needs it done
            self._wait(send, i, ins)
            self.finished_early.add(send)
            self._deallocate_output(key)
        if i == self.last_backward and self.no_sync is not None:
            if self.config.grad_sync_func is None or self.stage == 0:
                self._leave_no_sync()
        with self.switch(ins.recompute):
            self.input_grads[key] = self.core.backward(
                input_tensor=self.inputs.pop(key), output_tensor=self.outputs.pop(key),
                output_tensor_grad=self.output_grads.pop(key, None), model_type=self.model_type, config=self.config)

    def free_buffer(self, i: int, ins) -> None:
        for kept in (self.input_grads, self.inputs, self.output_grads):
            kept.pop(_key(ins), None)


def _key(ins) -> tuple[int, int]:
    """What the stage keeps of an instruction's micro-batch is keyed by (model chunk, micro-batch)."""
    return ins.chunk, ins.microbatch


def _name(ins) -> str:
    return f"micro-batch {ins.microbatch}" + (f" (model chunk {ins.chunk})" if ins.chunk else "")


def _hooks(hook) -> list:
    """megatron's ``no_sync_func`` / ``grad_sync_func`` as a list: one callable (for the first model
    chunk, or bound to a wrapper of all), or, as Megatron-LM sets them when it interleaves, one per
    model chunk."""
    if hook is None:
        return []
    return list(hook) if isinstance(hook, (list, tuple)) else [hook]


#: What each instruction does (every Op has a handler; tests check it).
HANDLERS: dict[Op, Callable[[StageRunner, int, Any], None]] = {
    Op.LOAD_INPUT: StageRunner.load_input,
    Op.FORWARD: StageRunner.forward,
    Op.BACKWARD: StageRunner.backward,
    Op.RECV_ACT_START: StageRunner.recv_start,
    Op.RECV_ACT_FINISH: StageRunner.recv_act_finish,
    Op.SEND_ACT_START: StageRunner.send_act_start,
    Op.SEND_ACT_FINISH: StageRunner.send_act_finish,
    Op.RECV_GRAD_START: StageRunner.recv_start,
    Op.RECV_GRAD_FINISH: StageRunner.recv_grad_finish,
    Op.SEND_GRAD_START: StageRunner.send_grad_start,
    Op.SEND_GRAD_FINISH: StageRunner.send_grad_finish,
    Op.FREE_BUFFER: StageRunner.free_buffer,
}
