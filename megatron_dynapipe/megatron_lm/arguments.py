"""Megatron command-line arguments of DynaPipe and of the fake-rank tracer.

    from megatron_dynapipe import add_arguments
    pretrain(..., extra_args_provider=add_arguments)                    # nothing else to chain
    pretrain(..., extra_args_provider=chain_providers(add_modelopt_args, add_arguments))

:func:`add_arguments` adds two argument groups to any ``argparse`` parser (Megatron-LM's
``extra_args_provider`` contract: take the parser, return it):

* ``dynapipe`` -- ``--dynapipe`` switches the planned schedules on; the rest describes the
  planning (memory limit, cost model, schedules, micro-batching, fast mode) and everything needed
  to reproduce a plan (seed, sequence-length rounding, permutations, recompute choices), plus the
  data pipeline's KV store and preprocessing workers and the executor's communication timeout.
* ``fake-rank tracer`` -- run one rank of a much larger job (``--is-scaling-mode`` with the
  ``--fake-*`` layout) and trace iterations (``--do-trace`` ...).

:func:`validate_dynapipe_args` runs after Megatron's own ``validate_args``: it checks the
combination (each error is one line that names the fix), resolves fast mode (the flag, else
``DYNAPIPE_FAST_MODE``, else off) and derived values (``--fake-dp``), and sets what Megatron
forces off but planned schedules need (``variable_seq_lengths``). :func:`training_spec_from_args`
turns validated arguments into the planner's :class:`~megatron_dynapipe.planning.spec.TrainingSpec`.

Nothing here imports torch or megatron: argument handling stays cheap and testable.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Callable, Optional

from megatron_dynapipe.config.layout import experts_problem, layout_problems
from megatron_dynapipe.config.megatron_options import INTERLEAVING_DESTS, megatron_options_from_args
from megatron_dynapipe.config.model import CORES
from megatron_dynapipe.config.model_flags import transformer_engine_layers
from megatron_dynapipe.config.pipeline_split import PipelineSplit
from megatron_dynapipe.hardware import load_hardware
from megatron_dynapipe.planning.cost_model import CostModelError, resolve_cost_model_path
from megatron_dynapipe.planning.fast_mode import fast_mode_from_env
from megatron_dynapipe.planning.flags import add_planner_arguments, planner_settings, positive_int_argument
from megatron_dynapipe.planning.spec import TrainingSpec
from megatron_dynapipe.planning.types import recompute_at_least

__all__ = [
    "DynapipeArgumentError",
    "add_arguments",
    "add_dynapipe_arguments",
    "add_tracer_arguments",
    "chain_providers",
    "validate_dynapipe_args",
    "training_spec_from_args",
    "DYNAPIPE_GROUP",
    "TRACER_GROUP",
]

DYNAPIPE_GROUP = "dynapipe"
TRACER_GROUP = "fake-rank tracer"
DEFAULT_KV_PORT = 29600


class DynapipeArgumentError(ValueError):
    """An invalid DynaPipe or tracer argument; the message is one line that names the fix."""


# --------------------------------------------------------------------------------------------
# Parsers
# --------------------------------------------------------------------------------------------


def _rank_order(text: str) -> str:
    """``tp,cp,ep,dp,pp`` (or Megatron's ``tp-cp-ep-dp-pp``) as Megatron's dash form."""
    parts = [p.strip().lower() for p in text.replace("-", ",").split(",") if p.strip()]
    return "-".join(parts)


def add_dynapipe_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``dynapipe`` argument group to ``parser``; return the parser."""
    g = parser.add_argument_group(title=DYNAPIPE_GROUP)
    g.add_argument("--dynapipe", action="store_true",
                   help="run DynaPipe's planned micro-batches and pipeline schedules in train_step")
    g.add_argument("--dynapipe-memory-limit", type=float, metavar="MB", default=None,
                   help="memory per GPU the planned schedule may use, in MB (required with --dynapipe)")
    add_planner_arguments(g, prefix="dynapipe-")
    g.add_argument("--dynapipe-hardware", default=None, metavar="NAME|FILE",
                   help="the GPUs and links the job runs on (a shipped model such as h100, or a file `megatron-dynapipe "
                        "calibrate` wrote): plans then price the TP group's collectives, each beside its GEMM, and the "
                        "context-parallel ring and pipeline transfers at its links, as `search` does (default: none; "
                        "a job at TP > 1 then plans without its TP collectives)")
    g.add_argument("--dynapipe-attention", choices=CORES, default="local",
                   help="attention core of megatron-core's local layers (--transformer-impl local): local (its "
                        "unfused one) or sdpa (torch's scaled_dot_product_attention: fused kernels on CUDA, and it "
                        "runs --dynapipe-packing varlen); default local")
    g.add_argument("--dynapipe-preprocess-workers", type=int, default=2, metavar="N",
                   help="planning/preprocessing worker processes per node (default 2)")
    g.add_argument("--dynapipe-kv-host", default=None, metavar="HOST",
                   help="host of the KV store that ships plans to the ranks (default: MASTER_ADDR, "
                        "else 127.0.0.1)")
    g.add_argument("--dynapipe-kv-port", type=int, default=DEFAULT_KV_PORT, metavar="PORT",
                   help=f"port of that KV store (default {DEFAULT_KV_PORT}); validation's store takes any free "
                        "port on that host")
    g.add_argument("--dynapipe-comm-timeout", type=float, default=None, metavar="SECONDS",
                   help="fail a pipeline send/receive that waits longer (default: the process "
                        "group's timeout)")
    return parser


def add_tracer_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``fake-rank tracer`` argument group to ``parser``; return the parser."""
    g = parser.add_argument_group(title=TRACER_GROUP)
    g.add_argument("--is-scaling-mode", action="store_true",
                   help="pretend to be one rank (--fake-current-rank-id) of a --fake-world-size job")
    g.add_argument("--fake-world-size", type=positive_int_argument, default=None, metavar="N")
    g.add_argument("--fake-pp", type=positive_int_argument, default=None, metavar="N",
                   help="pipeline-parallel size of the pretended job")
    g.add_argument("--fake-tp", type=positive_int_argument, default=None, metavar="N",
                   help="tensor-parallel size of the pretended job")
    g.add_argument("--fake-dp", type=positive_int_argument, default=None, metavar="N",
                   help="data-parallel size (default: world / (tp*pp*cp); checked when given)")
    g.add_argument("--fake-ep", "--fake-exp", dest="fake_ep", type=positive_int_argument, default=1,
                   metavar="N", help="expert-parallel size (default 1)")
    g.add_argument("--fake-num-experts", type=positive_int_argument, default=None, metavar="N",
                   help="experts per MoE layer (needed with --fake-ep > 1)")
    g.add_argument("--fake-cp", type=positive_int_argument, default=1, metavar="N",
                   help="context-parallel size (default 1)")
    g.add_argument("--fake-gpus-per-node", type=positive_int_argument, default=8, metavar="N",
                   help="GPUs per node of the pretended job (default 8)")
    g.add_argument("--fake-current-rank-id", type=int, default=0, metavar="RANK",
                   help="the global rank this process pretends to be (default 0)")
    g.add_argument("--fake-rank-order", type=_rank_order, default="tp-cp-ep-dp-pp",
                   metavar="LIST", help="Megatron rank order, comma list (default tp,cp,ep,dp,pp)")
    g.add_argument("--do-trace", action=argparse.BooleanOptionalAction, default=False,
                   help="record the compute and communication ops of some iterations")
    g.add_argument("--trace-start", type=int, default=1, metavar="N",
                   help="iterations to run before tracing starts (warm-up, default 1)")
    g.add_argument("--trace-iters", type=positive_int_argument, default=1, metavar="N",
                   help="iterations to trace (default 1)")
    g.add_argument("--trace-dir", default="traces", metavar="DIR",
                   help="where trace files go (default ./traces)")
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: add the ``dynapipe`` and ``fake-rank tracer`` groups."""
    add_dynapipe_arguments(parser)
    add_tracer_arguments(parser)
    return parser


def chain_providers(*providers: "Optional[Callable[[Any], Any]]") -> Callable[[Any], Any]:
    """One ``extra_args_provider`` that runs ``providers`` in turn (``None`` entries skipped).

    ``pretrain_gpt.py`` passes ModelOpt's provider when ModelOpt is installed, else None; keep it:
    ``chain_providers(add_modelopt_args if has_nvidia_modelopt else None, add_arguments)``.
    A provider that returns None (some only mutate the parser) keeps the parser it was given.
    """
    chain = [p for p in providers if p is not None]
    for p in chain:
        if not callable(p):
            raise TypeError(f"argument provider {p!r} is not callable")

    def provider(parser):
        for p in chain:
            result = p(parser)
            if result is not None:
                parser = result
        return parser

    provider.__name__ = "chained_" + "_".join(getattr(p, "__name__", "provider") for p in chain)
    provider.providers = tuple(chain)  # type: ignore[attr-defined]
    return provider


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _get(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def validate_dynapipe_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check and complete DynaPipe and tracer arguments after Megatron's ``validate_args``.

    Works on a plain ``argparse`` namespace too (Megatron's own attributes are then taken at
    their defaults). Raises :class:`DynapipeArgumentError` (one line naming the fix); returns
    ``args`` with ``dynapipe_fast_mode`` resolved (True/False/"auto") and its source in
    ``dynapipe_fast_mode_source`` ("flag", "env" or "default"), ``dynapipe_kv_host`` filled in,
    ``fake_dp`` derived, and, with ``--dynapipe``, ``variable_seq_lengths = True``.
    """
    _validate_tracer(args)
    if not getattr(args, "dynapipe", False):
        return args
    _resolve_fast_mode(args)
    _check_dynapipe_flags(args)
    _check_megatron_flags(args)
    try:
        training_spec_from_args(args)
    except ValueError as exc:
        raise DynapipeArgumentError(f"--dynapipe: {exc}") from None

    # Megatron's validate_args forces this off; planned micro-batches vary in sequence length.
    # (The executor takes shapes from the plan; megatron-core's own schedules, used for batches
    # that are not planned, then exchange shapes before each transfer.)
    args.variable_seq_lengths = True
    if not getattr(args, "calculate_per_token_loss", False):
        warnings.warn(
            "--dynapipe micro-batches differ in size: --calculate-per-token-loss weights every token "
            "equally; without it each micro-batch's mean loss counts the same",
            stacklevel=2,
        )
    return args


def _check_dynapipe_flags(args: argparse.Namespace) -> None:
    """DynaPipe's own flags: values in range; the KV host filled in."""
    limit = getattr(args, "dynapipe_memory_limit", None)
    if limit is None:
        raise DynapipeArgumentError(
            "--dynapipe needs --dynapipe-memory-limit MB: the memory per GPU the planned schedule may use"
        )
    if not limit > 0:
        raise DynapipeArgumentError(f"--dynapipe-memory-limit must be positive, got {limit}: pass the per-GPU MB")
    cost_model = getattr(args, "dynapipe_cost_model", None)
    if cost_model is not None:

        try:
            resolve_cost_model_path(cost_model, flag="--dynapipe-cost-model")
        except CostModelError as error:
            raise DynapipeArgumentError(f"{error}, or drop the flag for the analytical model") from None
    hardware = getattr(args, "dynapipe_hardware", None)
    if hardware is not None:
        try:
            load_hardware(hardware)
        except ValueError as error:
            raise DynapipeArgumentError(f"--dynapipe-hardware: {error}, or drop the flag") from None
    workers = _get(args, "dynapipe_preprocess_workers", 2)
    if workers < 1:
        raise DynapipeArgumentError(
            f"--dynapipe-preprocess-workers must be at least 1, got {workers}: pass e.g. --dynapipe-preprocess-workers 2"
        )
    port = _get(args, "dynapipe_kv_port", DEFAULT_KV_PORT)
    if not 0 < port < 65536:
        raise DynapipeArgumentError(f"--dynapipe-kv-port {port} is not a TCP port: pass one in 1..65535")
    if getattr(args, "dynapipe_kv_host", None) is None:
        args.dynapipe_kv_host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    timeout = getattr(args, "dynapipe_comm_timeout", None)
    if timeout is not None and not timeout > 0:
        raise DynapipeArgumentError(
            f"--dynapipe-comm-timeout must be positive, got {timeout}: drop it to use the process group's timeout"
        )


def _uneven_split_problem(args: argparse.Namespace) -> "str | None":
    """Why megatron-core cannot build the uneven stages asked for, into their model chunks (an
    even split is checked with the rest of the layout)."""
    split = PipelineSplit.from_args(args)
    if split.even:
        return None
    layers, pp = _get(args, "num_layers", 1), _get(args, "pipeline_model_parallel_size", 1)
    chunks = model_chunks(args)
    return split.problem(layers, pp) or (split.chunks_problem(layers, pp, chunks) if chunks > 1 else None)


def _check_megatron_flags(args: argparse.Namespace) -> None:
    """Megatron flags that cannot go with variable-length planned micro-batches: every one refused,
    in one line."""
    problems: list[str] = []
    refuse = problems.append
    uneven = _uneven_split_problem(args)
    if uneven:
        refuse(uneven)
    granularity = getattr(args, "recompute_granularity", None)
    if granularity == "full" and (getattr(args, "recompute_method", None) != "uniform"
                                  or _get(args, "recompute_num_layers", 1) != 1):
        refuse(
            "--dynapipe's full recompute checkpoints every layer on its own (what its cost model prices): with "
            "--recompute-granularity full pass --recompute-method uniform --recompute-num-layers 1")
    if _get(args, "moe_token_dispatcher_type", "allgather") == "allgather":
        if getattr(args, "num_experts", None):
            refuse(
                "--dynapipe's variable-length micro-batches need --moe-token-dispatcher-type alltoall "
                "(the allgather dispatcher assumes one sequence length)"
            )
        if hasattr(args, "moe_token_dispatcher_type"):
            # TransformerConfig refuses variable_seq_lengths with the allgather dispatcher even for a
            # dense model, which never dispatches tokens: alltoall changes nothing else there.
            args.moe_token_dispatcher_type = "alltoall"
    if getattr(args, "cuda_graph_impl", "none") == "local" or getattr(args, "enable_cuda_graph", False):
        refuse(
            "CUDA graphs replay fixed shapes and --dynapipe varies them: drop --enable-cuda-graph / --cuda-graph-impl"
        )
    if _get(args, "dynapipe_packing", "pad") == "varlen" and not core_takes_packed_rows(args):
        refuse(
            "--dynapipe-packing varlen runs packed (THD) micro-batches, which megatron-core's local attention "
            "refuses: add --dynapipe-attention sdpa, use --transformer-impl transformer_engine, or "
            "--dynapipe-packing pad")
    seqlen_round = _get(args, "dynapipe_seqlen_round", 8)
    tp = _get(args, "tensor_model_parallel_size", 1)
    cp = _get(args, "context_parallel_size", 1)
    if getattr(args, "sequence_parallel", False) and tp > 1 and seqlen_round % tp:
        refuse(
            f"--sequence-parallel splits sequences over TP={tp}: pass --dynapipe-seqlen-round as a multiple "
            f"of {tp} (got {seqlen_round})"
        )
    if cp > 1 and seqlen_round % (2 * cp):
        refuse(
            f"context parallelism splits sequences into 2*CP={2 * cp} chunks: pass --dynapipe-seqlen-round as "
            f"a multiple of {2 * cp} (got {seqlen_round})"
        )
    if problems:
        raise DynapipeArgumentError("; ".join(problems))


def check_data_pipeline_args(args: argparse.Namespace) -> None:
    """Megatron-LM settings DynaPipe's data pipeline (:mod:`.pretrain_hooks`) cannot honour, each
    refused in one line that names the fix (with ``--dynapipe`` only).  :func:`validate_dynapipe_args`
    checks what the planned schedule itself needs, for megatron-core users who bring their own data
    too."""
    problems: list[str] = []
    refuse = problems.append
    if getattr(args, "hybrid_context_parallel", False):
        refuse("--hybrid-context-parallel chooses each sample's CP group itself; --dynapipe plans micro-batches "
               "for one CP size: drop --hybrid-context-parallel (--context-parallel-size stays)")
    for flag, name in (("--fim-data", "fim_data"), ("--use-legacy-models", "use_legacy_models"),
                       ("--reset-position-ids", "reset_position_ids"),
                       ("--reset-attention-mask", "reset_attention_mask"), ("--eod-mask-loss", "eod_mask_loss")):
        if getattr(args, name, False):
            refuse(f"{flag} is a feature of Megatron's packed GPT datasets; --dynapipe trains on whole "
                   f"variable-length samples: drop {flag}")
    if getattr(args, "dataloader_inter_document_masking", False):
        refuse("--dataloader-inter-document-masking packs documents into Megatron's fixed-length rows; --dynapipe "
               "plans its own micro-batches: drop it (--dynapipe-packing varlen packs them without attention "
               "between documents)")
    if getattr(args, "step_batch_size_schedule", None):
        refuse("--step-batch-size-schedule changes the global batch as Megatron's calculator steps it; --dynapipe "
               "plans --global-batch-size samples an iteration: drop it with --dynapipe")
    if getattr(args, "mtp_num_layers", None):
        refuse("--dynapipe does not feed multi-token-prediction layers on middle stages: drop --mtp-num-layers")
    if getattr(args, "iterations_to_skip", None):
        refuse("--iterations-to-skip fast-forwards Megatron's own batches: drop it with --dynapipe")
    if getattr(args, "phase_transition_iterations", None):
        refuse("--phase-transition-iterations restarts Megatron's own data loaders: drop it with --dynapipe")
    if getattr(args, "train_iters", None) is None and getattr(args, "train_samples", None) is None:
        refuse("--dynapipe needs the length of the run: pass --train-iters (or --train-samples)")
    for flag, name in (("--full-validation", "full_validation"),
                       ("--multiple-validation-sets", "multiple_validation_sets")):
        if getattr(args, name, False):
            refuse(f"{flag} is not supported with --dynapipe (validation runs --eval-iters planned batches of the "
                   f"--split valid range): drop {flag}")
    data_flags = ("data_path", "train_data_path", "valid_data_path", "test_data_path", "data_args_path",
                  "per_split_data_args_path")
    if not getattr(args, "mock_data", False) and not any(getattr(args, name, None) for name in data_flags):
        refuse("--dynapipe needs data: pass --data-path (Megatron .bin/.idx prefixes, .jsonl files of token lists, "
               "or with --sft conversations; a blend as WEIGHT PATH ...), the per-split paths, or --mock-data")
    if (getattr(args, "eval_iters", 0) or 0) > 0 and getattr(args, "eval_interval", None) is None:
        refuse("--eval-iters > 0 needs --eval-interval")
    if problems:
        raise DynapipeArgumentError("; ".join(problems))


def _resolve_fast_mode(args: argparse.Namespace) -> None:
    flag = getattr(args, "dynapipe_fast_mode", None)
    if flag is not None:
        args.dynapipe_fast_mode_source = "flag"
        return
    try:
        env = fast_mode_from_env()
    except ValueError as exc:
        raise DynapipeArgumentError(f"{exc}, or pass --dynapipe-fast-mode") from None
    args.dynapipe_fast_mode = False if env is None else env
    args.dynapipe_fast_mode_source = "default" if env is None else "env"


#: the fake-rank flags, as the one layout validator names them in its messages
FAKE_FLAGS = {"world_size": "--fake-world-size", "tp": "--fake-tp", "pp": "--fake-pp", "cp": "--fake-cp",
              "ep": "--fake-ep", "dp": "--fake-dp", "expert_tp": "--fake-tp", "order": "--fake-rank-order",
              "num_experts": "--fake-num-experts"}


def _validate_tracer(args: argparse.Namespace) -> None:
    if getattr(args, "do_trace", False):
        start = _get(args, "trace_start", 1)
        if start < 0:
            raise DynapipeArgumentError(f"--trace-start must be >= 0 (warm-up iterations), got {start}")
        if not getattr(args, "trace_dir", None):
            raise DynapipeArgumentError("--do-trace needs --trace-dir DIR for the trace files")
    if not getattr(args, "is_scaling_mode", False):
        return
    world, pp, tp = (getattr(args, n, None) for n in ("fake_world_size", "fake_pp", "fake_tp"))
    missing = [flag for flag, v in (("--fake-world-size N", world), ("--fake-pp N", pp), ("--fake-tp N", tp))
               if v is None]
    if missing:
        raise DynapipeArgumentError(f"--is-scaling-mode needs {', '.join(missing)}")
    cp, ep = _get(args, "fake_cp", 1), _get(args, "fake_ep", 1)
    order = _get(args, "fake_rank_order", "tp-cp-ep-dp-pp")

    problems = layout_problems(world, tp, pp, cp, ep, dp=getattr(args, "fake_dp", None),
                               order=order, names=FAKE_FLAGS)
    problems.append(experts_problem(getattr(args, "fake_num_experts", None) or 0, ep, FAKE_FLAGS))
    problems = [p for p in problems if p]
    if problems:
        raise DynapipeArgumentError(problems[0])
    rank = _get(args, "fake_current_rank_id", 0)
    if not 0 <= rank < world:
        raise DynapipeArgumentError(
            f"--fake-current-rank-id {rank} is outside the job: pass a rank in 0..{world - 1}"
        )
    args.fake_dp = world // (tp * pp * cp)  # a valid layout's DP


def core_takes_packed_rows(args: argparse.Namespace) -> bool:
    """Whether the job's attention core takes packed (THD) rows: transformer-engine's, or the SDPA
    core on megatron-core's local layers (their unfused core refuses them)."""
    return transformer_engine_layers(args) or _get(args, "dynapipe_attention", "local") == "sdpa"


def training_spec_from_args(args: argparse.Namespace) -> TrainingSpec:
    """The planner's :class:`TrainingSpec` for these (Megatron + DynaPipe) arguments.

    Layout from Megatron's ``--num-layers``, ``--tensor/pipeline/context-parallel-size`` and the
    data-parallel size Megatron derived (``args.data_parallel_size``; else world / (tp*pp*cp));
    ZeRO stage 1 with ``--use-distributed-optimizer``; ``--micro-batch-size`` is the size of a
    uniform partition. Fast mode is the validated setting (None if not validated yet).
    """
    tp = _get(args, "tensor_model_parallel_size", 1)
    pp = _get(args, "pipeline_model_parallel_size", 1)
    dp = getattr(args, "data_parallel_size", None)
    if dp is None:
        world = _get(args, "world_size", tp * pp)
        dp = max(1, world // (tp * pp * _get(args, "context_parallel_size", 1)))
    settings = planner_settings(args, prefix="dynapipe-", cp=_get(args, "context_parallel_size", 1))
    settings["recompute_types"] = _recompute_at_least(settings["recompute_types"],
                                                      getattr(args, "recompute_granularity", None))
    return TrainingSpec(
        num_layers=_get(args, "num_layers", pp),
        pp=pp,
        tp=tp,
        dp=dp,
        cp=_get(args, "context_parallel_size", 1),
        zero_stage=1 if getattr(args, "use_distributed_optimizer", False) else 0,
        memory_limit_mb=_get(args, "dynapipe_memory_limit", TrainingSpec.memory_limit_mb),
        microbatch_size=_get(args, "micro_batch_size", TrainingSpec.microbatch_size),
        stage_layers=stage_layers(args),
        chunks=model_chunks(args),
        seq_length=getattr(args, "seq_length", None),
        **settings,
    )


def model_chunks(args: argparse.Namespace) -> int:
    """Model chunks a pipeline rank holds: Megatron-LM's virtual pipeline size, as its
    ``validate_args`` derives it from the interleaving flags (also on a namespace it has not
    validated)."""
    size = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if size:
        return int(size)
    if not any(getattr(args, name, None) for name in INTERLEAVING_DESTS):
        return 1
    return megatron_options_from_args(args).virtual_size(_get(args, "num_layers", 1),
                                                         _get(args, "pipeline_model_parallel_size", 1))


def stage_layers(args: argparse.Namespace) -> "tuple[int, ...] | None":
    """The transformer layers megatron-core builds on each virtual pipeline stage (one a rank
    without interleaving) under Megatron-LM's pipeline-split flags (first/last stages of their
    own, the embedding or loss counted as a layer), for the planner to price; None where the
    split is even."""
    split = PipelineSplit.from_args(args)
    if split.even:
        return None
    return tuple(split.chunk_layers(_get(args, "num_layers", 1), _get(args, "pipeline_model_parallel_size", 1),
                                    model_chunks(args)))


def _recompute_at_least(types, granularity: "str | None") -> tuple:
    """Megatron's ``--recompute-granularity`` is a floor: DynaPipe still picks recompute per
    micro-batch, never lighter than it (selective or full; full with it is full)."""
    kept = recompute_at_least(types, granularity)
    if not kept:
        raise DynapipeArgumentError(
            f"--recompute-granularity {granularity} asks for at least {granularity} recompute, --dynapipe-recompute "
            f"allows only {', '.join(t.label for t in types)}: allow {granularity} or drop --recompute-granularity")
    return kept
