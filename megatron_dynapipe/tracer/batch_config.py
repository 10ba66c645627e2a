"""Batch configurations: many parallel layouts traced in one run.

A configuration line is ``WORLD_SIZE PP TP [CP [EP]]`` (whitespace or commas between fields),
optionally followed by ``key=value`` overrides of the run-wide defaults::

    # world  pp  tp  [cp  ep]   [overrides]
    8192     16  8
    4096     16  4   2          gbs=4096
    1024      4  2   1   8      model=6.7 mbs=2

Keys: ``cp``, ``ep``, ``mbs`` (micro-batch size), ``nmb`` (micro-batches per iteration),
``gbs`` (global batch size), ``seq`` (sequence length), ``experts`` (number of experts) and
``model``.  ``#`` starts a comment; blank lines are skipped.

:func:`validate` lists why a configuration cannot run (every rule, each with the numbers that
break it).  :func:`run_batch` traces the representative ranks of each valid one into a folder
named by :meth:`TraceConfig.folder_name`: the tracer writes each rank's ``rank_<r>.trace.jsonl``,
and this module ``fake_rank_<r>.log`` per rank, ``timeline.json`` (every rank merged into one
Chrome/Perfetto timeline) and ``summary.json``, each file atomically.  A config or rank that
fails is recorded and the batch goes on; by default each rank runs in a forked child process,
so even a crash or an out-of-memory kill stays with that rank.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import os
import re
import signal
import sys
import time
import traceback
from contextlib import ExitStack, contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..chrome_trace import ChromeTrace
from ..files import write_atomically
from ..planning.cost_model import CostModel
from ..models import ModelSpec, get_model
from .topology import (
    ParallelLayout,
    Representatives,
    is_positive_int,
    layout_problems,
    model_problems,
    representative_ranks,
)

__all__ = [
    "ConfigParseError",
    "TraceConfig",
    "RankResult",
    "ConfigResult",
    "parse_config_line",
    "parse_configs",
    "read_config_file",
    "validate",
    "memory_budget_bytes",
    "estimated_bytes",
    "estimated_compute_seconds",
    "decide_shapes_only",
    "preload_tracer_modules",
    "progress_enabled",
    "run_batch",
    "batch_summary",
    "exit_code",
]

log = logging.getLogger(__name__)

#: Statuses of a config in a batch ("interrupted": stopped by Ctrl-C, its folder incomplete).
OK, FAILED, INVALID, INTERRUPTED = "ok", "failed", "invalid", "interrupted"
#: Default model of a TraceConfig when neither the line nor the caller names one (the ``trace``
#: command and examples/update_pretrain_gpt.sh default to GPT-6.7B instead: see tracer/cli.py).
DEFAULT_MODEL = "tiny"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.json"


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
        return ParallelLayout(self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)

    def representatives(self) -> Representatives:
        """The ranks traced for this config (one per stage, times EP for MoE)."""
        return representative_ranks(self.layout(), moe=self.moe)

    def folder_name(self) -> str:
        """``SIM_GPT_<MODEL>_Config<i>_WS<W>_PP<P>_TP<T>[_CP<c>][_EP<e>]_DP<D>_nMICROB<n>_MICROB_SIZE<m>_GLOBAL_BATCH<g>``."""
        name = f"SIM_GPT_{self.model.label}_Config{self.index}_WS{self.world_size}_PP{self.pp}_TP{self.tp}"
        if self.cp != 1:
            name += f"_CP{self.cp}"
        if self.ep != 1:
            name += f"_EP{self.ep}"
        name += (
            f"_DP{self.dp}_nMICROB{self.microbatches}_MICROB_SIZE{self.micro_batch_size}"
            f"_GLOBAL_BATCH{self.global_batch}"
        )
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
        shape = get_model(values.pop("model", model))
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


def validate(config: TraceConfig) -> list[str]:
    """Why ``config`` cannot be traced: one sentence per broken rule, empty when it is valid.

    Rules: positive sizes; the layout's (:func:`~.topology.layout_problems`); global batch
    divisible by micro-batch × DP (and consistent with the number of micro-batches when both are
    given); the model's split (:func:`~.topology.model_problems`).
    """
    c, m = config, config.model
    reasons: list[str] = []
    names = {
        "world_size": "world size", "pp": "PP", "tp": "TP", "cp": "CP", "ep": "EP",
        "micro_batch_size": "micro-batch size", "num_microbatches": "number of micro-batches",
        "global_batch_size": "global batch size", "seq_length": "sequence length",
    }
    for key, label in names.items():
        value = getattr(c, key)
        if value is None and key in ("num_microbatches", "global_batch_size", "seq_length"):
            continue
        if not is_positive_int(value):
            reasons.append(f"{label} must be a positive integer, got {_describe_value(value)}")
    if reasons:
        return reasons

    layout = layout_problems(c.world_size, c.tp, c.pp, c.cp, c.ep, names=LINE_NAMES)
    reasons += layout
    dp = c.dp
    if dp and not layout:
        per_step = c.micro_batch_size * dp
        if c.global_batch_size is not None and c.global_batch_size % per_step:
            reasons.append(
                f"global batch {c.global_batch_size} is not divisible by micro-batch × DP = "
                f"{c.micro_batch_size}×{dp} = {per_step}"
            )
        elif (
            c.global_batch_size is not None
            and c.num_microbatches is not None
            and c.global_batch_size != per_step * c.num_microbatches
        ):
            reasons.append(
                f"global batch {c.global_batch_size} != micro-batch × micro-batches × DP = "
                f"{c.micro_batch_size}×{c.num_microbatches}×{dp} = {per_step * c.num_microbatches}"
            )
        elif c.global_batch_size is not None and c.global_batch_size < per_step:
            reasons.append(f"global batch {c.global_batch_size} is smaller than micro-batch × DP = {per_step}")
    reasons += model_problems(m, c.tp, c.pp, c.cp, c.ep, seq_length=c.seq, names=LINE_NAMES)
    return reasons


# --------------------------------------------------------------------------------------------
# real compute or shapes only


#: Floating-point operations per second assumed for real compute on a CPU (fp32, a few cores).
CPU_FLOPS = 5e10
#: Longest real-compute trace of one rank the default accepts before it goes shapes-only.
REAL_COMPUTE_BUDGET_S = 60.0


def memory_budget_bytes() -> int:
    """Bytes a real-compute trace may use: half of the memory available now."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


