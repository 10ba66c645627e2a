"""What a layout search says: the top layouts as a table, the rule of thumb's slowdown, and a
picture of predicted time against memory for every candidate; on the user's data, each method's
best layout and real tokens/s, and a picture of them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from megatron_dynapipe.config.model import ATTENTION_WORDS
from megatron_dynapipe.files import atomic_path
from megatron_dynapipe.planning.methods import MEGATRON_PACKINGS, PLANNED
from megatron_dynapipe.simulate.methods import METHODS, MethodsResult
from megatron_dynapipe.simulate.search import Outcome, SearchResult

__all__ = ["format_search", "first_failure", "plot_search", "format_methods", "plot_methods"]

_RECOMPUTE_COLOURS = {"none": "#4C72B0", "selective": "#55A868", "full": "#DD8452"}


def _row(rank: str, o: Outcome) -> str:
    c, r = o.candidate, o.report
    return (f"{rank:>4}  {c.tp:>3} {'on' if c.sequence_parallel else 'off':<3} {c.pp:>3} {c.virtual_stages:>3} "
            f"{c.cp:>3} {c.dp:>5}  {c.micro_batch_size:>3}x{c.num_microbatches:<4} "
            f"{c.recompute:<9} {'on' if c.distributed_optimizer else 'off':<8} {r.iteration_s:>9.4g} "
            f"{r.mfu:>6.1%} {r.bubble_fraction:>7.1%} {r.peak_memory_gib:>9.1f}" + ("" if r.fits else "  (too big)"))


def _settings(s) -> str:
    """The search space's attention core and the overlaps it was asked for, in words."""
    words = [f"attention: {ATTENTION_WORDS[s.model.attention]}"]
    if s.tp_comm_overlap:
        words.append("sequence-parallel layouts overlap TP communication (--tp-comm-overlap)")
    if s.overlap_grad_reduce:
        words.append("gradients reduced during the backward pass (--overlap-grad-reduce)")
    return "  " + "; ".join(words)


def format_search(result: SearchResult, top: int = 10) -> str:
    s, counts, ranked = result.space, result.counts(), result.ranked()
    lines = [
        f"{s.model.label} on {s.world_size} x {s.hardware.name} ({s.hardware.memory_gib:g} GiB), global batch "
        f"{s.global_batch_size} x {s.seq_length} tokens, {s.dtype}; compute from {s.compute_label}",
        _settings(s),
        f"  {counts['enumerated']} layouts: {counts['pruned']} pruned by estimated memory, {counts['estimated']} ranked "
        f"by estimate only, {counts['simulated']} simulated ({counts['simulated_fit']} fit)"
        + (f", {counts['failed']} failed" if counts["failed"] else ""),
        f"  traced {result.traced} shapes in {result.trace_seconds:.0f} s (reused {result.reused}); simulated in "
        f"{result.simulate_seconds:.0f} s",
        "",
        "   #   TP SP   PP VPP  CP    DP  mbs x m  recompute dist-opt    iter s    MFU  bubble  mem GiB",
    ]
    lines += [_row(str(i + 1), o) for i, o in enumerate(ranked[:top])]
    if not ranked and counts["failed"]:
        lines.append(f"   (no layout simulated: {counts['failed']} failed, the first: {first_failure(result)})")
    elif not ranked:
        lines.append("   (no simulated layout fits: see search.json for the candidates and their memory)")
    rule = result.outcome_of(result.rule)
    lines.append("")
    if rule is None:
        lines.append("rule of thumb: its rules lead to no valid layout here")
    elif rule.status != "simulated":
        lines.append(f"rule of thumb: {rule.candidate.describe()} ({rule.status}"
                     + (f": {rule.error}" if rule.error else "") + ")")
    else:
        lines.append("rule of thumb (TP within a node, ~4 B parameters per TP x PP rank, PP below the micro-batches, "
                     "selective recompute, distributed optimizer):")
        lines.append(_row("rule", rule))
        if ranked:
            lines.append(f"  predicted {rule.iteration_s / ranked[0].iteration_s:.2f}x the best layout's iteration time")
    return "\n".join(lines)


