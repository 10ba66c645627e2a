"""Shapes-only fake-rank traces of the tiny GPT that the simulator and search tests replay.

    from tiny_traces import uniform      # the ``tiny_traces`` fixture (conftest.py) traces them
"""

from pathlib import Path

#: PP 4 with 8 micro-batches, and TP 2 x PP 2 x DP 4
CONFIGS = ["4 4 1 nmb=8", "16 2 2"]


def trace_tiny(out: Path) -> dict[str, Path]:
    """Trace :data:`CONFIGS` into ``out``; config folder by layout line ("4 4 1", "16 2 2")."""
    from megatron_dynapipe.tracer.batch_config import parse_configs
    from megatron_dynapipe.tracer.batch_run import run_batch

    results = run_batch(parse_configs(CONFIGS, model="tiny"), out, shapes_only=True, progress=False)
    assert [r.status for r in results] == ["ok", "ok"], [r.error for r in results]
    return {r.config.line: r.folder for r in results}


def uniform(job, forward_us, backward_us):
    """The same job with every forward taking ``forward_us`` and every backward ``backward_us``
    (durations of the test's own: no hardware's, so no simulation prices them anew)."""
    for trace in job.traces.values():
        trace.meta.pop("compute_hardware", None)
        for op in trace.ops:
            if op.cat == "compute":
                op.dur_us = {"forward": forward_us, "backward": backward_us}.get(op.kind, 0.0)
    return job