def estimated_bytes(config: TraceConfig) -> int:
    """Bytes the busiest representative rank of ``config`` needs to really train on CPU."""
    return config.model.training_bytes(
        config.pp, config.tp, config.ep,
        micro_batch_size=config.micro_batch_size, seq_length=config.seq,
        in_flight=min(config.pp, config.microbatches or 1), cp=config.cp,
    )


def estimated_compute_seconds(config: TraceConfig, iterations: int = 2) -> float:
    """Seconds of real compute for the busiest rank over ``iterations`` steps at :data:`CPU_FLOPS`."""
    flops = config.model.training_flops(
        config.pp, config.tp, config.ep, micro_batch_size=config.micro_batch_size,
        seq_length=config.seq, cp=config.cp,
    )
    return flops * max(config.microbatches, 1) * iterations / CPU_FLOPS


def decide_shapes_only(
    config: TraceConfig,
    budget: int | None = None,
    *,
    iterations: int = 2,
    time_budget_s: float = REAL_COMPUTE_BUDGET_S,
) -> tuple[bool, str]:
    """Whether ``config`` is traced shapes-only by default, and why.

    Shapes-only when the estimated bytes of the busiest rank exceed ``budget`` (default: half the
    available memory) -- the model cannot run here -- or when its real compute over
    ``iterations`` steps would take longer than ``time_budget_s`` on this CPU.
    """
    need = estimated_bytes(config)
    budget = memory_budget_bytes() if budget is None else budget
    gib = 2**30
    if need > budget:
        return True, f"estimated {need / gib:.1f} GiB per rank > memory budget {budget / gib:.1f} GiB"
    seconds = estimated_compute_seconds(config, iterations)
    if seconds > time_budget_s:
        return True, (f"fits in memory ({need / gib:.1f} GiB) but real compute would take about "
                      f"{seconds:.0f} s per rank > {time_budget_s:.0f} s")
    return False, (f"estimated {need / gib:.2f} GiB per rank fits budget {budget / gib:.1f} GiB, "
                   f"about {seconds:.1f} s of compute")


