"""The link between two local ranks of the profiled device, which a pipeline's transfers cross.

Measured as ``megatron-dynapipe calibrate`` measures its ``p2p`` (:func:`~megatron_dynapipe.simulate.calibrate.measure_p2p`):
two processes of one group -- gloo on the CPU, NCCL on two GPUs -- exchange a tensor at sizes from
4 KiB to 16 MiB, each size the median of a fixed number of exchanges (the slower rank's), and the
link's latency and bandwidth are fitted to them.  One GPU cannot host two NCCL ranks: there the
profile records no link, and the planner prices transfers at the default (docs/cost_model.md).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_dynapipe.planning.cost_model.link import Link

__all__ = ["measure_link", "link_backend", "SIZES"]

SIZES = [4096 << k for k in range(0, 13, 2)]  # 4 KiB .. 16 MiB
REPEATS = 9


def link_backend(device: torch.device) -> Optional[str]:
    """The backend two local ranks of ``device``'s kind talk over, or None where two cannot run."""
    if device.type != "cuda":
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= 2 else None


def measure_link(device: torch.device) -> Optional[dict]:
    """``metadata.link`` of a profile on ``device``: the fitted link and how it was measured, or
    None where two ranks cannot run here."""
    from megatron_dynapipe.simulate.calibrate import measure_p2p

    backend = link_backend(device)
    if backend is None:
        return None
    link: Link = measure_p2p(backend, SIZES, repeats=REPEATS, timeout=300.0)
    return {"bandwidth_GBps": float(link.bandwidth_GBps), "latency_us": float(link.latency_us), "backend": backend,
            "sizes_bytes": SIZES, "repeats": REPEATS}
