"""Trace a batch: the representative ranks of every valid config, one folder per config.

:func:`run_batch` traces each valid config into a folder named by
:meth:`~.batch_config.TraceConfig.folder_name`: the tracer writes each rank's
``rank_<r>.trace.jsonl``, and this module ``fake_rank_<r>.log`` per rank plus the files of
:mod:`.batch_results`.  A config or rank that fails is recorded and the batch goes on; each rank
runs apart (:mod:`.isolation`), so even a crash or an out-of-memory kill stays with that rank.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from megatron_dynapipe.config.layout import ParallelLayout, is_positive_int, shapes_only_problem
from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.planning.cost_model import CostModel
from megatron_dynapipe.progress import progress_bar, progress_enabled
from megatron_dynapipe.tracer.batch_config import TraceConfig, validate
from megatron_dynapipe.tracer.batch_results import (
    FAILED,
    INTERRUPTED,
    INVALID,
    OK,
    ConfigResult,
    RankResult,
    check_traces,
    error_line,
    write_summary,
    write_timeline,
)
from megatron_dynapipe.tracer.isolation import (
    finish_log,
    preload_tracer_modules,
    rank_start_method,
    run_forked_many,
    run_inline,
)
from megatron_dynapipe.tracer.planned import PlannedBatches, PlanRequest, plan_batches
from megatron_dynapipe.tracer.trace_budget import decide_shapes_only, estimated_bytes, memory_budget_bytes
from megatron_dynapipe.tracer.trace_format import RankTrace, TraceFormatError, trace_path

__all__ = ["run_batch", "collect_batch"]

log = logging.getLogger(__name__)

#: ``tracer(layout, rank, model, ...)`` returns a RankTrace (default: fake_rank.trace_fake_rank).
Tracer = Callable[..., Any]


def run_batch(
    configs: Sequence[TraceConfig],
    output_dir: str | os.PathLike = "traces",
    *,
    tracer: Tracer | None = None,
    warmup_iters: int = 1,
    trace_iters: int = 1,
    shapes_only: bool | None = None,
    cost_model: Any = None,
    dtype: str | None = None,
    training: MegatronOptions | None = None,
    isolation: str = "process",
    jobs: int | None = None,
    rank_timeout: float | None = None,
    progress: bool = True,
    progress_stream=None,
    timeline: bool = True,
    plan: PlanRequest | None = None,
) -> list[ConfigResult]:
    """Trace the representative ranks of every valid config; one :class:`ConfigResult` each.

    Invalid configs are skipped with their :func:`validate` reasons (no folder).  Each valid
    config gets ``output_dir/<folder_name>/`` with ``summary.json`` (rewritten atomically after
    every rank, ``"complete": true`` at the end), ``fake_rank_<r>.log`` per rank (moved into
    place when the rank ends) and ``timeline.json`` (unless ``timeline`` is false: hundreds of
    micro-batches on dozens of stages make hundreds of MB of it); ``tracer(layout, rank, model,
    ...)`` returns a :class:`~.trace_format.RankTrace` whose ``write(folder)`` writes
    ``rank_<r>.trace.jsonl`` and returns its path (default tracer: :func:`~.fake_rank.trace_fake_rank`).  Every trace
    is read back before it is merged into the timeline (without one, only its header is read); a
    missing or unreadable one fails its rank.

    ``cost_model`` (a cost model, a profile's path, ``None`` for the tracer's analytical one) is
    passed to the tracer as is, or, if it is a function, called with each config for that
    config's cost model.
    ``dtype`` ("float32", "bfloat16", "float16") is the training precision (default: the
    tracer's, bfloat16 shapes-only and float32 with real compute on CPU).
    ``training`` (distributed optimizer, overlap, recompute, sequence parallelism) applies to every
    config; a config it does not go with (sequence parallelism at TP=1) is skipped as invalid.
    ``shapes_only=None`` decides per config from the estimated bytes and compute time
    (:func:`decide_shapes_only`).
    ``isolation="process"`` runs each rank in a forked child (a crash, an out-of-memory kill or a
    ``rank_timeout`` fails only that rank), ``jobs`` of them at once (default: one per core;
    fewer for a real-compute config whose ranks would not fit in memory together, and each
    child's torch threads share the cores); ``"inline"`` runs ranks one by one in this process
    and isolates Python exceptions only.  A progress bar over configs and ranks is drawn on
    ``progress_stream`` (stderr) when ``progress`` is true and it is a terminal.
    ``plan`` (:class:`~.planned.PlanRequest`) traces a planned method instead of Megatron's
    schedule: each config's batches are drawn and planned here, once, before its ranks start
    (shapes-only; the folder name ends in ``_METHOD<name>``).
    """
    if isolation not in ("process", "inline"):
        raise ValueError(f"isolation must be 'process' or 'inline', got {isolation!r}")
    jobs = available_cores() if jobs is None else jobs
    if not is_positive_int(jobs):
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    if isolation == "process" and not hasattr(os, "fork"):
        isolation = "inline"
    output_dir = Path(output_dir)
    stream = sys.stderr if progress_stream is None else progress_stream
    training = training or MegatronOptions()
    checked = [(config, validate(config, training)) for config in configs]
    valid = [config for config, reasons in checked if not reasons]
    if valid and tracer is None:
        tracer = _default_tracer()  # import torch/megatron once, before any fork
        if rank_start_method() == "fork":  # spawned ranks (a GPU here) import for themselves
            preload_tracer_modules()
    # forked ranks' collections skip what this process holds now (megatron's modules: a third of a
    # shapes-only rank's time went to passes over them), and its pages stay shared
    gc.freeze()
    try:
        return _run_configs(checked, output_dir, tracer, stream, progress, dict(
            warmup_iters=warmup_iters, trace_iters=trace_iters, shapes_only=shapes_only,
            cost_model=cost_model, dtype=dtype, training=training, isolation=isolation, jobs=jobs,
            rank_timeout=rank_timeout, timeline=timeline, plan=plan,
        ), len(valid))
    finally:
        gc.unfreeze()


def _run_configs(checked, output_dir: Path, tracer: Tracer, stream, progress: bool, opts: dict,
                 valid: int) -> list[ConfigResult]:
    results: list[ConfigResult] = []
    with progress_bar(progress_enabled(progress, stream), stream) as bar:
        configs_task = bar.add_task("configs", total=valid)
        for config, reasons in checked:
            if reasons:
                log.warning("skipping config %d (%s): %s", config.index, config.line, "; ".join(reasons))
                results.append(ConfigResult(config, INVALID, reasons=reasons))
                continue
            results.append(_run_config(config, output_dir, tracer, bar, opts))
            if results[-1].status == INTERRUPTED:
                break  # Ctrl-C: the configs after it are not started
            bar.advance(configs_task)
    return results


def _run_config(config: TraceConfig, output_dir: Path, tracer: Tracer, bar, opts: dict) -> ConfigResult:
    start = time.perf_counter()
    plan = opts["plan"]
    result = ConfigResult(config, OK, folder=output_dir / config.folder_name(opts["training"],
                                                                             plan.method if plan else None))
    try:
        layout, reps = config.layout(), config.representatives()
        result.ranks_traced = len(reps)
        options = _rank_options(config, result, opts)
        problem = result.shapes_only and shapes_only_problem(config.model)
        if problem:  # every rank would fail the same way: none is started (nor planned for)
            raise ValueError(problem)
        if plan is not None:
            options["planned"] = _planned(plan, config, layout, options, opts["training"], bar)
        result.folder.mkdir(parents=True, exist_ok=True)
    except Exception as error:  # a config that cannot even start fails alone
        result.status, result.error = FAILED, error_line(error)
    if result.folder.is_dir():
        write_summary(result, complete=result.status == FAILED)
    if result.status == FAILED:
        result.seconds = time.perf_counter() - start
        log.error("config %d (%s) failed: %s", config.index, config.line, result.error)
        return result

    ranks_task = bar.add_task(f"Config{config.index} {config.line}", total=len(reps))
    try:
        for rank_result in _run_ranks(tracer, config, layout, reps, result.folder, options, opts):
            result.ranks.append(rank_result)
            result.note(rank_result)
            result.seconds = time.perf_counter() - start
            write_summary(result, complete=False)
            bar.advance(ranks_task)
    except KeyboardInterrupt:  # the folder says so; run_batch stops after this config
        result.status, result.error = INTERRUPTED, f"interrupted after {len(result.ranks)} of {len(reps)} ranks"
        for partial in result.folder.glob(".fake_rank_*.log.partial"):  # no hidden logs left behind
            finish_log(partial, partial.with_name(partial.name[1:-len(".partial")]), ["# status interrupted"])
        result.seconds = time.perf_counter() - start
        write_summary(result, complete=False)
        return result
    bar.remove_task(ranks_task)
    result.order_ranks([rep.global_rank for rep in reps])
    write_timeline(result) if opts["timeline"] else check_traces(result)
    result.seconds = time.perf_counter() - start
    write_summary(result)
    return result


def collect_batch(configs: Sequence[TraceConfig], output_dir: str | os.PathLike = "traces", *,
                  training: MegatronOptions | None = None) -> list[ConfigResult]:
    """The results of configs whose ranks were traced elsewhere, one process each (``megatron-dynapipe
    launch pretrain_gpt.py ... --is-scaling-mode --trace-dir <folder>``), read from their folders;
    each folder gets the ``summary.json`` and ``timeline.json`` :func:`run_batch` writes. A rank
    whose trace is missing or unreadable fails its config; invalid configs are skipped."""
    output_dir, training = Path(output_dir), training or MegatronOptions()
    results = []
    for config in configs:
        reasons = validate(config, training)
        results.append(ConfigResult(config, INVALID, reasons=reasons) if reasons
                       else _collect_config(config, output_dir, training))
    return results


def _collect_config(config: TraceConfig, output_dir: Path, training: MegatronOptions) -> ConfigResult:
    """A config's traced ranks, read; its time is what their tracing took (each trace says), not
    the reading."""
    result = ConfigResult(config, OK, folder=output_dir / config.folder_name(training))
    reps = config.representatives()
    result.ranks_traced = len(reps)
    if not result.folder.is_dir():
        result.status, result.error = FAILED, f"{result.folder} does not exist: trace the config's ranks first"
        return result
    traces = {}
    for rep in reps:
        log_file = result.folder / f"fake_rank_{rep.global_rank}.log"  # the launcher run's output
        rank = RankResult(rep.global_rank, rep.stage, rep.ep_rank, OK,
                          log=log_file.name if log_file.is_file() else None)
        path = trace_path(result.folder, rep.global_rank)
        try:
            trace = traces[rep.global_rank] = RankTrace.read(path)
            rank.files, rank.stats = [path.name], _trace_stats(trace)
            rank.seconds = float(trace.meta.get("trace_seconds", 0.0))
        except FileNotFoundError:
            rank.status, rank.error = FAILED, f"no {path.name}" + (f": see {rank.log}" if rank.log else "")
        except (OSError, TraceFormatError) as error:
            rank.status, rank.error = FAILED, f"unreadable {path.name}: {error_line(error)}"
        result.ranks.append(rank)  # in the config's order: the first failure is the config's error
        result.note(rank)
    modes = {trace.mode for trace in traces.values()}
    if len(modes) == 1:  # each launcher run chose shapes-only or real compute by the same rule
        result.shapes_only, result.shapes_only_reason = modes == {"shapes_only"}, "as the ranks were traced"
    write_timeline(result, traces)
    result.seconds = sum(rank.seconds for rank in result.ranks)
    write_summary(result)
    return result


def _planned(plan: PlanRequest, config: TraceConfig, layout: ParallelLayout, options: dict,
             training: MegatronOptions, bar) -> PlannedBatches:
    """The config's drawn batches, planned for its layout, with a progress bar."""
    task = bar.add_task(f"Config{config.index} planning {plan.count} batches ({plan.method})", total=plan.count)
    planned = plan_batches(plan, layout, config.model, options["cost_model"], seq_length=config.seq,
                           global_batch=config.global_batch, training=training,
                           progress=lambda: bar.advance(task))
    bar.remove_task(task)
    return planned


def _rank_options(config: TraceConfig, result: ConfigResult, opts: dict) -> dict[str, Any]:
    """The tracer's options for this config's ranks; notes the shapes-only choice in ``result``."""
    if opts["plan"] is not None:
        if opts["shapes_only"] is False:
            raise ValueError("a planned method is traced shapes-only, its compute priced by the planner's cost model: "
                             "drop --real-compute")
        result.shapes_only, result.shapes_only_reason = True, f"a planned method ({opts['plan'].method})"
    elif opts["shapes_only"] is None:
        result.shapes_only, result.shapes_only_reason = decide_shapes_only(
            config, iterations=opts["warmup_iters"] + opts["trace_iters"], training=opts["training"])
    else:
        result.shapes_only = bool(opts["shapes_only"])
        result.shapes_only_reason = "forced " + ("shapes-only" if result.shapes_only else "real compute")
    cost_model = opts["cost_model"]
    if callable(cost_model) and not isinstance(cost_model, CostModel):
        cost_model = cost_model(config)  # a factory: one cost model per config (e.g. per TP)
    options = dict(warmup_iters=opts["warmup_iters"], trace_iters=opts["trace_iters"],
                   shapes_only=result.shapes_only, cost_model=cost_model)
    if opts["dtype"] is not None:  # else the tracer's default for the mode
        options["dtype"] = opts["dtype"]
    if opts["training"] != MegatronOptions():  # else the tracer's default, Megatron-LM's
        options["training"] = opts["training"]
    return options


def _run_ranks(tracer: Tracer, config: TraceConfig, layout: ParallelLayout, reps, folder: Path,
               options: dict, opts: dict) -> Iterator[RankResult]:
    """Trace ``reps``, in parallel forked processes (``opts["jobs"]`` at most) or one by one
    inline; yields each rank's result as it ends, its log moved into place."""
    parallel = _parallel_ranks(config, options, opts["jobs"], len(reps))
    threads = max(1, available_cores() // parallel) if parallel > 1 else None
    jobs, started = [], []
    for rep in reps:
        tmp_log = folder / f".fake_rank_{rep.global_rank}.log.partial"
        try:
            tmp_log.write_text(_log_header(config, layout, rep, options, opts) + "\n")
        except OSError as error:
            yield _rank_result(rep, folder, {"ok": False, "error": error_line(error)}, 0.0)
            continue
        work = functools.partial(_do_rank, tracer, folder, config, layout, rep.global_rank, options,
                                 threads=threads if opts["isolation"] == "process" else None)
        jobs.append((work, tmp_log))
        started.append(rep)
    if opts["isolation"] == "process":
        outcomes = run_forked_many(jobs, parallel, opts["rank_timeout"], rank_start_method())
    else:
        outcomes = _run_inline_each(jobs)
    for index, outcome, seconds in outcomes:
        yield _rank_result(started[index], folder, outcome, seconds)


def _parallel_ranks(config: TraceConfig, options: dict, jobs: int, ranks: int) -> int:
    """How many ranks of ``config`` run at once: ``jobs``, but no more real-compute ranks than
    fit in the memory budget together."""
    parallel = min(jobs, ranks)
    if not options["shapes_only"]:
        need = estimated_bytes(config, options.get("training"))
        parallel = min(parallel, max(1, memory_budget_bytes() // max(1, need)))
    return max(1, parallel)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _run_inline_each(jobs) -> Iterator[tuple[int, dict, float]]:
    for index, (work, log_path) in enumerate(jobs):
        start = time.perf_counter()
        outcome = run_inline(work, log_path)
        yield index, outcome, time.perf_counter() - start


def _log_header(config: TraceConfig, layout: ParallelLayout, rep, options: dict, opts: dict) -> str:
    return (
        f"# fake rank {rep.global_rank} (stage {rep.stage}, ep rank {rep.ep_rank}, coords {tuple(rep.coords)}) "
        f"of config {config.index}: {layout.describe()}, model {config.model.label}, "
        f"mbs {config.micro_batch_size} x {config.microbatches} micro-batches, seq {config.seq}, "
        f"shapes_only={options['shapes_only']}, isolation={opts['isolation']}"
    )


def _rank_result(rep, folder: Path, outcome: dict, seconds: float) -> RankResult:
    """The rank's result from its outcome; its log, ended with the status, moved into place."""
    rank = rep.global_rank
    final_log = folder / f"fake_rank_{rank}.log"
    status = OK if outcome.get("ok") else FAILED
    result = RankResult(rank, rep.stage, rep.ep_rank, status, seconds, outcome.get("error"),
                        log=final_log.name, files=outcome.get("files", []), stats=outcome.get("stats", {}))
    try:
        end = f"# status {status} after {seconds:.3f} s" + (f": {result.error}" if result.error else "")
        finish_log(folder / f".fake_rank_{rank}.log.partial", final_log, [end])
    except OSError as error:
        result.log = None
        if result.status == OK:
            result.status, result.error = FAILED, f"cannot write {final_log.name}: {error}"
    if result.status != OK:
        log.error("rank %d of %s failed: %s", rank, folder.name, result.error)
    return result


def _default_tracer() -> Tracer:
    from megatron_dynapipe.tracer.fake_rank import trace_fake_rank  # imports torch and megatron: only when tracing

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


def _do_rank(tracer: Tracer, folder: Path, config: TraceConfig, layout: ParallelLayout, rank: int,
             options: dict[str, Any], threads: int | None = None) -> dict[str, Any]:
    """Trace one rank and write its files; returns the JSON-able part of its result.  ``threads``
    caps torch's threads (set in a rank process that shares the cores with others)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    log.info("fake rank %d of %s (%s): tracing %s, options %s", rank, config.folder_name(options.get("training")),
             layout.describe(), config.model.label, options)
    trace = tracer(
        layout, rank, config.model,
        micro_batch_size=config.micro_batch_size, num_microbatches=config.microbatches,
        seq_length=config.seq, **options,
    )
    written = trace.write(folder)  # ranks run side by side in one folder: only what it says it wrote
    files = [Path(written).name] if written else []
    log.info("fake rank %d: wrote %s", rank, ", ".join(files) or "no files")
    return {"files": files, "stats": _trace_stats(trace)}