def first_failure(result: SearchResult) -> str:
    """The first failed layout's error line, naming its layout."""
    failed = next(o for o in result.outcomes if o.status == "failed")
    return f"{failed.candidate.describe()}: {failed.error}"


def plot_search(result: SearchResult, path: "str | os.PathLike") -> Path:
    """Predicted iteration time against peak memory: simulated layouts coloured by recompute
    (hollow when the traced memory does not fit), the estimated-only ones in grey, the device's
    memory as a line; the best layout and the rule of thumb's marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    estimated = [o for o in result.outcomes if o.status == "estimated"]
    ax.scatter([o.estimate.memory_bytes / 2**30 for o in estimated], [o.estimate.iteration_s for o in estimated],
               s=12, c="#bbbbbb", label="estimated only")
    for recompute, colour in _RECOMPUTE_COLOURS.items():
        done = [o for o in result.outcomes if o.status == "simulated" and o.candidate.recompute == recompute]
        ax.scatter([o.report.peak_memory_gib for o in done], [o.report.iteration_s for o in done], s=30,
                   edgecolors=colour, facecolors=[colour if o.fits else "none" for o in done],
                   label=f"simulated, recompute {recompute}")
    ranked, rule = result.ranked(), result.outcome_of(result.rule)
    if ranked:
        best = ranked[0]
        ax.scatter([best.report.peak_memory_gib], [best.report.iteration_s], marker="*", s=220, c="gold",
                   edgecolors="black", zorder=3, label=f"best: {best.candidate.describe()}")
    if rule is not None and rule.status == "simulated":
        ax.scatter([rule.report.peak_memory_gib], [rule.report.iteration_s], marker="X", s=120, c="black", zorder=3,
                   label="rule of thumb")
    ax.axvline(result.space.hardware.memory_gib, color="red", linestyle="--", linewidth=1, label="device memory")
    s = result.space
    ax.set(xlabel="peak memory per GPU (GiB)", ylabel="predicted iteration time (s)",
           title=f"{s.model.label} on {s.world_size} x {s.hardware.name}, global batch {s.global_batch_size}")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
    return Path(path)


def format_methods(result: MethodsResult) -> str:
    """Each method's best layout, its step time (mean and p95 over the batches), real tokens/s
    and peak memory; then, at every layout priced, each planned method's gain over each
    of Megatron's packed methods (THD packing, dp_balanced)."""
    samples = f"{min(result.samples)}-{max(result.samples)}" if len(set(result.samples)) > 1 else str(result.samples[0])
    lines = [f"On your data ({result.source}): {len(result.samples)} batches of {result.tokens:,} tokens "
             f"({samples} samples), {len(result.layouts())} layouts priced in {result.seconds:.0f} s",
             f"  {'method':<22} {'step s (mean, p95)':>19} {'real tokens/s':>14} {'mem GiB':>8}  best layout, setting"]
    for method in result.methods:
        best = result.best(method)
        if best is None:
            errors = {s.error for s in result.steps if s.method == method and s.error}
            lines.append(f"  {METHODS[method]:<22} {'-':>19} {'-':>14} {'-':>8}  "
                         + ("; ".join(sorted(errors)) if errors else "no layout priced"))
            continue
        lines.append(f"  {METHODS[method]:<22} {best.mean_s:>9.4g} {best.p95_s:>9.4g} {result.tokens / best.mean_s:>14,.0f} "
                     f"{best.peak_memory_gib:>8.1f}  {_short(best.candidate)}, {best.setting}")
    for yardstick in MEGATRON_PACKINGS:
        gains = []
        for method in PLANNED:
            for c in result.layouts():
                ours, theirs = result.at(method, c), result.at(yardstick, c)
                if ours and theirs and ours.ok and theirs.ok:
                    gains.append(f"{METHODS[method]} {_short(c)} {theirs.mean_s / ours.mean_s:.2f}x")
        if gains:
            lines.append(f"  over {METHODS[yardstick]} at the same layout: " + ", ".join(gains))
    for c in result.layouts():
        lines += _why(result, c)
    return "\n".join(lines)


