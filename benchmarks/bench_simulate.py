"""How well `simulate` predicts a real job's step time on this machine.

    python benchmarks/bench_simulate.py [--nproc 8] [--iters 2] [--json]

1. ``calibrate`` this machine: ``--nproc`` gloo processes, 1 KiB to 16 MiB messages.
2. A real ``--nproc``-process gloo job (megatron-core 1F1B, DDP, Adam) of a small GPT (8 layers,
   hidden 256, 8 heads, sequence 128, micro-batch 2, 8 micro-batches) at four layouts (TP 2 x PP 2,
   PP 4, TP 2, PP 8), one warm-up and ``--iters`` measured iterations, the recorder on every rank.
   The measured iteration time is the slowest rank's end over ``--iters``.
3. Two predictions per layout with the calibrated file:
   * **real traces**: the real job's own representative-rank traces replayed (compute as it ran
     in the job, on shared cores, so not slowed again; communication priced by the calibrated
     links): checks the replay and the links;
   * **fake ranks**: ``trace --real-compute`` of the representative ranks, each alone in a process
     (what a user has before the job exists), replayed with the calibrated file's compute slots.

Prints the table (ms and signed error) and, with ``--json``, one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(num_layers=8, hidden_size=256, num_attention_heads=8, vocab_size=1024, max_sequence_length=256,
             hidden_dropout=0.0, attention_dropout=0.0)
RUN = dict(micro_batch_size=2, num_microbatches=8, seq_length=128, warmup_iters=1, dtype="float32")
LAYOUTS = [dict(tp=2, pp=2), dict(pp=4), dict(tp=2), dict(pp=8)]


def _real_job(rank: int, world: int, iters: int) -> dict:
    from megatron_dynapipe.config.layout import ParallelLayout
    from megatron_dynapipe.tracer.fake_rank import trace_initialized_rank

    return {str(layout): trace_initialized_rank(ParallelLayout(world_size=world, **layout), MODEL, trace_iters=iters,
                                                **RUN).dumps() for layout in LAYOUTS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from megatron_dynapipe.config.model import ModelSpec
    from megatron_dynapipe.local_ranks import run_local_ranks
    from megatron_dynapipe.simulate.calibrate import hardware_from, measure
    from megatron_dynapipe.simulate.replay import simulate_job
    from megatron_dynapipe.simulate.traced_job import load_job
    from megatron_dynapipe.tracer.batch_config import TraceConfig
    from megatron_dynapipe.tracer.batch_run import run_batch
    from megatron_dynapipe.tracer.trace_format import RankTrace

    out = Path(tempfile.mkdtemp(prefix="bench_simulate_"))
    started = time.perf_counter()
    sizes = [1024 * 4**i for i in range(8)]
    points, device = measure(args.nproc, "gloo", sizes, repeats=5, timeout=900)
    hardware = hardware_from(points, device, args.nproc, name="this machine", backend="gloo")
    print(f"calibrated in {time.perf_counter() - started:.0f} s", file=sys.stderr)

    started = time.perf_counter()
    results = run_local_ranks(_real_job, args.nproc, args.iters, timeout=1800)
    print(f"real job, {len(LAYOUTS)} layouts: {time.perf_counter() - started:.0f} s", file=sys.stderr)

    model = ModelSpec(**MODEL)
    configs = [TraceConfig(world_size=args.nproc, pp=lay.get("pp", 1), tp=lay.get("tp", 1), model=model,
                           micro_batch_size=RUN["micro_batch_size"], num_microbatches=RUN["num_microbatches"],
                           seq_length=RUN["seq_length"], index=i) for i, lay in enumerate(LAYOUTS)]
    fake = run_batch(configs, out / "fake", trace_iters=args.iters, shapes_only=False, dtype="float32", progress=False)
    rows = []
    for layout, fake_result in zip(LAYOUTS, fake):
        folder = out / "real" / "_".join(f"{k}{v}" for k, v in layout.items())
        folder.mkdir(parents=True)
        ends = []
        for result in results:
            trace = RankTrace.loads(result[str(layout)])
            trace.write(folder)
            ends.append(max(op.start_us + op.dur_us for op in trace.ops))
        measured = max(ends) / args.iters / 1e3
        # the job's own compute already ran on shared cores: no slowing down a second time
        unshared = dataclasses.replace(hardware, compute_slots_per_node=args.nproc)
        from_real = simulate_job(load_job(folder), unshared).iteration_us / 1e3
        from_fake = simulate_job(load_job(fake_result.folder), hardware).iteration_us / 1e3
        rows.append({"layout": layout, "measured_ms": measured, "real_traces_ms": from_real,
                     "real_traces_error": from_real / measured - 1, "fake_ranks_ms": from_fake,
                     "fake_ranks_error": from_fake / measured - 1})
    if args.json:
        print(json.dumps({"hardware": hardware.to_json(), "rows": rows}))
        return 0
    print(f"{'layout':<16} {'measured ms':>12} {'real traces':>12} {'error':>7} {'fake ranks':>11} {'error':>7}")
    for row in rows:
        name = " ".join(f"{k.upper()}={v}" for k, v in row["layout"].items())
        print(f"{name:<16} {row['measured_ms']:>12.0f} {row['real_traces_ms']:>12.0f} {row['real_traces_error']:>+7.1%}"
              f" {row['fake_ranks_ms']:>11.0f} {row['fake_ranks_error']:>+7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
