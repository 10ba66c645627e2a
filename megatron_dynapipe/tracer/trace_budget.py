"""Real compute or shapes only: what a config's busiest rank would need on this machine.

A trace with real compute runs the model's math on the CPU; it is chosen by default only when
the estimated memory of the busiest representative rank fits half of what is available and its
compute fits a time budget.  Shapes-only traces record the same ops on meta tensors.
"""

from __future__ import annotations

import os

from .batch_config import TraceConfig

__all__ = ["memory_budget_bytes", "estimated_bytes", "estimated_compute_seconds", "decide_shapes_only"]

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
