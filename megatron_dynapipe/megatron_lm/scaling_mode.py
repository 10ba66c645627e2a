"""``--is-scaling-mode``: Megatron-LM's ``pretrain_gpt.py`` traces one fake rank instead of training.

``megatron-dynapipe launch SCRIPT --is-scaling-mode --fake-world-size W --fake-pp P --fake-tp T
--fake-current-rank-id R ...`` (the flags of :func:`~.arguments.add_tracer_arguments`) does not
train: it pretends to be global rank ``R`` of a ``W``-rank job and traces it with
:func:`~megatron_dynapipe.tracer.fake_rank.trace_fake_rank`, then writes
``<--trace-dir>/rank_<R>.trace.jsonl`` and prints one summary line.

Where it happens
    In the launcher, *before* the script runs (:func:`requested` looks for the flag in the
    script's arguments). Megatron-LM's ``pretrain`` starts with ``initialize_megatron``, which
    initialises a real ``torch.distributed`` job (one process per rank, NCCL, a device each)
    before any hook of ours runs, and ``trace_fake_rank`` needs the process *without* a process
    group: it opens its own fake one of ``W`` ranks. Stopping at the launcher also means the
    checkout's training stack (``megatron.training``, its tokenizers, apex/TE checks) is never
    imported; only megatron-core is, from the checkout (its folder is first on ``sys.path``, as for
    the real run). So no ``torchrun`` is needed: one plain process per traced rank.

What is read from the script's arguments (:func:`build_parser`, ``parse_known_args``: every
other ``pretrain_gpt.py`` flag is ignored)
    * the layout: ``--fake-world-size/--fake-pp/--fake-tp`` (required), ``--fake-cp/--fake-ep``
      (else Megatron's ``--context-parallel-size/--expert-model-parallel-size``),
      ``--fake-num-experts`` (else ``--num-experts``), ``--fake-rank-order``, Megatron's
      ``--expert-tensor-parallel-size`` (default TP); ``--fake-dp`` is checked, not needed.
      Megatron's own ``--tensor/pipeline-model-parallel-size`` are not used: the fake sizes
      describe the job.
    * the model: ``--num-layers --hidden-size --num-attention-heads --ffn-hidden-size``
      (default 4 x hidden) ``--vocab-size`` (the tracer pads it as Megatron does, to a multiple of
      128 x TP) ``--seq-length`` ``--untie-embeddings-and-output-weights``, the experts'
      ``--moe-router-topk --moe-ffn-hidden-size --moe-expert-capacity-factor
      --moe-pad-expert-input-to-capacity``; its layers as Megatron-LM builds them:
      ``--transformer-impl`` (default transformer_engine, Megatron-LM's, whose fused attention
      core the trace prices; torch's SDPA computes it where transformer-engine is not installed)
      and ``--dynapipe-attention`` on ``--transformer-impl local``.
    * the batch: ``--micro-batch-size``, ``--global-batch-size`` (default: one micro-batch per
      stage); micro-batches per iteration = global / (micro x fake DP).
    * the iterations: ``--trace-start`` warm-up iterations (default 1), ``--trace-iters``
      traced ones (default 1); ``--trace-dir`` (default ``./traces``, relative to the working
      folder).

Real compute or shapes only
    The rule of ``megatron-dynapipe trace``
    (:func:`~megatron_dynapipe.tracer.trace_budget.decide_shapes_only`): real compute when the
    busiest rank's estimated training memory fits half of this machine's available memory and
    its compute would take at most a minute on the CPU; otherwise shapes-only (meta tensors,
    durations from the analytical cost model).

An invalid layout or batch is a :class:`~.arguments.DynapipeArgumentError`: one line naming the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_dynapipe.config.layout import ParallelLayout, shapes_only_problem
from megatron_dynapipe.config.megatron_options import add_megatron_options, megatron_options_from_args
from megatron_dynapipe.config.model_flags import add_model_arguments, model_from_megatron_args
from megatron_dynapipe.megatron_lm.arguments import DynapipeArgumentError, _validate_tracer, add_arguments
from megatron_dynapipe.megatron_lm.attention import check_attention_args
from megatron_dynapipe.tracer.batch_config import TraceConfig, validate
from megatron_dynapipe.tracer.trace_budget import decide_shapes_only

__all__ = ["FLAG", "ScalingResult", "build_parser", "parse_args", "requested", "run", "run_from_argv"]

FLAG = "--is-scaling-mode"


def requested(script_args: Sequence[str]) -> bool:
    """Whether the script's arguments ask for scaling mode (``--is-scaling-mode``)."""
    return FLAG in script_args


