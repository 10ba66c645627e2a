"""How long a layout search of GPT-175B on 8192 GPUs takes, and how well its estimates rank.

    python benchmarks/bench_search.py [--max-traced 16] [--world-size 8192] [--global-batch-size 1536]
                                      [--hardware a100] [--cp 1 2] [--json]

Runs ``megatron-dynapipe search`` in this process (fresh output folder, so nothing is reused)
over the whole space (TP, PP, context parallelism ``--cp``, micro-batch size, sequence parallelism,
interleaving, recompute, distributed optimizer) and prints: wall time by phase, how many layouts
were enumerated, pruned, simulated; the top five; the rule of thumb's slowdown; and, over the
simulated layouts, the closed-form estimate's error against the simulation (median and worst)
and Spearman's rank correlation between the two, which says whether tracing the best-*estimated* shapes is a sound shortcut; and
on how many the estimated memory stays at most the traced peak (pruning by it is then safe).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="175")
    parser.add_argument("--world-size", type=int, default=8192)
    parser.add_argument("--global-batch-size", type=int, default=1536)
    parser.add_argument("--hardware", default="a100")
    parser.add_argument("--max-traced", type=int, default=16)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2], metavar="C",
                        help="context-parallel sizes in the space (default 1 2; search's own default has none "
                             "below 8192 tokens)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import numpy as np

    from megatron_dynapipe.config.model import get_model
    from megatron_dynapipe.hardware import load_hardware
    from megatron_dynapipe.simulate.search import SearchSpace, run_search
    from megatron_dynapipe.simulate.search_report import format_search

    model = get_model(args.model)
    space = SearchSpace(model, args.world_size, args.global_batch_size, model.max_sequence_length,
                        load_hardware(args.hardware), cp=tuple(args.cp))
    started = time.perf_counter()
    result = run_search(space, tempfile.mkdtemp(prefix="bench_search_"), max_traced=args.max_traced,
                        progress=sys.stderr.isatty(), say=lambda line: print(line, file=sys.stderr))
    seconds = time.perf_counter() - started
    simulated = [o for o in result.outcomes if o.status == "simulated"]
    errors = [o.estimate.iteration_s / o.report.iteration_s - 1 for o in simulated]
    ranks = [np.argsort(np.argsort(values)) for values in ([o.estimate.iteration_s for o in simulated],
                                                            [o.report.iteration_s for o in simulated])]
    rho = float(np.corrcoef(*ranks)[0, 1])  # Spearman's rho: the correlation of the ranks
    figures = {
        "seconds": seconds, "trace_seconds": result.trace_seconds, "simulate_seconds": result.simulate_seconds,
        **result.counts(), "traced_shapes": result.traced,
        "estimate_error_median": statistics.median(abs(e) for e in errors),
        "estimate_error_worst": max(errors, key=abs), "estimate_rank_correlation": rho,
        "estimate_memory_below_traced": sum(o.estimate.memory_bytes <= o.report.peak_memory_gib * 2**30
                                            for o in simulated),
        "best": result.ranked()[0].candidate.describe() if result.ranked() else None,
        "best_iteration_s": result.ranked()[0].iteration_s if result.ranked() else None,
    }
    print(format_search(result, top=5))
    print(f"\nsearch took {seconds:.0f} s ({result.trace_seconds:.0f} s tracing {result.traced} shapes, "
          f"{result.simulate_seconds:.0f} s simulating {len(simulated)} layouts)")
    print(f"estimate vs simulation over {len(simulated)} layouts: median |error| "
          f"{figures['estimate_error_median']:.1%}, worst {figures['estimate_error_worst']:+.1%}, Spearman rho {rho:.3f}")
    print(f"estimated memory at most the traced peak: {figures['estimate_memory_below_traced']} of {len(simulated)}")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