# --------------------------------------------------------------------------------------------
# results


@dataclass
class RankResult:
    """What tracing one representative rank gave: ``status`` is "ok" or "failed"."""

    rank: int
    stage: int
    ep_rank: int
    status: str
    seconds: float = 0.0
    error: str | None = None
    log: str | None = None
    files: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 4)}


@dataclass
class ConfigResult:
    """One config of a batch: "ok", "failed" (a rank or the config failed) or "invalid" (skipped)."""

    config: TraceConfig
    status: str
    reasons: list[str] = field(default_factory=list)
    error: str | None = None
    folder: Path | None = None
    ranks: list[RankResult] = field(default_factory=list)
    ranks_traced: int = 0
    shapes_only: bool | None = None
    shapes_only_reason: str = ""
    timeline: str | None = None
    seconds: float = 0.0

    @property
    def reduction_pct(self) -> float | None:
        """How much smaller the traced set is than the job: ``100 * (1 - traced / world)``."""
        if not self.ranks_traced or not is_positive_int(self.config.world_size):
            return None
        return 100.0 * (1.0 - self.ranks_traced / self.config.world_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.config.to_dict(),
            "status": self.status,
            "reasons": list(self.reasons),
            "error": self.error,
            "folder": str(self.folder) if self.folder else None,
            "ranks_in_job": self.config.world_size,
            "ranks_traced": self.ranks_traced,
            "reduction_pct": None if self.reduction_pct is None else round(self.reduction_pct, 4),
            "shapes_only": self.shapes_only,
            "shapes_only_reason": self.shapes_only_reason,
            "timeline": self.timeline,
            "seconds": round(self.seconds, 4),
            "ranks": [r.to_dict() for r in self.ranks],
        }


def batch_summary(results: Sequence[ConfigResult], **extra: Any) -> dict[str, Any]:
    """The whole batch as one JSON-able object (what ``trace --json`` prints)."""
    counts = {s: sum(r.status == s for r in results) for s in (OK, FAILED, INVALID, INTERRUPTED)}
    return {**extra, "configs": [r.to_dict() for r in results], **counts, "exit_code": exit_code(results)}


def exit_code(results: Sequence[ConfigResult], *, strict: bool = False) -> int:
    """0 when every valid config traced; 130 when Ctrl-C stopped the batch; 1 when one failed,
    none was valid, or (``strict``) one was invalid."""
    if any(r.status == INTERRUPTED for r in results):
        return 130  # as a shell reports a command stopped by Ctrl-C
    if any(r.status == FAILED for r in results):
        return 1
    if not any(r.status == OK for r in results):
        return 1
    if strict and any(r.status == INVALID for r in results):
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# summary files