#: Megatron-LM flags that change what a rank does but that the tracer does not trace yet: refused
#: in one line rather than silently traced without (flag -> its dest in Megatron's namespace).
UNTRACED_FLAGS = {
    "--fp8-format": "fp8",
}


def add_megatron_model_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The Megatron-LM flags scaling mode reads (same names, dests and defaults as Megatron's):
    the model's (:func:`~megatron_dynapipe.config.model_flags.add_model_arguments`), the training options
    (:func:`~megatron_dynapipe.config.megatron_options.add_megatron_options`), the precision, the batch and the
    layout, and :data:`UNTRACED_FLAGS`, so that they are refused rather than ignored."""
    add_model_arguments(parser, moe=True, attention="transformer_engine")
    parser.set_defaults(transformer_impl="transformer_engine")  # as Megatron-LM's namespace reads
    add_megatron_options(parser)
    g = parser.add_argument_group(title="megatron training (read by scaling mode)")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    for flag, dest in UNTRACED_FLAGS.items():
        g.add_argument(flag, dest=dest, nargs="?", const=True, default=None, help=argparse.SUPPRESS)
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py --is-scaling-mode", add_help=False, allow_abbrev=False)
    add_megatron_model_arguments(parser)
    return add_arguments(parser)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The namespace scaling mode needs from a ``pretrain_gpt.py`` command line (unknown flags ignored)."""
    args, _unknown = build_parser().parse_known_args(list(argv))
    return args


@dataclasses.dataclass
class ScalingResult:
    """What :func:`run` did: the trace, where it went, and the shapes-only decision."""
    trace: Any
    path: Path
    layout: Any
    shapes_only: bool
    reason: str
    seconds: float

    def summary_line(self) -> str:
        t = self.trace
        return (f"> megatron-dynapipe scaling mode: fake rank {t.rank} (stage {t.stage}) of "
                f"{self.layout.describe()}, {'shapes-only' if self.shapes_only else 'real compute'} "
                f"({self.reason}): {len(t.ops)} ops traced in {self.seconds:.1f} s -> {self.path}")


def _get(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def _require(args: Any, names: Sequence[str]) -> None:
    missing = [f"--{n.replace('_', '-')} N" for n in names if getattr(args, n, None) is None]
    if missing:
        raise DynapipeArgumentError(f"--is-scaling-mode needs the model's {', '.join(missing)} "
                                    "(pretrain_gpt.py model flags)")


def _resolve_fake_sizes(args: argparse.Namespace) -> None:
    """Fall back to Megatron's CP/EP/experts flags where the fake ones were not given."""
    if _get(args, "fake_cp", 1) == 1 and _get(args, "context_parallel_size", 1) > 1:
        args.fake_cp = args.context_parallel_size
    if _get(args, "fake_ep", 1) == 1 and _get(args, "expert_model_parallel_size", 1) > 1:
        args.fake_ep = args.expert_model_parallel_size
    if getattr(args, "fake_num_experts", None) is None and getattr(args, "num_experts", None):
        args.fake_num_experts = args.num_experts


def _refuse_untraced(args: argparse.Namespace) -> None:
    for flag, dest in UNTRACED_FLAGS.items():
        if getattr(args, dest, None):  # Megatron's defaults are all False or None
            raise DynapipeArgumentError(f"--is-scaling-mode does not trace {flag} yet: drop it to trace the "
                                        "job without it")


def _dtype(args: argparse.Namespace) -> str:
    """The precision Megatron-LM trains in: --bf16, --fp16, else float32."""
    return "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else "float32"


def _training(args: argparse.Namespace):
    try:
        return megatron_options_from_args(args)
    except ValueError as exc:
        raise DynapipeArgumentError(f"--is-scaling-mode: {exc}") from None


def _model(args: argparse.Namespace):
    _require(args, ("num_layers", "hidden_size", "num_attention_heads", "seq_length"))
    if not (getattr(args, "vocab_size", None) or getattr(args, "padded_vocab_size", None)):
        raise DynapipeArgumentError("--is-scaling-mode needs --vocab-size N (the tokenizer's vocabulary; "
                                    "the tracer pads it like Megatron)")
    check_attention_args(args)  # the layers Megatron-LM would build, or its refusal
    try:
        return model_from_megatron_args(args).with_experts(_get(args, "fake_num_experts", 0) or 0)
    except ValueError as exc:
        raise DynapipeArgumentError(f"--is-scaling-mode model: {exc}") from None


def run(args: argparse.Namespace, *, shapes_only: Optional[bool] = None, cost_model: Any = None,
        verbose: bool = True) -> ScalingResult:
    """Trace ``--fake-current-rank-id`` of the fake layout in ``args`` and write it to ``--trace-dir``.

    ``args`` is a parsed Megatron(-like) namespace with our arguments (:func:`parse_args`, or
    Megatron's ``parse_args`` with :func:`~.arguments.add_arguments`). ``shapes_only=None`` decides
    by the ``trace`` rule (module docstring). Prints the summary line when ``verbose``.
    """
    if not getattr(args, "is_scaling_mode", False):
        raise DynapipeArgumentError("scaling mode runs only with --is-scaling-mode")
    _resolve_fake_sizes(args)
    _refuse_untraced(args)
    _validate_tracer(args)  # the layout flags; sets args.fake_dp
    model = _model(args)
    training = _training(args)
    _require(args, ("micro_batch_size",))
    seq = int(args.seq_length)
    config = TraceConfig(world_size=args.fake_world_size, pp=args.fake_pp, tp=args.fake_tp,
                         cp=_get(args, "fake_cp", 1), ep=_get(args, "fake_ep", 1),
                         expert_tp=getattr(args, "expert_tensor_parallel_size", None), model=model,
                         micro_batch_size=args.micro_batch_size,
                         global_batch_size=getattr(args, "global_batch_size", None), seq_length=seq,
                         source="--is-scaling-mode")
    reasons = validate(config, training)
    if reasons:
        raise DynapipeArgumentError(f"--is-scaling-mode: {'; '.join(reasons)}: change the fake layout or "
                                    "the model/batch flags")
    layout = ParallelLayout(config.world_size, tp=config.tp, pp=config.pp, cp=config.cp, ep=config.ep,
                            expert_tp=config.expert_tp, order=_get(args, "fake_rank_order", "tp-cp-ep-dp-pp"))
    if shapes_only is None:
        shapes_only, reason = decide_shapes_only(config, training=training)
    else:
        reason = "forced " + ("shapes-only" if shapes_only else "real compute")
    problem = shapes_only and shapes_only_problem(model)
    if problem:
        raise DynapipeArgumentError(f"--is-scaling-mode: {problem}")
    from megatron_dynapipe.tracer.fake_rank import trace_fake_rank

    started = time.perf_counter()
    trace = trace_fake_rank(layout, int(args.fake_current_rank_id), model,
                            micro_batch_size=config.micro_batch_size, num_microbatches=config.microbatches,
                            seq_length=seq, warmup_iters=int(_get(args, "trace_start", 1)),
                            trace_iters=int(_get(args, "trace_iters", 1)), shapes_only=bool(shapes_only),
                            cost_model=cost_model, dtype=_dtype(args), training=training)
    path = trace.write(Path(_get(args, "trace_dir", os.curdir)))
    result = ScalingResult(trace, Path(path), layout, bool(shapes_only), reason, time.perf_counter() - started)
    if verbose:
        print(result.summary_line(), flush=True)
    return result


def run_from_argv(argv: Sequence[str], **kwargs: Any) -> ScalingResult:
    """:func:`run` on a ``pretrain_gpt.py`` command line (the script's arguments)."""
    return run(parse_args(argv), **kwargs)
