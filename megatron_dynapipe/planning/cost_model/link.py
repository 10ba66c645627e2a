"""A link between ranks: its achievable bandwidth and the latency of one step over it.

Hardware files describe their links with it (:mod:`megatron_dynapipe.hardware`), and the planner
prices a pipeline's transfers with it: activations and gradients cross one once per stage
boundary and micro-batch, the package's own context-parallel ring once per ring step, so a plan of
many small micro-batches pays its latency many times.  The profiler measures the link between two
local ranks of its device (``metadata.link`` of a profile, docs/cost_model.md); without one a
pipeline's link is :data:`DEFAULT_LINK`, NVLink-like, 100 GB/s without latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from megatron_dynapipe.planning.cost_model.base import CostModelError, as_float

__all__ = ["Link", "DEFAULT_LINK"]


@dataclass(frozen=True)
class Link:
    """A link's achievable bus bandwidth (GB/s) and the latency of one algorithm step (us);
    ``algorithm`` pins the all-reduce to ``ring`` or ``tree`` (``auto``: the cheaper, as NCCL's
    tuner picks; ``calibrate`` pins what it fitted)."""

    bandwidth_GBps: float
    latency_us: float
    algorithm: str = "auto"

    def transfer_us(self, nbytes: float) -> float:
        return nbytes / (self.bandwidth_GBps * 1e3)  # 1 GB/s moves 1e3 bytes per microsecond

    def p2p_ms(self, nbytes):
        """Milliseconds of one point-to-point transfer of ``nbytes`` (an array of them, elementwise)."""
        return (self.latency_us + self.transfer_us(as_float(nbytes))) / 1e3

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bandwidth_GBps": self.bandwidth_GBps, "latency_us": self.latency_us}
        if self.algorithm != "auto":
            out["algorithm"] = self.algorithm
        return out

    @classmethod
    def of(cls, metadata: Mapping, source: str = "the profile") -> Optional["Link"]:
        """The link a profile's ``metadata`` records, or None where it measured none."""
        record = metadata.get("link")
        if record is None:
            return None
        try:
            link = cls(float(record["bandwidth_GBps"]), float(record["latency_us"]))
        except (TypeError, KeyError, ValueError):
            link = None
        if link is None or not (link.bandwidth_GBps > 0 and link.latency_us >= 0):
            raise CostModelError(f"{source}: metadata.link must hold bandwidth_GBps > 0 and latency_us >= 0, got "
                                 f"{record!r}; profile again or delete the link record")
        return link


DEFAULT_LINK = Link(bandwidth_GBps=100.0, latency_us=0.0)
