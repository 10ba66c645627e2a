"""How long the tracer's topology queries take for 1K-8K-rank jobs.

    python benchmarks/bench_topology.py [--json] [--repeat 5] [--no-fake-pg]

For W in 1024..8192 and PP in 2..32 (TP=8, the rest data parallel) it times, as the median of
``--repeat`` runs, (a) building the ``ParallelLayout`` plus every group of one rank (the rank in
the middle of the job) and (b) picking the representative ranks.  Then, unless ``--no-fake-pg``,
it times what the tracer would otherwise use: torch's fake process group plus megatron-core's
``initialize_model_parallel`` for rank 512 of W=8192 (TP=8, PP=16), in a child process so the
import cost is reported separately and global state stays out of this one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dynapipe.config import layout as topology  # noqa: E402
from megatron_dynapipe.config.layout import ParallelLayout, rank_groups
from megatron_dynapipe.tracer.representatives import representative_ranks

WORLDS = (1024, 2048, 4096, 8192)
PIPELINES = (2, 4, 8, 16, 32)
TP = 8


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_layouts(repeat: int) -> list[dict]:
    rows = []
    for world in WORLDS:
        for pp in PIPELINES:
            rank = world // 2 + 3

            def groups_of_one_rank():
                topology._generators.cache_clear()  # time a cold layout, not a cache hit
                rank_groups(ParallelLayout(world, tp=TP, pp=pp), rank)

            layout = ParallelLayout(world, tp=TP, pp=pp)
            groups = rank_groups(layout, rank)
            rows.append(
                {
                    "world_size": world,
                    "tp": TP,
                    "pp": pp,
                    "dp": layout.dp,
                    "rank": rank,
                    "group_members": sum(len(g) for g in groups.values()),
                    "layout_and_groups_ms": 1e3 * median_seconds(groups_of_one_rank, repeat),
                    "representatives_ms": 1e3
                    * median_seconds(lambda: representative_ranks(layout), repeat),
                    "representatives": len(representative_ranks(layout)),
                }
            )
    return rows


_FAKE_PG_CHILD = r"""
import json, time, warnings
t0 = time.perf_counter()
warnings.simplefilter("ignore")
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from megatron.core import parallel_state as ps
t1 = time.perf_counter()
dist.init_process_group("fake", store=FakeStore(), rank=512, world_size=8192)
t2 = time.perf_counter()
ps.initialize_model_parallel(tensor_model_parallel_size=8, pipeline_model_parallel_size=16,
                             create_gloo_process_groups=False)
t3 = time.perf_counter()
pp = sorted(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
print(json.dumps({"import_s": t1 - t0, "init_process_group_s": t2 - t1,
                  "initialize_model_parallel_s": t3 - t2, "pp_group_head": pp[:3]}))
"""


def bench_fake_pg() -> dict:
    """Time torch's fake PG + initialize_model_parallel for rank 512 of W=8192 in a child."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _FAKE_PG_CHILD], capture_output=True, text=True, timeout=600
        )
    except Exception as exc:  # pragma: no cover - environment dependent
        return {"error": f"{type(exc).__name__}: {exc}"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    start = time.perf_counter()
    ours = rank_groups(ParallelLayout(8192, tp=8, pp=16), 512)
    result["topology_same_rank_s"] = time.perf_counter() - start
    result["pp_group_matches"] = list(ours["pp"][:3]) == result["pp_group_head"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (median)")
    parser.add_argument("--no-fake-pg", action="store_true", help="skip the torch/megatron timing")
    args = parser.parse_args(argv)

    rows = bench_layouts(args.repeat)
    fake = None if args.no_fake_pg else bench_fake_pg()
    if args.json:
        print(json.dumps({"repeat": args.repeat, "layouts": rows, "fake_pg": fake}, indent=2))
        return 0

    print(f"layout + all groups of one rank, median of {args.repeat} (TP={TP}, DP = the rest)")
    print(f"{'W':>6} {'PP':>4} {'DP':>5} {'members':>8} {'groups ms':>10} {'reps':>5} {'reps ms':>8}")
    for r in rows:
        print(
            f"{r['world_size']:>6} {r['pp']:>4} {r['dp']:>5} {r['group_members']:>8} "
            f"{r['layout_and_groups_ms']:>10.3f} {r['representatives']:>5} "
            f"{r['representatives_ms']:>8.3f}"
        )
    if fake is not None:
        print()
        if "error" in fake:
            print(f"fake process group + initialize_model_parallel: unavailable ({fake['error']})")
        else:
            print("rank 512 of W=8192 (TP=8, PP=16):")
            print(f"  import torch.distributed + megatron.core   {fake['import_s']:8.3f} s")
            print(f"  init_process_group('fake')                 {fake['init_process_group_s']:8.3f} s")
            print(
                f"  initialize_model_parallel                  "
                f"{fake['initialize_model_parallel_s']:8.3f} s"
            )
            print(f"  topology.rank_groups (this module)         {fake['topology_same_rank_s']:8.5f} s")
            print(f"  pipeline group agrees: {fake['pp_group_matches']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
