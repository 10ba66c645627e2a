"""Batch configurations: the layouts one ``trace`` run covers, read and checked.

A configuration line is ``WORLD_SIZE PP TP [CP [EP]]`` (whitespace or commas between fields),
optionally followed by ``key=value`` overrides of the run-wide defaults::

    # world  pp  tp  [cp  ep]   [overrides]
    8192     16  8
    4096     16  4   2          gbs=4096
    1024      4  2   1   8      model=6.7 mbs=2

Keys: ``cp``, ``ep``, ``etp`` (expert tensor parallelism, default TP), ``mbs`` (micro-batch
size), ``nmb`` (micro-batches per iteration), ``gbs`` (global batch size), ``seq`` (sequence
length), ``experts`` (number of experts) and ``model``.  ``#`` starts a comment; blank lines are skipped.

:func:`validate` lists why a configuration cannot run (every rule, each with the numbers that
break it).  Tracing a batch is :func:`~.batch_run.run_batch`; whether a config runs real
compute is :mod:`.trace_budget`; what a batch gives back and writes is :mod:`.batch_results`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from megatron_dynapipe.config.layout import (
    MAX_GLOBAL_BATCH,
    ParallelLayout,
    is_positive_int,
    layers_problem,
    layout_problems,
    model_problems,
)
from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.config.model import ModelSpec, get_model
from megatron_dynapipe.tracer.representatives import Representatives, representative_ranks

__all__ = [
    "ConfigParseError",
    "TraceConfig",
    "parse_config_line",
    "parse_configs",
    "read_config_file",
    "validate",
]

#: Default model of a TraceConfig when neither the line nor the caller names one (the ``trace``
#: command and examples/update_pretrain_gpt.sh default to GPT-6.7B instead: see tracer/cli.py).
DEFAULT_MODEL = "tiny"


class ConfigParseError(ValueError):
    """A configuration line cannot be read; the message names the line and the expected form."""


def _describe_value(value: object) -> str:
    return repr(value) if not isinstance(value, int) or isinstance(value, bool) else str(value)


# --------------------------------------------------------------------------------------------
# one configuration


@dataclass(frozen=True)
class TraceConfig:
    """One parallel layout of one model, with the batch it is traced with.

    Of ``num_microbatches`` and ``global_batch_size`` give either, both (they must agree) or
    neither (then one micro-batch per pipeline stage, the fewest that fill the 1F1B pipeline):
    ``global_batch_size = micro_batch_size * num_microbatches * dp``.  ``seq_length`` defaults
    to the model's.  ``index`` is the config's place in its batch (it is part of the folder
    name) and ``source`` says where it came from (``file:line`` or ``--config``).
    """

    world_size: int
    pp: int
    tp: int
    cp: int = 1
    ep: int = 1
    #: expert tensor-parallel size (None: TP, as Megatron-LM defaults it)
    expert_tp: int | None = None
    model: ModelSpec = field(default_factory=lambda: get_model(DEFAULT_MODEL))
    micro_batch_size: int = 1
    num_microbatches: int | None = None
    global_batch_size: int | None = None
    seq_length: int | None = None
    index: int = 0
    source: str = ""

    # ---- derived sizes (0 where the layout is invalid) ----------------------------------------

    @property
    def dp(self) -> int:
        model = self.pp * self.tp * self.cp
        if not all(is_positive_int(v) for v in (self.world_size, self.pp, self.tp, self.cp)):
            return 0
        return self.world_size // model if self.world_size % model == 0 else 0

    @property
    def microbatches(self) -> int:
        """Micro-batches per iteration on each data-parallel rank."""
        if self.num_microbatches is not None:
            return self.num_microbatches
        if self.global_batch_size is not None:
            per_step = self.micro_batch_size * self.dp
            return self.global_batch_size // per_step if per_step else 0
        return self.pp

    @property
    def global_batch(self) -> int:
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.micro_batch_size * self.microbatches * self.dp

    @property
    def seq(self) -> int:
        return self.seq_length if self.seq_length is not None else self.model.max_sequence_length

    @property
    def expert_tp_size(self) -> int:
        """The experts' tensor-parallel size: ``expert_tp``, else TP (Megatron-LM's default)."""
        return self.expert_tp or self.tp

    @property
    def moe(self) -> bool:
        return self.ep > 1 or self.model.num_experts > 0

    @property
    def line(self) -> str:
        """The ``W PP TP[ CP EP]`` form of the layout."""
        fields = [self.world_size, self.pp, self.tp]
        if self.cp != 1 or self.ep != 1:
            fields.append(self.cp)
        if self.ep != 1:
            fields.append(self.ep)
        return " ".join(str(f) for f in fields)

    def layout(self) -> ParallelLayout:
        """The :class:`ParallelLayout`; raises ``ValueError`` for an invalid config."""
        return ParallelLayout(self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, expert_tp=self.expert_tp)

    def representatives(self) -> Representatives:
        """The ranks traced for this config (one per stage, times EP for MoE)."""
        return representative_ranks(self.layout(), moe=self.moe)

    def folder_name(self, training=None, method: Optional[str] = None) -> str:
        """``SIM_GPT_<MODEL>_Config<i>_WS<W>_PP<P>_TP<T>[_CP<c>][_EP<e>]_DP<D>_nMICROB<n>_MICROB_SIZE<m>_GLOBAL_BATCH<g>``,
        then ``_FLAGS<digest>`` of ``training``'s :meth:`~MegatronOptions.trace_key` where it has one (a
        Megatron flag, or pricing no flag asks for): a layout traced with other training options is
        another trace, in another folder; and
        ``_METHOD<name>`` for a planned method (``trace --method``)."""
        name = f"SIM_GPT_{self.model.label}_Config{self.index}_WS{self.world_size}_PP{self.pp}_TP{self.tp}"
        if self.cp != 1:
            name += f"_CP{self.cp}"
        if self.ep != 1:
            name += f"_EP{self.ep}"
        if self.expert_tp_size != self.tp:
            name += f"_ETP{self.expert_tp_size}"
        name += (
            f"_DP{self.dp}_nMICROB{self.microbatches}_MICROB_SIZE{self.micro_batch_size}"
            f"_GLOBAL_BATCH{self.global_batch}"
        )
        flags = training.trace_key() if training is not None else []
        if flags:
            name += "_FLAGS" + hashlib.sha256(" ".join(flags).encode()).hexdigest()[:8]
        if method:
            name += f"_METHOD{method}"
        return re.sub(r"[^A-Za-z0-9_.-]", "-", name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "source": self.source,
            "line": self.line,
            "world_size": self.world_size,
            "pp": self.pp,
            "tp": self.tp,
            "cp": self.cp,
            "ep": self.ep,
            "expert_tp": self.expert_tp_size,
            "dp": self.dp,
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.microbatches,
            "global_batch_size": self.global_batch,
            "seq_length": self.seq,
            "model": {**self.model.to_json(), "name": self.model.label},
        }


# --------------------------------------------------------------------------------------------
# parsing

_POSITIONAL = ("world_size", "pp", "tp", "cp", "ep")
#: how a configs line names the layout in its messages
LINE_NAMES = {"world_size": "world size", "tp": "TP", "pp": "PP", "cp": "CP", "ep": "EP", "expert_tp": "TP",
              "num_experts": "experts=", "seq_length": "sequence length"}
_KEYS = {
    "cp": "cp",
    "ep": "ep",
    "etp": "expert_tp",
    "expert_tp": "expert_tp",
    "mbs": "micro_batch_size",
    "micro_batch_size": "micro_batch_size",
    "nmb": "num_microbatches",
    "num_microbatches": "num_microbatches",
    "gbs": "global_batch_size",
    "global_batch_size": "global_batch_size",
    "seq": "seq_length",
    "seq_length": "seq_length",
    "experts": "num_experts",
    "num_experts": "num_experts",
    "model": "model",
}
_FORM = "'WORLD_SIZE PP TP [CP [EP]] [key=value ...]'"


def _int(token: str, what: str, where: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise ConfigParseError(f"{where}: {what} must be an integer, got {token!r}; expected {_FORM}") from None


def parse_config_line(
    text: str,
    *,
    index: int = 0,
    source: str = "--config",
    model: str | ModelSpec = DEFAULT_MODEL,
    num_experts: int | None = None,
    **defaults: Any,
) -> TraceConfig | None:
    """One :class:`TraceConfig` from ``text``; ``None`` for a blank or comment-only line.

    ``model``, ``num_experts`` and ``defaults`` (any :class:`TraceConfig` field: micro-batch
    size, sequence length, ...) apply unless the line overrides them.  Raises
    :class:`ConfigParseError` for a line that is not of the documented form; whether the values
    make a runnable layout is :func:`validate`'s job.
    """
    body = text.split("#", 1)[0].replace(",", " ").split()
    if not body:
        return None
    positional: list[int] = []
    overrides: dict[str, Any] = {}
    for token in body:
        if "=" in token:
            key, _, value = token.partition("=")
            name = _KEYS.get(key.strip().lower())
            if name is None:
                raise ConfigParseError(
                    f"{source}: unknown key {key!r}; use one of {', '.join(sorted(set(_KEYS)))}"
                )
            overrides[name] = value if name == "model" else _int(value, key, source)
        elif overrides:
            raise ConfigParseError(f"{source}: {token!r} after key=value fields; expected {_FORM}")
        else:
            positional.append(_int(token, _POSITIONAL[min(len(positional), 4)].upper(), source))
    if not 3 <= len(positional) <= 5:
        raise ConfigParseError(
            f"{source}: expected 3 to 5 numbers, got {len(positional)} in {text.strip()!r}; expected {_FORM}"
        )
    given = dict(zip(_POSITIONAL, positional))
    for key in ("cp", "ep"):
        if key in given and key in overrides and given[key] != overrides[key]:
            raise ConfigParseError(f"{source}: {key} given twice ({given[key]} and {key}={overrides[key]})")
    values = {**defaults, **given, **overrides}
    try:
        shape = get_model(model)
        if "model" in values:  # another size, built with the command's layers
            shape = dataclasses.replace(get_model(values.pop("model")), attention=shape.attention)
    except ValueError as error:
        raise ConfigParseError(f"{source}: {error}") from None
    experts = values.pop("num_experts", num_experts)
    if experts is not None:
        if not isinstance(experts, int) or experts < 0:
            raise ConfigParseError(f"{source}: experts must be an integer >= 0, got {experts!r}")
        shape = shape.with_experts(experts)
    return TraceConfig(model=shape, index=index, source=source, **values)


def parse_configs(
    lines: Iterable[str], *, source: str = "--config", start_index: int = 0,
    unparsable: list[str] | None = None, numbered: bool | None = None, **defaults: Any
) -> list[TraceConfig]:
    """Every config in ``lines`` (numbered from ``start_index``); blank and comment lines skipped.

    ``source`` names where the lines come from; the line number is appended (``configs.txt:3``)
    when ``numbered``, by default for more than one line or a source other than ``--config``. A line that cannot be parsed raises :class:`ConfigParseError`,
    or, when ``unparsable`` is a list, is skipped with its reason appended there.
    """
    configs: list[TraceConfig] = []
    lines = list(lines)
    for number, text in enumerate(lines, start=1):
        if numbered is None:
            numbered = len(lines) > 1 or source != "--config"
        where = f"{source}:{number}" if numbered else source
        try:
            config = parse_config_line(text, index=start_index + len(configs), source=where, **defaults)
        except ConfigParseError as error:
            if unparsable is None:
                raise
            unparsable.append(str(error))
            continue
        if config is not None:
            configs.append(config)
    return configs


def read_config_file(path: str | os.PathLike, *, start_index: int = 0, unparsable: list[str] | None = None,
                     **defaults: Any) -> list[TraceConfig]:
    """Every config in the file at ``path`` (one a line, ``#`` comments; ``unparsable`` as for
    :func:`parse_configs`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigParseError(f"cannot read config file {path}: {error.strerror or error}") from None
    return parse_configs(text.splitlines(), source=str(path), start_index=start_index, unparsable=unparsable,
                         **defaults)


# --------------------------------------------------------------------------------------------
# validation


def validate(config: TraceConfig, training: Optional[MegatronOptions] = None) -> list[str]:
    """Why ``config`` cannot be traced: one sentence per broken rule, empty when it is valid.

    Rules: positive sizes; the layout's (:func:`~.topology.layout_problems`); global batch
    divisible by micro-batch × DP (and consistent with the number of micro-batches when both are
    given); the model's split (:func:`~.topology.model_problems`); and, given ``training``, that
    the options go with the layout (:meth:`~megatron_dynapipe.config.megatron_options.MegatronOptions.layout_problem`).
    """
    c = config
    batch = {"micro-batch size": c.micro_batch_size, "number of micro-batches": c.num_microbatches,
             "global batch size": c.global_batch_size, "sequence length": c.seq_length}
    reasons = [f"{label} must be a positive integer, got {_describe_value(value)}" for label, value in batch.items()
               if not (value is None and label != "micro-batch size") and not is_positive_int(value)]
    if is_positive_int(c.global_batch_size) and c.global_batch_size > MAX_GLOBAL_BATCH:
        reasons.append(f"global batch size {c.global_batch_size:,} is over the {MAX_GLOBAL_BATCH:,} sequences a job may "
                       "have: give the job's real size")
    names = {**LINE_NAMES, "expert_tp": "ETP"} if c.expert_tp is not None else LINE_NAMES
    layout = layout_problems(c.world_size, c.tp, c.pp, c.cp, c.ep, expert_tp=c.expert_tp, names=names)
    if reasons or not all(is_positive_int(v) for v in (c.world_size, c.tp, c.pp, c.cp, c.ep)):
        return layout + reasons  # sizes that are not counts: the rules below cannot be read
    reasons = layout or _global_batch_problems(c)
    # an uneven split (training options) replaces the even split's rule; either is said once
    even = training is None or training.split.even
    reasons += model_problems(c.model, c.tp, c.pp, c.cp, c.ep, seq_length=c.seq, names=names, expert_tp=c.expert_tp,
                              even_layers=even)
    if training is not None and not (even and layers_problem(c.model.num_layers, c.pp)):
        problem = training.at_tp(c.tp).layout_problem(tp=c.tp, pp=c.pp, num_layers=c.model.num_layers,
                                          num_microbatches=c.microbatches, moe=bool(c.model.num_experts))
        reasons += [problem] if problem else []
    return reasons


def _global_batch_problems(c: TraceConfig) -> list[str]:
    per_step = c.micro_batch_size * c.dp
    gbs = c.global_batch_size
    if gbs is None:
        return []
    if gbs % per_step:
        return [f"global batch {gbs} is not divisible by micro-batch × DP = {c.micro_batch_size}×{c.dp} = {per_step}"]
    if c.num_microbatches is not None and gbs != per_step * c.num_microbatches:
        return [f"global batch {gbs} != micro-batch × micro-batches × DP = "
                f"{c.micro_batch_size}×{c.num_microbatches}×{c.dp} = {per_step * c.num_microbatches}"]
    return []  # a positive multiple of micro-batch × DP is at least one step