def _write_summary(result: ConfigResult, complete: bool) -> None:
    assert result.folder is not None
    doc = {**result.to_dict(), "complete": complete}
    write_atomically(result.folder / SUMMARY_FILE, json.dumps(doc, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# tracing one rank

Tracer = Callable[..., Any]


#: Modules the fake-rank tracer imports lazily; imported once in the parent before any rank is
#: forked, so that no child pays seconds for them again (their import warnings stay out of the
#: rank logs too).  A missing one is skipped: this is a warm-up, not a dependency list.
PRELOAD_MODULES = (
    "torch.testing._internal.distributed.fake_pg",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
    "megatron.core.transformer.module",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron_dynapipe.compat.cpu_compat",
)


def preload_tracer_modules() -> float:
    """Import :data:`PRELOAD_MODULES` now (quietly); returns the seconds it took."""
    import importlib
    import warnings

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD_MODULES:
            try:
                importlib.import_module(name)
            except Exception as error:  # optional warm-up: the tracer reports real problems
                log.debug("not preloaded %s: %s", name, error)
    return time.perf_counter() - start


def _default_tracer() -> Tracer:
    from .fake_rank import trace_fake_rank  # imports torch and megatron: only when tracing

    return trace_fake_rank


def _trace_stats(trace: Any) -> dict[str, Any]:
    """Small JSON-able facts about a trace for the summary (whatever the trace offers)."""
    stats: dict[str, Any] = {}
    summary = getattr(trace, "summary", None)
    try:
        value = summary() if callable(summary) else summary
        if isinstance(value, dict):
            stats.update(json.loads(json.dumps(value, default=str)))
    except Exception as error:  # a summary is a nicety: never fail the rank for it
        stats["summary_error"] = f"{type(error).__name__}: {error}"
    for name in ("ops", "events", "records"):
        seq = getattr(trace, name, None)
        if isinstance(seq, (list, tuple)) and f"num_{name}" not in stats:
            stats[f"num_{name}"] = len(seq)
    return stats


def _files_in(folder: Path) -> dict[str, float]:
    try:
        return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")}
    except OSError:
        return {}


def _do_rank(tracer: Tracer, folder: Path, config: TraceConfig, layout: ParallelLayout, rank: int,
             options: dict[str, Any]) -> dict[str, Any]:
    """Trace one rank and write its files; returns the JSON-able part of its result."""
    log.info("fake rank %d of %s (%s): tracing %s, options %s", rank, config.folder_name(),
             layout.describe(), config.model.label, options)
    before = _files_in(folder)
    trace = tracer(
        layout, rank, config.model,
        micro_batch_size=config.micro_batch_size, num_microbatches=config.microbatches,
        seq_length=config.seq, **options,
    )
    trace.write(folder)
    after = _files_in(folder)
    files = sorted(name for name, mtime in after.items() if before.get(name) != mtime)
    log.info("fake rank %d: wrote %s", rank, ", ".join(files) or "no files")
    return {"files": files, "stats": _trace_stats(trace)}


def _error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextmanager
def _rank_logging(stream) -> Any:
    """Send this process's log records to ``stream`` (the rank's log) while the rank runs."""
    root = logging.getLogger()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    old_level = root.level
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def _run_inline(work: Callable[[], dict], log_path: Path) -> dict[str, Any]:
    """Run ``work`` here, its output and log records going to ``log_path``."""
    with open(log_path, "a", buffering=1) as stream, ExitStack() as stack:
        stack.enter_context(redirect_stdout(stream))
        stack.enter_context(redirect_stderr(stream))
        stack.enter_context(_rank_logging(stream))
        try:
            return {"ok": True, **work()}
        except Exception as error:  # isolate: the batch goes on
            traceback.print_exc(file=stream)
            return {"ok": False, "error": _error_text(error)}


def _child_main(work: Callable[[], dict], conn, log_path: Path) -> None:
    """Body of a forked rank process: output to the log, result down the pipe."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    logging.getLogger().handlers.clear()
    with _rank_logging(sys.stderr):
        try:
            result = {"ok": True, **work()}
        except BaseException as error:  # the parent records it; nothing escapes this process
            traceback.print_exc()
            result = {"ok": False, "error": _error_text(error)}
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(result)
    conn.close()


def rank_start_method() -> str:
    """How rank processes start: forked from this process (its imports are already warm), unless
    CUDA is initialised here, which a forked child cannot use ("Cannot re-initialize CUDA in
    forked subprocess"); then from a forkserver, a fresh CUDA-free process that imports the
    tracer modules once and forks each rank from itself."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "forkserver"
    return "fork"


def _run_forked(work: Callable[[], dict], log_path: Path, timeout: float | None,
                start_method: str = "fork") -> dict[str, Any]:
    """Run ``work`` in a child process so that a crash, a kill or leaked global state stays
    there (``work`` must pickle unless ``start_method`` is "fork")."""
    import multiprocessing

    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD_MODULES))
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(work, send, log_path), daemon=True)
    child.start()
    send.close()
    try:
        if receive.poll(timeout):
            try:
                return receive.recv()
            except EOFError:
                pass  # died before sending: reported from the exit code below
            finally:
                child.join(10)
                if child.is_alive():  # reported, but stuck on its way out
                    child.kill()
                    child.join()
        else:
            child.kill()
            child.join()
            return {"ok": False, "error": f"timed out after {timeout:g} s (rank process killed)"}
    except BaseException:
        child.kill()
        child.join()
        raise
    finally:
        receive.close()
    if child.exitcode is None:
        child.kill()
        child.join()
    code = child.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return {"ok": False, "error": f"rank process died of {name}{hint}"}
    return {"ok": False, "error": f"rank process exited with code {code} before reporting"}


