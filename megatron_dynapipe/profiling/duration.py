"""How long a profile will take, said before it starts.

A profile of a multi-billion-parameter model on a CPU runs for hours; the user should know that
before the first point, not from a bar that barely moves. The estimate counts the FLOPs every grid
point runs (one encoder layer's forward and backward per recompute type, recomputation included,
and the output layer's, each for the warm-up and timed runs), divides them by this device's measured
matrix-multiply rate, and takes at least the minimum timing per part (``min_time_ms``). It ignores
refinement, memory measurement, packed rows and the whole-step overhead: a floor. It holds to a
small factor where FLOPs dominate (a large model, a GPU); on a CPU a small model's layer costs
several times its FLOPs (the tiny GPT with ``--attention sdpa``: "at least 15 s", then 2-3 min).
"""

from __future__ import annotations

import time

from megatron_dynapipe.config.accounting import layer_flops_per_token, output_flops_per_token
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["estimated_seconds", "matmul_flops_per_second", "describe_duration"]


def estimated_seconds(spec: ModelSpec, settings, flops_per_second: float) -> float:
    """Seconds the grid of ``settings`` (a ProfileSettings) takes at ``flops_per_second``."""
    runs = settings.warmup + settings.repeats
    floor_s = settings.min_time_ms / 1e3
    total = 0.0
    for tp in settings.tp_sizes:
        head_per_token = 3 * output_flops_per_token(spec.hidden_size, spec.padded_vocab_size(tp)) / tp
        for seq in settings.seq_lengths():
            layer = layer_flops_per_token(spec, seq)
            for mbs in settings.micro_batch_sizes(seq):
                tokens = mbs * seq
                forward = tokens * (layer.linear + layer.attention) / tp
                parts = [tokens * head_per_token, 0.0]  # the output layer, the embedding (a lookup)
                parts += [3 * forward + (forward if rc == RecomputeType.FULL else 0.0) for rc in settings.recompute]
                total += sum(max(flops * runs / flops_per_second, floor_s) for flops in parts)
    return total


def matmul_flops_per_second(device, dtype, size: int = 1024, repeats: int = 3) -> float:
    """This device's rate on a square matrix product of ``size`` (the best of ``repeats``)."""
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def describe_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
