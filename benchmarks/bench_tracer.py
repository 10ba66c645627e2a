"""What the fake-rank tracer costs: the fake topology of a W=8192 job, one config vs PP and W,
and the four seed configs at GPT-175B.

    python benchmarks/bench_tracer.py [--json] [--repeat 3] [--model 6.7] [--tp 8]
                                      [--worlds 1024 4096 8192] [--pps 2 4 8] [--real-compute]
    python benchmarks/bench_tracer.py --seed-batch [--jobs N] [--baseline-jobs 1] [--repeat 3]

1. **Fake topology**: torch's fake process group plus megatron-core's
   ``initialize_model_parallel`` for ranks of a W=8192 job (TP=8, PP=16 and TP=2, PP=2),
   median of ``--repeat`` set-ups (the first set-up in the process, which pays for lazy
   imports inside torch and megatron, is reported apart), as the tracer does it (only the
   rank's own groups, :mod:`megatron_dynapipe.tracer.fake_groups`) and, for comparison, as
   megatron-core does it unaided (every group of the job); with the groups created and skipped.
2. **Per config**: :func:`~megatron_dynapipe.tracer.batch_run.run_batch` on one config
   ``W PP TP`` (shapes-only unless ``--real-compute``, one warm-up and one traced iteration,
   one forked process per rank), median of ``--repeat`` runs, for every W in ``--worlds`` and
   PP in ``--pps``: the seconds per config should grow with PP (one rank per stage is traced)
   and stay flat in W.

3. **Seed batch** (``--seed-batch``): the four seed configs at GPT-175B shapes-only ("8192 16 8",
   "8192 32 8", "8192 32 4", "4096 16 4"; 96 ranks), ``--jobs`` ranks at once (default: one per
   core), a line per config as it ends; the whole batch's seconds and the peak resident memory of
   this process and of the largest rank process.  ``--baseline-jobs 1`` runs the batch again one
   rank at a time for the ratio.  After it, one rank (rank 512 of "8192 16 8") is traced inline
   with and without :class:`~megatron_dynapipe.tracer.meta_cache.MetaKernelCache`, median of
   ``--repeat``.

Imports of torch and megatron are paid once, before any timing, and reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dynapipe.config.model import get_model  # noqa: E402
from megatron_dynapipe.tracer.batch_config import TraceConfig  # noqa: E402
from megatron_dynapipe.tracer.batch_run import run_batch  # noqa: E402


def median_of(fn, repeat: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def bench_imports() -> float:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.parallel_state  # noqa: F401
        import torch.distributed  # noqa: F401
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

        from megatron_dynapipe.tracer import fake_rank  # noqa: F401
        from megatron_dynapipe.tracer.isolation import preload_tracer_modules

        preload_tracer_modules()
    return time.perf_counter() - start


def fake_topology(world: int, tp: int, pp: int, rank: int, own_groups: bool = True) -> dict:
    """Stand up (and tear down) the fake process group and megatron's groups for ``rank``: only
    the rank's own groups as the tracer does (``own_groups``), or every group of the job as
    megatron-core does unaided.  Returns the groups created and skipped."""
    import contextlib

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_dynapipe.tracer.fake_groups import member_groups_only

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with member_groups_only() if own_groups else contextlib.nullcontext() as stats:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         create_gloo_process_groups=False)
        assert dist.get_world_size() == world
        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    return {"created": stats.created, "skipped": stats.skipped} if stats else {}


def bench_topology(repeat: int) -> list[dict]:
    rows = []
    for own_groups in (True, False):
        for world, tp, pp, rank in ((8192, 8, 16, 512), (8192, 2, 2, 4096)):
            def one():
                return fake_topology(world, tp, pp, rank, own_groups)

            first_start = time.perf_counter()
            groups = one()
            first = time.perf_counter() - first_start
            median, times = median_of(one, repeat)
            rows.append({"world_size": world, "tp": tp, "pp": pp, "rank": rank,
                         "groups": "own" if own_groups else "all", **groups,
                         "first_s": first, "median_s": median, "times_s": times})
            progress(f"topology W={world} TP={tp} PP={pp} ({'own' if own_groups else 'all'} groups): "
                     f"median {median:.3f} s")
    return rows


def progress(line: str) -> None:
    """A line on stderr as each piece finishes (stdout keeps the table or the JSON)."""
    print(line, file=sys.stderr, flush=True)


def bench_configs(model: str, tp: int, worlds: list[int], pps: list[int], repeat: int,
                  shapes_only: bool) -> list[dict]:
    shape = get_model(model)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for world in worlds:
            for pp in pps:
                config = TraceConfig(world, pp, tp, model=shape)
                row = {"world_size": world, "pp": pp, "tp": tp, "dp": config.dp,
                       "num_microbatches": config.microbatches}

                def one():
                    (result,) = run_batch([config], out, shapes_only=shapes_only, progress=False)
                    if result.status != "ok":
                        raise RuntimeError(f"W={world} PP={pp}: {result.status}: "
                                           f"{result.error or '; '.join(result.reasons)}")
                    row["ranks_traced"] = result.ranks_traced
                    row["ops"] = sum(r.stats.get("ops", 0) for r in result.ranks)

                started = time.perf_counter()
                try:
                    median, times = median_of(one, repeat)
                except RuntimeError as error:
                    row["error"] = str(error)
                else:
                    row.update(median_s=median, times_s=times, per_rank_s=median / row["ranks_traced"])
                rows.append(row)
                progress(f"config W={world} PP={pp} TP={tp}: {len(rows)} of {len(worlds) * len(pps)} done, "
                         f"{time.perf_counter() - started:.1f} s for {repeat} run(s)")
    return rows


SEED_CONFIGS = ("8192 16 8", "8192 32 8", "8192 32 4", "4096 16 4")


def bench_meta_cache(repeat: int) -> dict:
    """One GPT-175B rank traced shapes-only with and without the meta-kernel cache."""
    import contextlib

    from megatron_dynapipe.tracer import fake_rank

    config = TraceConfig(8192, 16, 8, model=get_model("175"))
    times = {}
    for label, cache in (("without cache", contextlib.nullcontext), ("with cache", fake_rank.MetaKernelCache)):
        def one():
            original, fake_rank.MetaKernelCache = fake_rank.MetaKernelCache, cache
            try:
                fake_rank.trace_fake_rank(config.layout(), 512, config.model, micro_batch_size=1,
                                          num_microbatches=config.microbatches, seq_length=config.seq,
                                          shapes_only=True)
            finally:
                fake_rank.MetaKernelCache = original

        times[label] = median_of(one, repeat)[0]
        progress(f"one rank {label}: median {times[label]:.2f} s")
    return {"rank": 512, "config": "8192 16 8", **{k.replace(' ', '_') + "_s": v for k, v in times.items()},
            "speedup": times["without cache"] / times["with cache"]}


def bench_seed_batch(jobs: int | None, label: str) -> dict:
    """The four seed configs at GPT-175B, shapes-only, ``jobs`` ranks at once."""
    import resource

    rows, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        for line in SEED_CONFIGS:
            world, pp, tp = map(int, line.split())
            (result,) = run_batch([TraceConfig(world, pp, tp, model=get_model("175"))], out, shapes_only=True,
                                  jobs=jobs, progress=False)
            if result.status != "ok":
                raise RuntimeError(f"{line}: {result.status}: {result.error}")
            rows.append({"config": line, "ranks": result.ranks_traced, "seconds": result.seconds})
            progress(f"seed batch ({label}): {line}: {result.ranks_traced} ranks in {result.seconds:.1f} s "
                     f"({len(rows)} of {len(SEED_CONFIGS)} configs, {time.perf_counter() - start:.0f} s so far)")
    kib = 1024
    return {"label": label, "jobs": jobs, "seconds": time.perf_counter() - start, "configs": rows,
            "peak_rss_parent_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib,
            "peak_rss_largest_rank_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib}


def seed_main(args) -> int:
    from megatron_dynapipe.tracer.batch_run import available_cores

    jobs = args.jobs or available_cores()
    import_s = bench_imports()
    batches = [bench_seed_batch(jobs, f"{jobs} jobs")]
    if args.baseline_jobs:
        batches.append(bench_seed_batch(args.baseline_jobs, f"{args.baseline_jobs} jobs"))
    cache = bench_meta_cache(args.repeat)  # last: its inline ranks would swell this process's peak
    if args.json:
        print(json.dumps({"import_s": import_s, "repeat": args.repeat, "meta_cache": cache, "batches": batches},
                         indent=2))
        return 0
    print(f"one GPT-175B rank (rank 512 of 8192/16/8, shapes-only), median of {args.repeat}: "
          f"{cache['without_cache_s']:.2f} s without the meta-kernel cache, {cache['with_cache_s']:.2f} s with it "
          f"({cache['speedup']:.2f}x)")
    print(f"seed batch, GPT-175B shapes-only, {sum(r['ranks'] for r in batches[0]['configs'])} ranks:")
    for b in batches:
        per = ", ".join(f"{r['config']}: {r['seconds']:.1f} s" for r in b["configs"])
        print(f"  {b['label']:>8}: {b['seconds']:7.1f} s ({per}); peak RSS: this process "
              f"{b['peak_rss_parent_bytes'] / 2**20:.0f} MiB, largest rank {b['peak_rss_largest_rank_bytes'] / 2**20:.0f} MiB")
    if len(batches) == 2:
        print(f"  {batches[0]['label']} vs {batches[1]['label']}: {batches[1]['seconds'] / batches[0]['seconds']:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median); default 3")
    parser.add_argument("--model", default="6.7", help="model traced per config (default 6.7)")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--pps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--real-compute", action="store_true", help="trace with real compute, not shapes-only")
    parser.add_argument("--no-configs", action="store_true", help="only time the fake topology")
    parser.add_argument("--seed-batch", action="store_true", help="trace the four seed configs at GPT-175B instead")
    parser.add_argument("--jobs", type=int, help="ranks at once in --seed-batch (default: one per core)")
    parser.add_argument("--baseline-jobs", type=int, help="--seed-batch again at this many jobs, for the ratio")
    args = parser.parse_args(argv)
    if args.seed_batch:
        return seed_main(args)

    import_s = bench_imports()
    topology = bench_topology(args.repeat)
    configs = [] if args.no_configs else bench_configs(
        args.model, args.tp, args.worlds, args.pps, args.repeat, shapes_only=not args.real_compute)
    if args.json:
        print(json.dumps({"repeat": args.repeat, "import_s": import_s, "topology": topology,
                          "model": get_model(args.model).label, "shapes_only": not args.real_compute,
                          "configs": configs}, indent=2))
        return 0

    print(f"imports (torch, megatron.core, the tracer): {import_s:.2f} s, paid once per batch")
    print()
    print(f"fake topology (fake process group + initialize_model_parallel), median of {args.repeat}; "
          "groups: own = the tracer's (only the rank's groups), all = megatron-core unaided")
    print(f"{'W':>6} {'TP':>3} {'PP':>3} {'rank':>5} {'groups':>6} {'created':>8} {'skipped':>8} "
          f"{'first s':>8} {'median s':>9}")
    for r in topology:
        counts = (f"{r['created']:>8} {r['skipped']:>8}" if "created" in r else f"{'-':>8} {'-':>8}")
        print(f"{r['world_size']:>6} {r['tp']:>3} {r['pp']:>3} {r['rank']:>5} {r['groups']:>6} {counts} "
              f"{r['first_s']:>8.3f} {r['median_s']:>9.3f}")
    if configs:
        mode = "real compute" if args.real_compute else "shapes-only"
        print()
        print(f"one config, {get_model(args.model).label} {mode}, TP={args.tp}, median of {args.repeat} "
              f"(one forked process per rank)")
        print(f"{'W':>6} {'PP':>3} {'DP':>5} {'ranks':>5} {'ops':>7} {'config s':>9} {'per rank s':>10}")
        for r in configs:
            if "error" in r:
                print(f"{r['world_size']:>6} {r['pp']:>3} {r['dp']:>5}  error: {r['error']}")
                continue
            print(f"{r['world_size']:>6} {r['pp']:>3} {r['dp']:>5} {r['ranks_traced']:>5} {r['ops']:>7} "
                  f"{r['median_s']:>9.2f} {r['per_rank_s']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
