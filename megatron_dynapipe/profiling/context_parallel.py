"""The encoder layer timed on a real context-parallel group of local ranks (``profile --cp N``).

A profile at CP 1 prices a CP rank's layer as the layer at its share of the tokens plus the ring's
extra attention blocks and transfers (:mod:`megatron_dynapipe.planning.cost_model.context_parallel`).
What that misses shows only on a real group: the ring's steps per sample of a packed row, the
ranks' waits on each other.  So ``cp`` local ranks (gloo on the CPU, NCCL on ``cp`` GPUs) build the
layer as Megatron runs it under context parallelism and time it at the points the CP 1 profile
measured whose rows split into ``2 cp`` chunks: each rank holds its share of ``mbs`` rows of ``seqlen``
whole tokens (padded rows, and packed rows of ``mbs`` samples where the core runs them).

Every rank runs the same points the same number of times: after a warm-up, one timed run sets the
count for the point (enough runs to add up to the profile's ``min_time_ms``), from the slowest rank's
time, which every rank agrees on; each run starts after a barrier and counts the slowest rank's
forward and backward, so the time is what a step of the group waits for. One more run measures what
a rank stores and peaks at (rank 0's; the ranks hold equal shares): the ring may keep more than the
rank's share of tokens, which a profile at CP 1 cannot see.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Callable, Iterable

from megatron_dynapipe.profiling.link import device_and_sync
from megatron_dynapipe.profiling.measure import MAX_REPEATS, Memory, Timing, backward_of_ones

if TYPE_CHECKING:
    from megatron_dynapipe.config.model import ModelSpec
    from megatron_dynapipe.profiling.profiler import ProfileSettings

__all__ = ["cp_points", "cp_seconds", "lockstep_runs", "measure_cp_layers", "time_in_lockstep"]

Point = tuple[str, int, int]  # (recompute label, seqlen, mbs)


def cp_points(times: Iterable[tuple], tp: int, cp: int) -> list[Point]:
    """The points of ``times`` (a profile's layer-time keys) where the CP 1 layer of ``tp`` was
    measured whose whole rows of ``seqlen`` split into the ``2 cp`` chunks Megatron gives the ranks."""
    return sorted({(rc, s, m) for (t, rc, layer, phase, s, m) in times
                   if t == tp and layer == "encoder" and phase == "forward" and s % (2 * cp) == 0})


def cp_seconds(records, points: list[Point], settings: "ProfileSettings") -> float:
    """About how long :func:`measure_cp_layers` takes at ``points``, said before it starts: each
    layout's runs (:func:`lockstep_runs`, and one that measures memory) priced at the CP 1 layer's
    time at that point in ``records`` (a profile's
    :class:`~megatron_dynapipe.planning.cost_model.profile_file.ProfileRecords`).
    A rank's share of the tokens plus the ring's steps costs about what the whole layer does alone:
    on the tiny GPT at 1024 positions, 45 points said 46 s of runs and took 34 s."""
    total_ms = 0.0
    for rc, seq, mbs in points:
        for grid in (records.times, records.packed_times):  # padded rows, and THD rows where measured
            run = [grid.get((1, rc, "encoder", phase, seq, mbs)) for phase in ("forward", "backward")]
            if None not in run:
                total_ms += (lockstep_runs(sum(run), settings) + 1) * sum(run)
    return total_ms / 1e3


def measure_cp_layers(spec: "ModelSpec", settings: "ProfileSettings", cp: int, points: list[Point],
                      backend: str) -> dict[tuple, tuple[Timing, Memory]]:
    """{(recompute label, layout, seqlen, mbs): (Timing, Memory)} of the encoder on ``cp`` local
    ranks of ``backend`` at ``points`` (module docstring)."""
    from megatron_dynapipe.local_ranks import run_local_ranks

    # a rank that stops answering is caught by the group's own timeout, well before this one
    return run_local_ranks(_time_on_group, cp, spec, settings, points, timeout=24 * 3600.0, backend=backend)[0]


def _time_on_group(rank: int, cp: int, spec: "ModelSpec", settings: "ProfileSettings", points: list[Point]):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.gpt.device import torch_dtype
    from megatron_dynapipe.planning.types import RecomputeType
    from megatron_dynapipe.profiling.layers import build_parts
    from megatron_dynapipe.profiling.measure import measure_memory, steady_cpu_allocator

    device, sync = device_and_sync()
    on_cpu = device.type == "cpu"
    if on_cpu:
        steady_cpu_allocator()
        cpu_compat.enable_cpu_mode()
    parallel_state.initialize_model_parallel(context_parallel_size=cp, create_gloo_process_groups=False)
    try:
        model_parallel_cuda_manual_seed(1234)
        dtype = torch_dtype(settings.dtype)
        parts = build_parts(spec, 1, dtype, device, settings.recompute, cp=cp)
        times = {}
        for label, seq, mbs in points:
            rc = RecomputeType.parse(label)

            def hidden(rows: int, tokens: int):
                return torch.randn(tokens // cp, rows, spec.hidden_size, device=device, dtype=dtype, requires_grad=True)

            def measured(step):  # every rank runs both in step: the ring's transfers pair up
                return time_in_lockstep(step, sync, settings), measure_memory(step, device)

            x = hidden(mbs, seq)
            times[label, "padded", seq, mbs] = measured(lambda: parts.encoders[rc](x))
            if rc in parts.packed_encoders:
                row = hidden(1, seq * mbs)
                times[label, "thd", seq, mbs] = measured(lambda: parts.packed_encoders[rc](row, seq))
        return times if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()
        if on_cpu:
            cpu_compat.disable_cpu_mode()


def time_in_lockstep(step: Callable, sync: Callable[[], None], settings: "ProfileSettings") -> Timing:
    """``step()`` and its backward on every rank of the group, the slowest rank's times (module
    docstring): ``settings.warmup`` untimed runs, then at least ``settings.repeats``."""
    for _ in range(settings.warmup):
        backward_of_ones(step())
    runs = [_slowest_run(step, sync)]
    runs += [_slowest_run(step, sync) for _ in range(lockstep_runs(sum(runs[0]), settings) - settings.warmup - 1)]
    forward, backward = ([run[k] for run in runs] for k in (0, 1))
    return Timing(statistics.median(forward), statistics.median(backward), max(forward) - min(forward),
                  max(backward) - min(backward))


def lockstep_runs(run_ms: float, settings: "ProfileSettings") -> int:
    """The runs :func:`time_in_lockstep` makes of a step whose first timed run took ``run_ms``, its
    warm-up included: at least ``settings.repeats`` timed, enough to add up to ``min_time_ms``."""
    timed = max(settings.repeats, min(MAX_REPEATS, math.ceil(settings.min_time_ms / max(run_ms, 1e-3))))
    return settings.warmup + timed


def _slowest_run(step: Callable, sync: Callable[[], None]) -> tuple[float, float]:
    """One run's forward and backward ms, each the slowest rank's."""
    import time

    import torch
    import torch.distributed as dist

    dist.barrier()
    sync()
    start = time.perf_counter()
    out = step()
    sync()
    middle = time.perf_counter()
    backward_of_ones(out)
    sync()
    end = time.perf_counter()
    ms = torch.tensor([(middle - start) * 1e3, (end - middle) * 1e3], dtype=torch.float64,
                      device=out.device if out.device.type == "cuda" else "cpu")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms[0]), float(ms[1])
