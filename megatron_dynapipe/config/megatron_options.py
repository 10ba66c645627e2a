"""How a model is trained, beyond the model and the layout: the Megatron-LM flags that change
which ops a rank issues without changing the model.

* ``--use-distributed-optimizer``: gradients are reduce-scattered over DP (not all-reduced),
  Adam's state is sharded over DP, the updated 16-bit parameters are all-gathered after the
  step, and the grad norm is all-reduced over every rank of the optimizer instance.
* ``--overlap-grad-reduce`` / ``--overlap-param-gather`` / ``--ddp-bucket-size``: the DP
  reduction starts per bucket during the backward pass, the parameter all-gather per bucket
  in the next forward pass (it needs the distributed optimizer), in buckets of that many
  parameters (megatron-core's default when not given: 40 M, and one bucket without overlap).
* ``--recompute-granularity {selective,full}`` with ``--recompute-method {uniform,block}`` and
  ``--recompute-num-layers N`` (``--recompute-activations`` is selective): what megatron-core
  recomputes in the backward pass.  Full recompute runs the checkpointed layers' forward again,
  their TP collectives included.
* ``--sequence-parallel``: activations outside the TP regions are split along the sequence, so
  each TP all-reduce becomes an all-gather before and a reduce-scatter after, and pipeline
  activations shrink by TP.
* ``--tp-comm-overlap`` (with ``--sequence-parallel``): transformer-engine's userbuffers overlap
  the layer's other TP all-gathers and reduce-scatters with the GEMM next to them (megatron-core's
  column-parallel backward runs its own beside its GEMMs anyway).  The tracer records the same ops
  and the option; ``simulate`` prices what each leaves exposed beside its GEMM.
* ``--num-layers-per-virtual-pipeline-stage N`` / ``--num-virtual-stages-per-pipeline-rank V``:
  interleaved 1F1B.  Each pipeline rank holds V model chunks of N layers (the model's layers
  go round the ranks V times), every micro-batch crosses the pipeline V times, and with
  Megatron-LM's default the chunks' sends and receives are posted one by one so that they
  overlap compute (``--no-overlap-p2p-communication`` batches them, and then needs PP > 2).
  The number of micro-batches must be a multiple of PP (megatron-core's micro-batch groups).
* ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` and
  ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``:
  uneven pipeline stages (:mod:`.pipeline_split`).

:class:`MegatronOptions` carries them from the command line (:func:`add_megatron_options`,
:func:`megatron_options_from_args`) to megatron-core's ``TransformerConfig`` (:meth:`transformer_fields`)
and ``DistributedDataParallelConfig`` (:meth:`ddp_fields`).  Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from megatron_dynapipe.config.layout import is_positive_int
from megatron_dynapipe.config.pipeline_split import PipelineSplit

__all__ = ["MegatronOptions", "add_megatron_options", "megatron_options_from_args", "warmup_passes",
           "RECOMPUTE_GRANULARITIES", "RECOMPUTE_METHODS", "INTERLEAVING_DESTS"]

RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
#: Megatron-LM's namespace names of the flags that turn interleaved 1F1B on
INTERLEAVING_DESTS = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")


@dataclass(frozen=True)
class MegatronOptions:
    """Megatron-LM's training flags the tracer honours (module docstring); the defaults are
    Megatron-LM's."""

    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: Optional[int] = None
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    layers_per_virtual_stage: Optional[int] = None
    virtual_stages: Optional[int] = None
    overlap_p2p_comm: bool = True
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    account_for_embedding: bool = False
    account_for_loss: bool = False
    #: whether a column-parallel linear's backward runs its TP collectives beside its GEMMs, as
    #: megatron-core always does; False prices the Megatron-LM of 2021 (SC'21), which waited for
    #: them. No Megatron-LM flag asks for it (its --no-async-tensor-model-parallel-allreduce is gone)
    async_tp_backward: bool = True

    @property
    def split(self) -> PipelineSplit:
        """How the layers go on the pipeline stages (:mod:`.pipeline_split`)."""
        return PipelineSplit(self.first_stage_layers, self.last_stage_layers, self.account_for_embedding,
                             self.account_for_loss)

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise ValueError(problem)

    def _problem(self) -> Optional[str]:
        """Why megatron-core would refuse these options, naming the flag to change; None if it would not."""
        if self.recompute_granularity not in (None, *RECOMPUTE_GRANULARITIES):
            return (f"--recompute-granularity must be one of {', '.join(RECOMPUTE_GRANULARITIES)}, "
                    f"got {self.recompute_granularity!r}")
        if self.recompute_method not in (None, *RECOMPUTE_METHODS):
            return f"--recompute-method must be one of {', '.join(RECOMPUTE_METHODS)}, got {self.recompute_method!r}"
        if self.recompute_granularity == "full":
            if self.recompute_method is None or self.recompute_num_layers is None:
                return "--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers N"
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            return "--recompute-method and --recompute-num-layers go with --recompute-granularity full"
        if self.recompute_num_layers is not None and (not is_positive_int(self.recompute_num_layers)):
            return f"--recompute-num-layers must be a positive integer, got {self.recompute_num_layers!r}"
        if self.bucket_size is not None and not is_positive_int(self.bucket_size):
            return f"--ddp-bucket-size must be a positive integer, got {self.bucket_size!r}"
        if self.overlap_param_gather and not self.distributed_optimizer:
            return "--overlap-param-gather needs --use-distributed-optimizer"
        if self.tp_comm_overlap and not self.sequence_parallel:
            return "--tp-comm-overlap needs --sequence-parallel (Megatron-LM's rule)"
        return self.split.flags_problem() or self._virtual_problem()

    def _virtual_problem(self) -> Optional[str]:
        if self.layers_per_virtual_stage is not None and self.virtual_stages is not None:
            return ("give one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                    "(Megatron-LM's rule)")
        for flag, value in (("--num-layers-per-virtual-pipeline-stage", self.layers_per_virtual_stage),
                            ("--num-virtual-stages-per-pipeline-rank", self.virtual_stages)):
            if value is not None and not is_positive_int(value):
                return f"{flag} must be a positive integer, got {value!r}"
        if self.layers_per_virtual_stage is not None and self.split.uneven:
            return ("uneven pipeline stages take --num-virtual-stages-per-pipeline-rank, not "
                    "--num-layers-per-virtual-pipeline-stage (Megatron-LM's rule)")
        return None

    def virtual_size(self, num_layers: int, pp: int) -> int:
        """Model chunks per pipeline rank (1 without interleaving), as Megatron-LM derives it:
        a rank's layers (the embedding and loss counted where accounted) over the chunk size."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        if self.layers_per_virtual_stage is not None:
            per_rank = (num_layers + self.split.accounted) // pp
            return max(1, per_rank // self.layers_per_virtual_stage)
        return 1

    def chunk_layers(self, num_layers: int, pp: int) -> list[int]:
        """Transformer layers of each virtual stage (chunk ``c`` of rank ``s`` at ``c pp + s``;
        one per rank without interleaving)."""
        return self.split.chunk_layers(num_layers, pp, self.virtual_size(num_layers, pp))

    def rank_chunk_layers(self, num_layers: int, pp: int, stage: int) -> list[int]:
        """Transformer layers of each model chunk of pipeline rank ``stage``."""
        return self.chunk_layers(num_layers, pp)[stage::pp]

    def busiest_rank_layers(self, num_layers: int, pp: int) -> list[int]:
        """:meth:`rank_chunk_layers` of the rank that holds the most layers."""
        return max((self.rank_chunk_layers(num_layers, pp, s) for s in range(pp)), key=sum)

    def at_tp(self, tp: int) -> "MegatronOptions":
        """These options as Megatron-LM runs them at tensor-parallel size ``tp``: its argument
        validation turns ``--sequence-parallel`` off at TP 1 (one batch's flags serve its TP 1
        configs too). With ``--tp-comm-overlap`` Megatron-LM refuses TP 1 instead
        (:meth:`layout_problem`), so the options stay as given."""
        if tp == 1 and self.sequence_parallel and not self.tp_comm_overlap:
            return dataclasses.replace(self, sequence_parallel=False)
        return self

    def layout_problem(self, *, tp: int, num_layers: int, moe: bool = False, pp: int = 1,
                       num_microbatches: Optional[int] = None) -> Optional[str]:
        """Why these options do not go with a layout (one sentence naming the fix), or None."""
        problem = self._interleaving_problem(pp, num_layers, num_microbatches)
        if problem:
            return problem
        if self.tp_comm_overlap and tp == 1:
            return ("--tp-comm-overlap needs sequence parallelism, which Megatron-LM turns off at TP 1: drop "
                    "--tp-comm-overlap or raise TP")
        if moe and tp > 1 and not self.sequence_parallel:
            return ("MoE with tensor parallelism trains with sequence parallelism (megatron-core's rule): "
                    "add --sequence-parallel")
        if self.recompute_num_layers is not None and self.recompute_method == "block":
            layers = max(self.busiest_rank_layers(num_layers, pp))
            if self.recompute_num_layers > layers:
                return (f"--recompute-num-layers {self.recompute_num_layers} is more than the {layers} "
                        "layers of a pipeline stage (--recompute-method block)")
        return None

    def _interleaving_problem(self, pp: int, num_layers: int, num_microbatches: Optional[int]) -> Optional[str]:
        """Megatron-LM's and megatron-core's rules for the layers' split and interleaved 1F1B."""
        problem = self.split.problem(num_layers, pp)
        if problem:
            return problem
        per_rank = (num_layers + self.split.accounted) // pp
        if self.layers_per_virtual_stage is not None and per_rank % self.layers_per_virtual_stage:
            return (f"--num-layers-per-virtual-pipeline-stage {self.layers_per_virtual_stage} does not divide the "
                    f"{per_rank} layers of a pipeline stage: pick a divisor")
        v = self.virtual_size(num_layers, pp)
        if v == 1:
            return None  # one chunk per rank: Megatron-LM runs plain 1F1B
        problem = self.split.chunks_problem(num_layers, pp, v)
        if problem:
            return problem
        if pp < (2 if self.overlap_p2p_comm else 3):
            return ("interleaved 1F1B needs PP > 1 (PP > 2 with --no-overlap-p2p-communication): raise PP or "
                    "drop the virtual pipeline flags")
        if num_microbatches is not None and (num_microbatches < pp or num_microbatches % pp):
            return (f"interleaved 1F1B runs micro-batches in groups of PP={pp}: use a multiple of {pp} "
                    f"micro-batches, not {num_microbatches}")
        return None

    def recomputed_layers(self, chunk_layers: int) -> int:
        """How many of a model chunk's ``chunk_layers`` layers (the whole stage without
        interleaving) run their forward again in the backward pass: all of them with ``uniform``
        (in groups of N), the first N with ``block``."""
        if self.recompute_granularity != "full":
            return 0
        if self.recompute_method == "uniform":
            return chunk_layers
        return min(self.recompute_num_layers, chunk_layers)

    def transformer_fields(self) -> dict[str, Any]:
        """``TransformerConfig`` fields."""
        fields: dict[str, Any] = {"sequence_parallel": self.sequence_parallel}
        if self.recompute_granularity:
            fields.update(recompute_granularity=self.recompute_granularity, recompute_method=self.recompute_method,
                          recompute_num_layers=self.recompute_num_layers)
        return {**fields, **self.split.transformer_fields()}

    def virtual_fields(self, num_layers: int, pp: int) -> dict[str, Any]:
        """``TransformerConfig`` fields of interleaving: none without it (Megatron-LM then turns
        p2p overlap off and batches the sends and receives, megatron-core's default)."""
        v = self.virtual_size(num_layers, pp)
        if v == 1:
            return {}
        return dict(virtual_pipeline_model_parallel_size=v, overlap_p2p_comm=self.overlap_p2p_comm,
                    batch_p2p_comm=not self.overlap_p2p_comm)

    def ddp_fields(self) -> dict[str, Any]:
        """``DistributedDataParallelConfig`` fields (the optimizer's ``use_distributed_optimizer``
        follows the DDP config's)."""
        fields: dict[str, Any] = dict(use_distributed_optimizer=self.distributed_optimizer,
                                      overlap_grad_reduce=self.overlap_grad_reduce,
                                      overlap_param_gather=self.overlap_param_gather)
        if self.bucket_size is not None:
            fields["bucket_size"] = self.bucket_size
        return fields

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def megatron_args(self) -> list[str]:
        """The Megatron-LM flags that ask for these options."""
        out = []
        for flag, on in (("--use-distributed-optimizer", self.distributed_optimizer),
                         ("--overlap-grad-reduce", self.overlap_grad_reduce),
                         ("--overlap-param-gather", self.overlap_param_gather),
                         ("--sequence-parallel", self.sequence_parallel),
                         ("--tp-comm-overlap", self.tp_comm_overlap)):
            if on:
                out.append(flag)
        for flag, value in (("--ddp-bucket-size", self.bucket_size),
                            ("--recompute-granularity", self.recompute_granularity),
                            ("--recompute-method", self.recompute_method),
                            ("--recompute-num-layers", self.recompute_num_layers),
                            ("--num-layers-per-virtual-pipeline-stage", self.layers_per_virtual_stage),
                            ("--num-virtual-stages-per-pipeline-rank", self.virtual_stages)):
            if value is not None:
                out += [flag, str(value)]
        if not self.overlap_p2p_comm and (self.layers_per_virtual_stage or self.virtual_stages):
            out.append("--no-overlap-p2p-communication")
        return out + self.split.megatron_args()

    def trace_key(self) -> list[str]:
        """What tells a layout's traces under these options apart from others': its Megatron-LM
        flags, and the pricing no flag asks for (an older Megatron-LM's waited TP backward)."""
        return self.megatron_args() + ([] if self.async_tp_backward else ["async_tp_backward=false"])


#: Megatron-LM's fully sharded data parallelism: torch's FSDP2 and Megatron's own
FSDP_FLAGS = ("--use-torch-fsdp2", "--use-megatron-fsdp")


def warmup_passes(pp: int, chunks: int = 1, stage: int = 0) -> int:
    """Forward passes pipeline rank ``stage`` runs before its first backward: ``pp - stage - 1``
    under 1F1B; megatron-core's interleaved schedule runs ``2(pp - stage - 1) + (chunks - 1) pp``
    chunk passes.  The first stage's is the longest."""
    return pp - stage - 1 if chunks == 1 else 2 * (pp - stage - 1) + (chunks - 1) * pp


def add_megatron_options(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags for :class:`MegatronOptions` (same names, dests and defaults)."""
    g = parser.add_argument_group("training (Megatron-LM's flags; default: as Megatron-LM)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state over DP: gradient reduce-scatter, parameter all-gather")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce gradients per bucket during the backward pass")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather parameters per bucket during the forward pass (needs --use-distributed-optimizer)")
    g.add_argument("--ddp-bucket-size", type=int, metavar="N", help="parameters per DP bucket")
    g.add_argument("--recompute-activations", action="store_true", help="selective recompute")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES,
                   help="recompute activations in the backward pass (default: none)")
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, help="with full recompute: which layers")
    g.add_argument("--recompute-num-layers", type=int, metavar="N",
                   help="with full recompute: layers per checkpoint (uniform) or checkpointed (block)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split activations outside TP regions along the sequence (TP > 1)")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="overlap TP all-gathers and reduce-scatters with GEMMs (needs --sequence-parallel)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, metavar="N",
                   help="interleaved 1F1B: model chunks of N layers on each pipeline rank")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, metavar="V",
                   help="interleaved 1F1B: V model chunks on each pipeline rank")
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                   help="interleaved 1F1B: batch the pipeline's sends and receives (needs PP > 2)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, metavar="N",
                   help="layers of the first pipeline stage; the rest split evenly (default: an even split)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, metavar="N",
                   help="layers of the last pipeline stage; the rest split evenly (default: an even split)")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="the embedding counts as a layer of the first stage")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="the loss counts as a layer of the last stage")
    for flag in FSDP_FLAGS:
        g.add_argument(flag, action="store_true", help="refused: see --use-distributed-optimizer")


def megatron_options_from_args(args: argparse.Namespace) -> MegatronOptions:
    """The :class:`MegatronOptions` of :func:`add_megatron_options`' flags (ValueError, one line,
    when megatron-core would refuse them)."""
    fsdp = [flag for flag in FSDP_FLAGS if getattr(args, flag[2:].replace("-", "_"), False)]
    if fsdp:
        raise ValueError(f"{fsdp[0]} is not traced: FSDP gathers every layer's parameters before its forward and "
                         "backward and reduce-scatters its gradients, which megatron-core's DDP (what the tracer "
                         "follows) does not; trace --use-distributed-optimizer, which shards the optimizer state "
                         "and reduce-scatters gradients, as the nearest layout")
    granularity = getattr(args, "recompute_granularity", None)
    if getattr(args, "recompute_activations", False):  # Megatron-LM: shorthand for selective
        if granularity not in (None, "selective"):
            raise ValueError("--recompute-activations is selective recompute: drop it or "
                             "--recompute-granularity full")
        granularity = "selective"
    interleaved = any(getattr(args, name, None) is not None for name in INTERLEAVING_DESTS)
    return MegatronOptions(
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
        overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
        bucket_size=getattr(args, "ddp_bucket_size", None),
        recompute_granularity=granularity,
        recompute_method=getattr(args, "recompute_method", None),
        recompute_num_layers=getattr(args, "recompute_num_layers", None),
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        tp_comm_overlap=bool(getattr(args, "tp_comm_overlap", False)),
        layers_per_virtual_stage=getattr(args, "num_layers_per_virtual_pipeline_stage", None),
        virtual_stages=getattr(args, "num_virtual_stages_per_pipeline_rank", None),
        # Megatron-LM turns the overlap off without interleaving, where it means nothing
        overlap_p2p_comm=bool(getattr(args, "overlap_p2p_comm", True)) or not interleaved,
        **dataclasses.asdict(PipelineSplit.from_args(args)),  # its fields are MegatronOptions' own
    )
