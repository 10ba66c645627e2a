"""What one training job asks of the planner: layout, memory budget, search settings."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields

from megatron_dynapipe.planning.documents import DOCUMENTS
from megatron_dynapipe.planning.fast_mode import FastMode
from megatron_dynapipe.planning.schedules import DEFAULT_SCHEDULES, check_chunks, default_schedules
from megatron_dynapipe.planning.schedules import SCHEDULES as REGISTERED_SCHEDULES
from megatron_dynapipe.planning.types import RecomputeType

SCHEDULES = tuple(REGISTERED_SCHEDULES)  # the schedules the planner can choose from, by name
PARTITION_METHODS = ("dp", "token_based", "uniform")
#: "pad": each micro-batch's samples padded to its longest; "varlen": packed into one row, each
#: sample attending to itself alone (megatron-core's THD format), priced by its tokens and squares
PACKINGS = ("pad", "varlen")


def packed_sample_multiple(cp: int) -> int:
    """What each sample of a packed row is padded to a multiple of: under context parallelism it
    splits into 2 x ``cp`` equal chunks (the planner packs with that room, the data pipeline pads so)."""
    return 2 * cp if cp > 1 else 1


@dataclass(frozen=True)
class TrainingSpec:
    """Parallel layout, memory budget and search settings of one training job: checked and put in
    canonical form once, when made (tuples, recompute types parsed, the interleaved schedules where
    the default ones were asked for with several chunks), read-only after; change one with
    ``dataclasses.replace``, which checks it again."""

    num_layers: int = 32
    pp: int = 4
    tp: int = 1
    dp: int = 1
    zero_stage: int = 0
    memory_limit_mb: float = 36_000.0
    fast_mode: FastMode = None
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    recompute_types: tuple[RecomputeType, ...] = tuple(RecomputeType)
    partition: str = "dp"  # micro-batching: dynamic programming, token_based or uniform
    seqlen_round: int = 8  # sequence lengths are padded to a multiple of this
    tokens_per_microbatch: int = 8192  # for partition="token_based"
    microbatch_size: int = 8  # for partition="uniform"
    max_permutations: int = 8
    seed: int = 0
    packing: str = "pad"
    #: transformer layers of each virtual pipeline stage where not split evenly (Megatron-LM's
    #: --decoder-first/last-pipeline-num-layers, --account-for-*-in-pipeline-split): pp x chunks
    #: counts, chunk c of rank s at c pp + s (megatron-core's order); None: even
    stage_layers: tuple[int, ...] | None = None
    #: model chunks a pipeline rank holds (Megatron-LM's --num-virtual-stages-per-pipeline-rank):
    #: above 1 the pipeline is interleaved, and the schedules searched by default are the
    #: interleaved ones
    chunks: int = 1
    #: ranks each micro-batch's rows are split over (Megatron-LM's --context-parallel-size): every
    #: one runs the same plan on its share of the tokens, priced by
    #: :class:`~megatron_dynapipe.planning.cost_model.ContextParallelCostModel`
    cp: int = 1
    #: Megatron-LM's --seq-length: the row its own packings fill (THD rows of whole samples, and
    #: dp_balanced's packs), which a packed plan's search holds as candidates so that it never
    #: returns a plan slower than them; None: the longest sample rounded up to a power of two
    seq_length: int | None = None
    #: "whole": every sample planned whole; "cut": the samples cut at every ``seq_length`` tokens
    #: of their stream, as Megatron-LM's GPT data path cuts documents, and the pieces planned
    #: (:mod:`~megatron_dynapipe.planning.documents`): what a THD-packing job trains
    documents: str = "whole"

    def __post_init__(self) -> None:
        for name in ("num_layers", "pp", "tp", "dp", "seqlen_round", "max_permutations", "chunks", "cp",
                     "tokens_per_microbatch", "microbatch_size"):
            if not _whole(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"TrainingSpec.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not _whole(self.seed) or self.seed < 0:
            raise ValueError(f"TrainingSpec.seed must be an integer >= 0 (numpy's generators take no other), got "
                             f"{self.seed!r}")
        if isinstance(self.schedules, str):  # one schedule named alone, not its characters
            object.__setattr__(self, "schedules", (self.schedules,))
        if not (self.fast_mode is None or isinstance(self.fast_mode, bool) or self.fast_mode == "auto"):
            raise ValueError(f"TrainingSpec.fast_mode must be True, False, \"auto\" or None (DYNAPIPE_FAST_MODE), got "
                             f"{self.fast_mode!r}")
        if self.seq_length is not None and (isinstance(self.seq_length, bool) or not isinstance(self.seq_length, int)
                                            or self.seq_length < 1):
            raise ValueError(f"TrainingSpec.seq_length must be a positive whole number of tokens or None, got "
                             f"{self.seq_length!r}")
        if self.num_layers < self.pp:
            raise ValueError(
                f"{self.num_layers} layers cannot fill {self.pp} pipeline stages: lower pp or raise num_layers"
            )
        if self.stage_layers is None and self.num_layers % (self.pp * self.chunks):
            # Megatron-LM splits layers evenly over the (virtual) stages unless told otherwise
            where, multiple = ((f"pp x chunks = {self.pp} x {self.chunks} virtual", "pp x chunks") if self.chunks > 1
                               else (f"pp = {self.pp}", "pp"))
            raise ValueError(f"{self.num_layers} layers do not split evenly into {where} pipeline stages: make "
                             f"num_layers a multiple of {multiple}, or give stage_layers (Megatron-LM's uneven "
                             "first/last stages)")
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if isinstance(self.memory_limit_mb, bool) or not isinstance(self.memory_limit_mb, numbers.Real) \
                or not 0 < self.memory_limit_mb < float("inf"):  # also refuses nan
            raise ValueError(f"memory_limit_mb must be a positive number of MB, got {self.memory_limit_mb!r}")
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if unknown or not self.schedules:
            raise ValueError(f"unknown schedule(s) {unknown or '(none)'}: choose from {', '.join(SCHEDULES)}")
        self._check_chunks()
        if self.cp > 1 and self.seqlen_round % (2 * self.cp):
            raise ValueError(f"context parallelism splits each row into 2 x cp = {2 * self.cp} chunks: make "
                             f"seqlen_round a multiple of {2 * self.cp} (got {self.seqlen_round})")
        if self.partition not in PARTITION_METHODS:
            raise ValueError(
                f"unknown partition method {self.partition!r}: choose from {', '.join(PARTITION_METHODS)}"
            )
        if self.packing not in PACKINGS:
            raise ValueError(f"unknown packing {self.packing!r}: choose from {', '.join(PACKINGS)}")
        if self.packed and self.partition != "dp":
            raise ValueError(f"packing varlen cuts micro-batches by dynamic programming: partition {self.partition!r} "
                             "pads; use partition dp")
        self._check_documents()
        object.__setattr__(self, "recompute_types", tuple(RecomputeType.parse(r) for r in self.recompute_types))
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
            stages = self.pp * self.chunks
            if len(self.stage_layers) != stages or sum(self.stage_layers) != self.num_layers \
                    or min(self.stage_layers) < 0:
                where = f"{self.pp} x {self.chunks} virtual" if self.chunks > 1 else f"{self.pp}"
                raise ValueError(f"stage_layers {list(self.stage_layers)} do not place {self.num_layers} layers on "
                                 f"{where} pipeline stages: give one count a stage, summing to num_layers")

    def _check_chunks(self) -> None:
        """An interleaved layout as Megatron-LM builds one; the default schedules made interleaved."""
        if self.chunks == 1:
            return
        if self.pp < 2:
            raise ValueError(f"{self.chunks} model chunks a rank need pp >= 2 (an interleaved pipeline), got pp={self.pp}")
        if tuple(self.schedules) == DEFAULT_SCHEDULES:
            object.__setattr__(self, "schedules", default_schedules(self.chunks))
        for name in self.schedules:
            check_chunks(REGISTERED_SCHEDULES[name], self.chunks)

    def _check_documents(self) -> None:
        if self.documents not in DOCUMENTS:
            raise ValueError(f"unknown documents {self.documents!r}: choose from {', '.join(DOCUMENTS)}")
        if self.documents == "whole":
            return
        if self.seq_length is None:
            raise ValueError("documents 'cut' cuts the samples at Megatron-LM's --seq-length: give seq_length")
        multiple = packed_sample_multiple(self.cp) if self.packed else 1
        if self.seq_length % multiple:
            raise ValueError(f"seq_length {self.seq_length} is not a multiple of 2 x cp = {multiple}, as Megatron-LM "
                             "requires of context-parallel rows: round it")

    @property
    def packed(self) -> bool:
        """Whether micro-batches are packed rows (``packing="varlen"``, THD) rather than padded ones."""
        return self.packing == "varlen"

    def to_json(self) -> dict:
        """The spec as JSON values (recompute types by label), for :meth:`from_json`."""
        values = asdict(self)
        values["schedules"] = list(self.schedules)
        values["recompute_types"] = [rc.label for rc in self.recompute_types]
        if self.stage_layers is not None:
            values["stage_layers"] = list(self.stage_layers)
        return values

    @classmethod
    def from_json(cls, values: dict) -> "TrainingSpec":
        """The spec :meth:`to_json` wrote; unknown keys are refused (a newer writer)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown TrainingSpec field(s) {', '.join(unknown)}: written by another version")
        values = dict(values)
        if "schedules" in values:
            values["schedules"] = tuple(values["schedules"])
        if "recompute_types" in values:
            values["recompute_types"] = tuple(values["recompute_types"])
        return cls(**values)


def _whole(value) -> bool:
    """An integer (Python's or numpy's), not a bool, a float or a string."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def seqlen_round_for(cp: int) -> int:
    """The default ``seqlen_round`` made a multiple of what each packed sample is padded to under
    context parallelism (:func:`packed_sample_multiple`), as a sizing layout plans with it."""
    return math.lcm(TrainingSpec.seqlen_round, packed_sample_multiple(cp))