def _finish_log(tmp: Path, final: Path, lines: Sequence[str]) -> None:
    with open(tmp, "a") as f:
        for line in lines:
            f.write(line + "\n")
    os.replace(tmp, final)


# --------------------------------------------------------------------------------------------
# the batch


class _NoProgress:
    def add_task(self, *args, **kwargs) -> int:
        return 0

    def update(self, *args, **kwargs) -> None:
        pass

    def advance(self, *args, **kwargs) -> None:
        pass

    def remove_task(self, *args, **kwargs) -> None:
        pass


@contextmanager
def _progress(enabled: bool, stream) -> Any:
    if not enabled:
        yield _NoProgress()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=stream)
    if not console.is_terminal:
        yield _NoProgress()
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, redirect_stdout=False, redirect_stderr=False,
                  transient=True) as bar:
        yield bar


def progress_enabled(requested: bool, stream=None) -> bool:
    """A progress bar is drawn only when asked for and ``stream`` (stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(requested and callable(isatty) and isatty())


def run_batch(
    configs: Sequence[TraceConfig],
    output_dir: str | os.PathLike = "traces",
    *,
    tracer: Tracer | None = None,
    warmup_iters: int = 1,
    trace_iters: int = 1,
    shapes_only: bool | None = None,
    cost_model: Any = None,
    isolation: str = "process",
    rank_timeout: float | None = None,
    progress: bool = True,
    progress_stream=None,
) -> list[ConfigResult]:
    """Trace the representative ranks of every valid config; one :class:`ConfigResult` each.

    Invalid configs are skipped with their :func:`validate` reasons (no folder).  Each valid
    config gets ``output_dir/<folder_name>/`` with ``summary.json`` (rewritten atomically after
    every rank, ``"complete": true`` at the end), ``fake_rank_<r>.log`` per rank (moved into
    place when the rank ends) and ``timeline.json``; ``tracer(layout, rank, model, ...)``
    returns a :class:`~.trace_format.RankTrace` whose ``write(folder)`` writes
    ``rank_<r>.trace.jsonl`` (default tracer: :func:`~.fake_rank.trace_fake_rank`).  Every trace
    is read back before it is merged into the timeline; a missing or unreadable one fails its rank.

    ``cost_model`` (a cost model, a profile's path, ``None`` for the tracer's analytical one) is
    passed to the tracer as is, or, if it is a function, called with each config for that
    config's cost model.
    ``shapes_only=None`` decides per config from the estimated bytes and compute time
    (:func:`decide_shapes_only`).
    ``isolation="process"`` runs each rank in a forked child (a crash, an out-of-memory kill or a
    ``rank_timeout`` fails only that rank); ``"inline"`` runs it in this process and isolates
    Python exceptions only.  A progress bar over configs and ranks is drawn on
    ``progress_stream`` (stderr) when ``progress`` is true and it is a terminal.
    """
    if isolation not in ("process", "inline"):
        raise ValueError(f"isolation must be 'process' or 'inline', got {isolation!r}")
    if isolation == "process" and not hasattr(os, "fork"):
        isolation = "inline"
    output_dir = Path(output_dir)
    stream = sys.stderr if progress_stream is None else progress_stream
    results: list[ConfigResult] = []
    checked = [(config, validate(config)) for config in configs]
    valid = [config for config, reasons in checked if not reasons]
    if valid and tracer is None:
        tracer = _default_tracer()  # import torch/megatron once, before any fork
        preload_tracer_modules()
    with _progress(progress_enabled(progress, stream), stream) as bar:
        configs_task = bar.add_task("configs", total=len(valid))
        for config, reasons in checked:
            if reasons:
                log.warning("skipping config %d (%s): %s", config.index, config.line, "; ".join(reasons))
                results.append(ConfigResult(config, INVALID, reasons=reasons))
                continue
            results.append(_run_config(config, output_dir, tracer, bar, dict(
                warmup_iters=warmup_iters, trace_iters=trace_iters, shapes_only=shapes_only,
                cost_model=cost_model, isolation=isolation, rank_timeout=rank_timeout,
            )))
            if results[-1].status == INTERRUPTED:
                break  # Ctrl-C: the configs after it are not started
            bar.advance(configs_task)
    return results


def _run_config(config: TraceConfig, output_dir: Path, tracer: Tracer, bar, opts: dict) -> ConfigResult:
    start = time.perf_counter()
    result = ConfigResult(config, OK, folder=output_dir / config.folder_name())
    try:
        layout = config.layout()
        reps = config.representatives()
        result.ranks_traced = len(reps)
        if opts["shapes_only"] is None:
            result.shapes_only, result.shapes_only_reason = decide_shapes_only(
                config, iterations=opts["warmup_iters"] + opts["trace_iters"])
        else:
            result.shapes_only = bool(opts["shapes_only"])
            result.shapes_only_reason = "forced " + ("shapes-only" if result.shapes_only else "real compute")
        cost_model = opts["cost_model"]
        if callable(cost_model) and not isinstance(cost_model, CostModel):
            cost_model = cost_model(config)  # a factory: one cost model per config (e.g. per TP)
        options = dict(warmup_iters=opts["warmup_iters"], trace_iters=opts["trace_iters"],
                       shapes_only=result.shapes_only, cost_model=cost_model)
        result.folder.mkdir(parents=True, exist_ok=True)
        _write_summary(result, complete=False)
    except Exception as error:  # a config that cannot even start fails alone
        result.status, result.error = FAILED, _error_text(error)
        result.seconds = time.perf_counter() - start
        log.error("config %d (%s) failed: %s", config.index, config.line, result.error)
        if result.folder is not None and result.folder.is_dir():
            _safe_summary(result)
        return result

    ranks_task = bar.add_task(f"Config{config.index} {config.line}", total=len(reps))
    try:
        for rep in reps:
            rank_result = _run_rank(tracer, config, layout, rep, result.folder, options, opts)
            result.ranks.append(rank_result)
            _note_failure(result, rank_result)
            result.seconds = time.perf_counter() - start
            _safe_summary(result, complete=False)
            bar.advance(ranks_task)
    except KeyboardInterrupt:  # the folder says so; run_batch stops after this config
        result.status, result.error = INTERRUPTED, f"interrupted after {len(result.ranks)} of {len(reps)} ranks"
        result.seconds = time.perf_counter() - start
        _safe_summary(result, complete=False)
        return result
    bar.remove_task(ranks_task)
    _write_timeline(result)
    result.seconds = time.perf_counter() - start
    _safe_summary(result)
    return result


def _note_failure(result: ConfigResult, rank: RankResult) -> None:
    if rank.status != OK:
        result.status = FAILED
        result.error = result.error or f"rank {rank.rank}: {rank.error}"


def _write_timeline(result: ConfigResult) -> None:
    """Read every traced rank back (a check that its file is whole) and merge them into one
    Chrome/Perfetto timeline, ``timeline.json``: one process per rank.  A rank whose trace is
    missing or unreadable fails."""
    from .trace_format import RankTrace, TraceFormatError, trace_path

    assert result.folder is not None
    timeline = ChromeTrace(config=result.config.to_dict(), ranks=[r.rank for r in result.ranks])
    merged = 0
    for rank in result.ranks:
        if rank.status != OK:
            continue
        path = trace_path(result.folder, rank.rank)
        try:
            RankTrace.read(path).add_to(timeline)
            merged += 1
        except FileNotFoundError:
            rank.status, rank.error = FAILED, f"the tracer wrote no {path.name}"
        except (OSError, TraceFormatError) as error:
            rank.status, rank.error = FAILED, f"unreadable {path.name}: {_error_text(error)}"
        _note_failure(result, rank)
    if not merged:
        return
    try:
        timeline.write(result.folder / TIMELINE_FILE)
        result.timeline = TIMELINE_FILE
    except OSError as error:
        result.status, result.error = FAILED, result.error or f"cannot write {TIMELINE_FILE}: {error}"


def _safe_summary(result: ConfigResult, complete: bool = True) -> None:
    try:
        _write_summary(result, complete)
    except OSError as error:
        result.status = FAILED
        result.error = result.error or f"cannot write {SUMMARY_FILE}: {error}"


def _run_rank(tracer: Tracer, config: TraceConfig, layout: ParallelLayout, rep, folder: Path,
              options: dict, opts: dict) -> RankResult:
    rank = rep.global_rank
    final_log = folder / f"fake_rank_{rank}.log"
    tmp_log = folder / f".fake_rank_{rank}.log.partial"
    header = (
        f"# fake rank {rank} (stage {rep.stage}, ep rank {rep.ep_rank}, coords {tuple(rep.coords)}) "
        f"of config {config.index}: {layout.describe()}, model {config.model.label}, "
        f"mbs {config.micro_batch_size} x {config.microbatches} micro-batches, seq {config.seq}, "
        f"shapes_only={options['shapes_only']}, isolation={opts['isolation']}"
    )
    start = time.perf_counter()
    try:
        tmp_log.write_text(header + "\n")
        work = functools.partial(_do_rank, tracer, folder, config, layout, rank, options)
        if opts["isolation"] == "process":
            outcome = _run_forked(work, tmp_log, opts["rank_timeout"], rank_start_method())
        else:
            outcome = _run_inline(work, tmp_log)
    except Exception as error:  # e.g. the log cannot be written, fork failed
        outcome = {"ok": False, "error": _error_text(error)}
    seconds = time.perf_counter() - start
    status = OK if outcome.get("ok") else FAILED
    result = RankResult(rank, rep.stage, rep.ep_rank, status, seconds, outcome.get("error"),
                        log=final_log.name, files=outcome.get("files", []), stats=outcome.get("stats", {}))
    try:
        end = f"# status {status} after {seconds:.3f} s" + (f": {result.error}" if result.error else "")
        _finish_log(tmp_log, final_log, [end])
    except OSError as error:
        result.log = None
        if result.status == OK:
            result.status, result.error = FAILED, f"cannot write {final_log.name}: {error}"
    if result.status != OK:
        log.error("config %d rank %d failed: %s", config.index, rank, result.error)
    return result
