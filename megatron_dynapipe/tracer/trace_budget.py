"""Real compute or shapes only: what a config's busiest rank would need on this machine.

A trace with real compute runs the model's math where the ranks run: on the GPU when this torch
sees one (every rank shares GPU 0), else on the CPU.  It is chosen by default only when the
estimated memory of the busiest representative rank fits half of that device's memory and its
compute fits a time budget.  Shapes-only traces record the same ops on meta tensors.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from megatron_dynapipe.config.accounting import microbatch_flops, training_bytes
from megatron_dynapipe.config.megatron_options import MegatronOptions, warmup_passes
from megatron_dynapipe.tracer.batch_config import TraceConfig

__all__ = ["memory_budget_bytes", "estimated_bytes", "in_flight_microbatches", "estimated_compute_seconds",
           "decide_shapes_only"]

#: Floating-point operations per second assumed for real compute on a CPU (fp32, a few cores).
CPU_FLOPS = 5e10
#: ... and on a GPU: a fraction of a data-centre GPU's fp32/TF32 rate, as small traced
#: micro-batches reach it (an H100 ran GPT-6.7B "8192 4 8" ranks at this rate or better).
GPU_FLOPS = 2e13
#: Longest real-compute trace of one rank the default accepts before it goes shapes-only.
REAL_COMPUTE_BUDGET_S = 60.0


def _on_gpu() -> bool:
    """Whether traced ranks compute on a GPU (the fake rank's own rule: whenever torch sees one)."""
    import torch

    return torch.cuda.is_available()


def memory_budget_bytes() -> int:
    """Bytes a real-compute trace may use: half of GPU 0's memory where the ranks compute on it,
    else half of the memory available now."""
    if _on_gpu():
        import torch

        return torch.cuda.get_device_properties(0).total_memory // 2
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


def estimated_bytes(config: TraceConfig, training: Optional[MegatronOptions] = None) -> int:
    """Bytes the busiest representative rank of ``config`` needs to really train on CPU, with
    ``training``'s recompute and distributed optimizer."""
    training = (training or MegatronOptions()).at_tp(config.tp)
    return training_bytes(
        config.model, config.pp, config.tp, config.ep,
        micro_batch_size=config.micro_batch_size, seq_length=config.seq,
        in_flight=in_flight_microbatches(config, training), cp=config.cp,
        selective_recompute=training.recompute_granularity == "selective",
        sequence_parallel=training.sequence_parallel,
        optimizer_shards=config.dp if training.distributed_optimizer else 1,
        **_busiest_rank(config, training),
    )


def _busiest_rank(config: TraceConfig, training: MegatronOptions) -> dict[str, Any]:
    """The busiest pipeline rank's transformer layers under the options' split (uneven stages
    included) and those whose forward it recomputes, as the accounting functions' keywords; the
    even split's estimate where the model's layers do not split."""
    if training.layout_problem(tp=config.tp, pp=config.pp, num_layers=config.model.num_layers):
        return {"stage_layers": None, "recomputed_layers": 0}
    chunks = training.busiest_rank_layers(config.model.num_layers, config.pp)
    return {"stage_layers": sum(chunks), "recomputed_layers": sum(training.recomputed_layers(n) for n in chunks)}


def in_flight_microbatches(config: TraceConfig, training: MegatronOptions) -> float:
    """Micro-batches whose activations the first stage holds at once: 1F1B's warm-up of PP; under
    interleaving megatron-core's warm-up of 2 (PP - 1) + (V - 1) PP chunk passes plus the one in
    flight, each holding 1/V of the stage's layers."""
    microbatches = max(config.microbatches, 1)
    chunks = training.virtual_size(config.model.num_layers, config.pp)
    passes = min(warmup_passes(config.pp, chunks) + 1, microbatches * chunks)
    return passes / chunks


def estimated_compute_seconds(config: TraceConfig, iterations: int = 2,
                              training: Optional[MegatronOptions] = None) -> float:
    """Seconds of real compute for the busiest rank over ``iterations`` steps at :data:`GPU_FLOPS`
    or :data:`CPU_FLOPS`, where the ranks compute (recomputed layers run their forward twice)."""
    training = training or MegatronOptions()
    flops = microbatch_flops(
        config.model, config.pp, config.tp, micro_batch_size=config.micro_batch_size,
        seq_length=config.seq, cp=config.cp, **_busiest_rank(config, training),
    )
    return flops * max(config.microbatches, 1) * iterations / (GPU_FLOPS if _on_gpu() else CPU_FLOPS)


def decide_shapes_only(
    config: TraceConfig,
    budget: int | None = None,
    *,
    iterations: int = 2,
    time_budget_s: float = REAL_COMPUTE_BUDGET_S,
    training: Optional[MegatronOptions] = None,
) -> tuple[bool, str]:
    """Whether ``config`` is traced shapes-only by default, and why.

    Shapes-only when the estimated bytes of the busiest rank (trained with ``training``'s
    options) exceed ``budget`` (default: :func:`memory_budget_bytes`) -- the model cannot run
    here -- or when its real compute over ``iterations`` steps would take longer than
    ``time_budget_s`` on this machine.
    """
    need = estimated_bytes(config, training)
    budget = memory_budget_bytes() if budget is None else budget
    gib = 2**30
    if need > budget:
        return True, f"estimated {need / gib:.1f} GiB per rank > memory budget {budget / gib:.1f} GiB"
    seconds = estimated_compute_seconds(config, iterations, training)
    if seconds > time_budget_s:
        return True, (f"fits in memory ({need / gib:.1f} GiB) but real compute would take about "
                      f"{seconds:.0f} s per rank > {time_budget_s:.0f} s")
    return False, (f"estimated {need / gib:.2f} GiB per rank fits budget {budget / gib:.1f} GiB, "
                   f"about {seconds:.1f} s of compute")