def _why(result: MethodsResult, c) -> list[str]:
    """Each method's step at one layout taken apart (:mod:`~megatron_dynapipe.planning.breakdown`),
    mean over the batches: a loss reads off at once."""
    steps = [step for m in result.methods if (step := result.at(m, c))]
    rows = [(step, why) for step in steps if (why := step.explained())]
    if not rows:
        return []
    ideal = float(np.mean([why["ideal_ms"] for _, why in rows]))
    lines = [f"  why, at {_short(c)} (ms a step, mean over the batches; ideal {ideal:.0f} ms: the real tokens' "
             "compute spread evenly over every rank, no bubble, padding, recompute or communication):",
             f"    {'method':<22} {'step':>7} {'of ideal':>8} {'slowest DP':>10} {'mbs':>5} {'bubble':>7} "
             f"{'padding':>13} {'recompute':>9} {'rest':>6} {'mem GiB':>7}"]
    for step, why in rows:
        lines.append(f"    {METHODS[step.method]:<22} {step.mean_s * 1e3:>7.0f} {why['of_ideal']:>8.2f} "
                     f"{why['above_mean']:>+10.1%} {why['microbatches']:>5.0f} {why['bubble_ms']:>7.0f} "
                     f"{why['padding_ms']:>6.0f} ({why['padding_share']:>4.0%}) {why['recompute_ms']:>9.0f} "
                     f"{why['rest_ms']:>6.0f} {why['peak_memory_mb'] / 1024:>7.1f}")
    lines.append("    (of ideal: the ideal over the step's pipeline; slowest DP: its pipeline over the data-parallel "
                 "ranks' mean; mbs: its micro-batches; bubble: its pipeline less its busiest stage's compute; padding "
                 "and recompute: of that compute; rest: gradient reduction, optimizer step and what else the trace "
                 "holds, the same for every method)")
    if rows[0][1]["rest_ms"] < 0:
        lines.append("    (rest below zero: the planner's cost model prices this layout's traced pipeline above the "
                     "trace's replay, most often context parallelism's ring; every method's step carries that)")
    return lines


def plot_methods(result: MethodsResult, path: "str | os.PathLike") -> Path:
    """Real tokens/s of every method at every layout priced (mean over the batches, the bar's
    line spanning the slowest to the fastest batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = result.layouts()
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(layouts) + 2), 4.5))
    width = 0.8 / max(1, len(result.methods))
    for i, method in enumerate(result.methods):
        xs, mean, low, high = [], [], [], []
        for x, c in enumerate(layouts):
            step = result.at(method, c)
            if step is not None and step.ok:
                rates = [result.tokens / s for s in step.step_s]
                xs.append(x + (i - (len(result.methods) - 1) / 2) * width)
                mean.append(result.tokens / step.mean_s)
                low.append(max(0.0, mean[-1] - min(rates)))  # equal steps: rounding, not a spread
                high.append(max(0.0, max(rates) - mean[-1]))
        ax.bar(xs, mean, width, yerr=[low, high], capsize=2, label=METHODS[method])
    ax.set_xticks(range(len(layouts)), [_short(c) for c in layouts], fontsize=8)
    ax.set(ylabel="real tokens/s", title=f"{len(result.samples)} batches of {result.source}")
    fig.legend(fontsize=8, loc="lower center", ncol=len(result.methods))  # below the bars, not over them
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
    return Path(path)


def _short(c) -> str:
    return (f"TP{c.tp}{' SP' if c.sequence_parallel else ''} PP{c.pp}"
            + (f" VPP{c.virtual_stages}" if c.virtual_stages > 1 else "") + (f" CP{c.cp}" if c.cp > 1 else "")
            + f" DP{c.dp}" + (" dist-opt" if c.distributed_optimizer else ""))
