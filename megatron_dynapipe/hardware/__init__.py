"""Hardware models: what a device computes and holds, and what its links cost.

A hardware file is one JSON object (docs/simulate.md lists every field)::

    {"format": "megatron-dynapipe-hardware", "version": 1, "name": "H100-80GB-SXM",
     "peak_tflops": {"bfloat16": 989.4, ...}, "memory_gib": 80, "memory_bandwidth_GBps": 3350,
     "gpus_per_node": 8, "nics_per_node": 8,
     "intra_node": {"bandwidth_GBps": 360, "latency_us": 4},
     "inter_node": {"bandwidth_GBps": 40, "latency_us": 8},
     "collectives": {"all_reduce": {"bandwidth_GBps": ..., "latency_us": ...}, ...}}

Bandwidths are *bus* bandwidths in the sense of nccl-tests (GB/s = 1e9 bytes per second):
a ring all-reduce of ``S`` bytes over ``n`` ranks moves ``2 (n-1)/n S`` bytes through each rank's
link.  ``collectives`` (optional; ``calibrate`` writes it) replaces the intra-node link for one
kind of collective with what was measured for it.  ``compute_slots_per_node`` (optional,
default ``gpus_per_node``) is how many ranks of a node compute at full speed at once: CPU
processes share cores, and the replay slows the ranks of a node down when more compute at once.

Collectives are costed as NCCL's algorithms cost them.  Inside one node (NVLink / NVSwitch,
the ``intra_node`` link): ring all-gather / reduce-scatter / all-to-all
``(n-1) alpha + (n-1)/n S / B``; all-reduce the cheaper of the ring
``2 (n-1) alpha + 2 (n-1)/n S / B`` and the tree ``2 ceil(log2 n) alpha + 2 S / B``;
broadcast and reduce a pipelined chain ``(n-1) alpha + S / B``; p2p ``alpha + S / B``.  Ranks
are placed on nodes in rank order (``rank // gpus_per_node``).

Across nodes the network has **rails**: ``nics_per_node`` NICs (default one per GPU, as in a
DGX), each ``inter_node`` fast.  A group with ``k`` members on each of ``N`` nodes drives
``r = k * nics_per_node / gpus_per_node`` of them: NCCL spreads its channels over the NICs
closest to the group's GPUs, and the groups that run at the same time (the DP groups of every
TP rank) each keep their own.  NCCL's ring then crosses every node boundary once per step, so a
node sends what one rank of a single ring sends, over its ``r`` NICs: the ring takes
``steps * alpha_net + factor * S / min(B_nvlink, r B_nic)``.  Its tree (all-reduce only) is a
chain inside each node and a double binary tree between nodes:
``2 (ceil(log2 N) alpha_net + (k-1) alpha_nvlink) + 2 S / min(B_nvlink, r B_nic)``; the cheaper
is taken, as NCCL's tuner does per message size.  An all-to-all sends ``(n-k)/n S`` of each
rank's data off its node, ``k`` ranks sharing ``r`` NICs, and the rest over NVLink at once.
A p2p between nodes uses one rail.

Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from megatron_dynapipe.files import write_atomically
from megatron_dynapipe.planning.cost_model import (
    AnalyticalCostModel,
    CostModel,
    StageCosts,
    gpt_shape,
    split_over_cp,
    tp_collectives,
)
from megatron_dynapipe.planning.cost_model.link import Link
from megatron_dynapipe.planning.cost_model.roofline import DeviceRoofline, RooflineCostModel
from megatron_dynapipe.planning.cost_model.tensor_parallel import LinearGemms
from megatron_dynapipe.planning.spec import TrainingSpec

__all__ = [
    "MEMORY_HEADROOM",
    "default_memory_limit_mb",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "COLLECTIVE_KINDS",
    "PEAK_DTYPES",
    "HardwareFileError",
    "Link",
    "Hardware",
    "TensorParallelGroup",
    "hardware_names",
    "load_hardware",
    "ring_terms",
    "flat_collective_us",
]

#: The share of a GPU's memory left for what plans and traces do not count: each rank's CUDA
#: context, NCCL's buffers and the caching allocator's fragmentation (``search``'s
#: ``--memory-headroom`` default, and what ``bench step`` keeps free of a GPU by default).
MEMORY_HEADROOM = 0.1


def default_memory_limit_mb(device_memory_mb: "float | None") -> float:
    """The per-device memory plans must fit where none is given, the one rule every command
    applies: ``1 - MEMORY_HEADROOM`` of the device's memory; where the device's memory is not known
    (a profile's cost model, the CPU), :class:`~megatron_dynapipe.planning.spec.TrainingSpec`'s
    default, a 40 GB A100's planning limit."""
    if device_memory_mb is None:
        return TrainingSpec.memory_limit_mb
    return device_memory_mb * (1 - MEMORY_HEADROOM)


FORMAT_NAME = "megatron-dynapipe-hardware"
FORMAT_VERSION = 1
#: What a hardware file can price (``p2p`` is a send/receive pair).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
                    "barrier", "p2p")
ALGORITHMS = ("auto", "ring", "tree")
#: a cost model's (a profile's) activation dtype -> the peak_tflops key its GEMMs run at
PEAK_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_FIX = "see docs/simulate.md for the fields, or write one for this machine with `megatron-dynapipe calibrate`"


class HardwareFileError(ValueError):
    """A hardware file that cannot be used; the message names the field and the fix."""


def ring_terms(kind: str, n: int) -> tuple[float, float]:
    """``(latency steps, bytes factor)`` of ``kind`` over ``n`` ranks by ring (a chain for
    broadcast and reduce): it takes ``steps * alpha + factor * S / B``.  ``calibrate`` fits
    ``alpha`` and ``B`` to these same terms."""
    if kind == "p2p":
        return 1.0, 1.0
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(n - 1), (n - 1) / n
    if kind in ("broadcast", "reduce"):
        return float(n - 1), 1.0
    raise ValueError(f"cannot price a {kind!r}: kinds are {', '.join(COLLECTIVE_KINDS)}")


def flat_collective_us(kind: str, n: int, nbytes: float, link: Link) -> float:
    """Time of one collective over ``n`` ranks that all use ``link`` (``nbytes`` as nccl-tests
    counts it: the all-reduced tensor, the gathered output, the unscattered input, the tensor a
    rank sends to all, the broadcast tensor)."""
    if n <= 1 and kind != "p2p":
        return 0.0
    tree_steps = 2 * math.ceil(math.log2(max(n, 2)))
    if kind == "barrier":
        return tree_steps * link.latency_us
    steps, factor = ring_terms(kind, n)
    ring = steps * link.latency_us + link.transfer_us(factor * nbytes)
    if kind != "all_reduce":
        return ring
    tree = tree_steps * link.latency_us + link.transfer_us(2 * nbytes)
    return {"ring": ring, "tree": tree}.get(link.algorithm, np.minimum(ring, tree))  # nbytes may be an array


@dataclass(frozen=True)
class Hardware:
    """One device type and the network between its devices (fields as in the file)."""

    name: str
    peak_tflops: Mapping[str, float]
    memory_gib: float
    memory_bandwidth_GBps: float
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    collectives: Mapping[str, Link] = field(default_factory=dict)
    source: str = ""
    #: ranks of a node that compute at full speed at once (CPU processes share cores; default: one
    #: per GPU)
    compute_slots_per_node: int = 0
    #: network rails: NICs per node, each ``inter_node`` fast (default: one per GPU)
    nics_per_node: int = 0
    #: the device's kernels (``sms``, ``gemm_tile``, ``gemm_efficiency``, ``memory_efficiency``):
    #: compute is priced by shape on a roofline; without it, at a flat share of peak
    compute: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("compute_slots_per_node", "nics_per_node"):
            if not getattr(self, name):
                object.__setattr__(self, name, self.gpus_per_node)

    # -- prices ---------------------------------------------------------------------------------

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link(self, kind: str, across_nodes: bool) -> Link:
        if across_nodes:
            return self.inter_node
        return self.collectives.get(kind, self.intra_node)

    def cp_ring_gbps(self, tp: int, cp: int) -> float:
        """Bandwidth of a context-parallel ring's transfers: CP ranks follow TP's in rank order, so
        the ring stays on a node's link while TP x CP ranks fit one."""
        return self.link("p2p", tp * cp > self.gpus_per_node).bandwidth_GBps

    def collective_us(self, kind: str, nbytes: float, group: Iterable[int]) -> float:
        """Time of a collective of ``kind`` on the process group ``group`` (global ranks)."""
        per_node = Counter(self.node_of(rank) for rank in group)
        n, nodes, most = sum(per_node.values()), len(per_node), max(per_node.values())
        if nodes == 1:
            return flat_collective_us(kind, n, nbytes, self.link(kind, False))
        return self._across_nodes_us(kind, nbytes, n, nodes, most)

    def planner_model(self, model: CostModel, spec, *, tp: int, cp: int = 1, sequence_parallel: bool = False,
                      tp_comm_overlap: bool = False, async_backward: bool = True) -> CostModel:
        """``model`` (one TP rank's compute, ``spec``'s GPT) as the planner prices a layout on this
        hardware: split over ``cp`` ranks with the ring's transfers at the link between them, and
        the TP group's collectives added, each beside its GEMM as this device's roofline prices it
        (waited for without one). A shapes-only trace records both as ops of their own, so its
        compute is priced by ``model`` split over CP without them."""
        split = split_over_cp(model, cp, spec, ring_gbps=self.cp_ring_gbps(tp, cp))
        roofline = self.roofline(PEAK_DTYPES.get(model.activation_dtype, "bfloat16"))
        gemms = LinearGemms.on(spec, tp, roofline) if roofline is not None and tp > 1 else None
        return tp_collectives(split, self.tp_collective_ms(tp), sequence_parallel=sequence_parallel,
                              overlap=tp_comm_overlap, gemms=gemms, async_backward=async_backward)

    def planner_stages(self, costs: StageCosts, spec, *, cp: int = 1, sequence_parallel: bool = False,
                       tp_comm_overlap: bool = False, async_backward: bool = True) -> StageCosts:
        """``costs`` (a pipeline's stages of one TP rank's compute, CP 1) as the planner prices the
        layout on this hardware: their model by :meth:`planner_model`, the transfers between
        stages at :meth:`pipeline_link` (as a trace's replay prices them; not a profile's link,
        measured between two ranks of one box). What ``search``, ``trace``, ``plan`` and a
        Megatron-LM job's data pipeline all plan with."""
        tp = costs.model.tp
        model = self.planner_model(costs.model, spec, tp=tp, cp=cp, sequence_parallel=sequence_parallel,
                                   tp_comm_overlap=tp_comm_overlap, async_backward=async_backward)
        return replace(costs, model=model, link=self.pipeline_link(tp, cp, costs.dp))

    def pipeline_link(self, tp: int, cp: int, dp: int) -> Link:
        """The link between neighbouring pipeline stages, whose ranks are ``tp x cp x dp`` apart
        (as a trace's replay prices their transfers)."""
        return self.link("p2p", self.node_of(0) != self.node_of(tp * cp * dp))

    def tp_collective_ms(self, tp: int) -> "TensorParallelGroup":
        """Prices of collectives on the first tensor-parallel group of ``tp`` ranks (TP's ranks
        are consecutive, so every TP group is placed alike), for the planner's cost model."""
        return TensorParallelGroup(self, tp)

    def rails(self, members_per_node: int) -> int:
        """NICs a group with ``members_per_node`` ranks on each node drives (at least one)."""
        return max(1, min(self.nics_per_node, members_per_node * self.nics_per_node // self.gpus_per_node))

    def _across_nodes_us(self, kind: str, nbytes: float, n: int, nodes: int, k: int) -> float:
        """NCCL's ring (and for all-reduce its tree) over ``nodes`` nodes of ``k`` members each."""
        nvlink, net = self.link(kind, False), self.inter_node
        network_GBps = self.rails(k) * net.bandwidth_GBps
        slowest = Link(min(network_GBps, nvlink.bandwidth_GBps) if k > 1 else network_GBps, net.latency_us)
        tree_latency = 2 * (math.ceil(math.log2(nodes)) * net.latency_us + (k - 1) * nvlink.latency_us)
        if kind == "barrier":
            return tree_latency
        if kind == "all_to_all":
            off_node = Link(network_GBps / k, 0.0).transfer_us((n - k) / n * nbytes)
            on_node = nvlink.transfer_us((k - 1) / n * nbytes)
            return (n - 1) * net.latency_us + max(off_node, on_node)
        steps, factor = ring_terms(kind, n)
        ring = steps * net.latency_us + slowest.transfer_us(factor * nbytes)
        if kind != "all_reduce":
            return ring
        tree = tree_latency + slowest.transfer_us(2 * nbytes)
        return {"ring": ring, "tree": tree}.get(net.algorithm, np.minimum(ring, tree))

    def p2p_us(self, nbytes: float, sender: int, receiver: int) -> float:
        return flat_collective_us("p2p", 2, nbytes, self.link("p2p", self.node_of(sender) != self.node_of(receiver)))

    def memory_bound_us(self, nbytes: float) -> float:
        """Time to stream ``nbytes`` through device memory once."""
        return nbytes / (self.memory_bandwidth_GBps * 1e3)

    def peak(self, dtype: str) -> float:
        """Peak dense TFLOP/s for ``dtype`` (``bfloat16``, ``float16``, ``float32``)."""
        try:
            return float(self.peak_tflops[dtype])
        except KeyError:
            raise HardwareFileError(f"hardware {self.name!r} has no peak_tflops for {dtype!r}: name one it has "
                                    f"({', '.join(self.peak_tflops)}) or add it to the file's peak_tflops "
                                    f"({_FIX})") from None

    def roofline(self, dtype: str, core: str = "transformer_engine") -> "DeviceRoofline | None":
        """The device's roofline for ``dtype``, attention by the kernel of ``core`` (a ModelSpec's
        ``attention``); None without a ``compute`` section."""
        if not self.compute:
            return None
        return DeviceRoofline.from_section(self.compute, self.peak(dtype), self.memory_bandwidth_GBps, core)

    def cost_model(self, model, tp: int, dtype: str, *, memory_limited: bool = True,
                   sequence_parallel: bool = False) -> CostModel:
        """The compute times of GPT ``model`` (a ModelSpec) at ``tp`` on this device: the
        roofline of its ``compute`` section, else the analytical model at half of peak; its
        activations with ``sequence_parallel`` or without.  A micro-batch whose layer does not fit
        the device costs ``inf`` unless not ``memory_limited`` (a simulation times it and reports
        the memory apart)."""
        gpt = dict(gpt_shape(model, tp), device_memory_mb=self.memory_gib * 1024 if memory_limited else math.inf,
                   sequence_parallel=sequence_parallel)
        roofline = self.roofline(dtype, model.attention)
        built = (RooflineCostModel(roofline, **gpt) if roofline is not None
                 else AnalyticalCostModel(peak_tflops=self.peak(dtype), **gpt))
        built.hardware = self.name  # traces priced by it say which device they are for
        return built

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    # -- files ----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "name": self.name,
                               "source": self.source, "peak_tflops": dict(self.peak_tflops),
                               "memory_gib": self.memory_gib, "memory_bandwidth_GBps": self.memory_bandwidth_GBps,
                               "gpus_per_node": self.gpus_per_node, "intra_node": self.intra_node.to_json(),
                               "inter_node": self.inter_node.to_json()}
        if self.compute_slots_per_node != self.gpus_per_node:
            out["compute_slots_per_node"] = self.compute_slots_per_node
        if self.nics_per_node != self.gpus_per_node:
            out["nics_per_node"] = self.nics_per_node
        if self.compute:
            out["compute"] = dict(self.compute)
        if self.collectives:
            out["collectives"] = {kind: link.to_json() for kind, link in self.collectives.items()}
        return out

    def write(self, path: str | os.PathLike) -> Path:
        return write_atomically(path, json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: Any, source: str = "<hardware>") -> "Hardware":
        if not isinstance(data, dict):
            raise HardwareFileError(f"{source}: not a JSON object; {_FIX}")
        if data.get("format") != FORMAT_NAME:
            raise HardwareFileError(f"{source}: format {data.get('format')!r} is not {FORMAT_NAME!r}; {_FIX}")
        if data.get("version") != FORMAT_VERSION:
            raise HardwareFileError(f"{source}: hardware file version {data.get('version')!r}, this reader "
                                    f"understands version {FORMAT_VERSION}; {_FIX}")
        read = _Fields(data, source)
        peaks = read.mapping("peak_tflops")
        if not peaks:
            raise HardwareFileError(f"{source}: peak_tflops is empty; give at least the training dtype's peak; {_FIX}")
        collectives = {}
        for kind, entry in read.mapping("collectives", required=False).items():
            if kind not in COLLECTIVE_KINDS:
                raise HardwareFileError(f"{source}: collectives.{kind} is not a kind this model prices "
                                        f"({', '.join(COLLECTIVE_KINDS)}); rename or remove it")
            collectives[kind] = read.link(f"collectives.{kind}", entry)
        gpus_per_node = read.positive_int("gpus_per_node", data.get("gpus_per_node"))
        slots = read.positive_int("compute_slots_per_node", data.get("compute_slots_per_node", gpus_per_node))
        nics = read.positive_int("nics_per_node", data.get("nics_per_node", gpus_per_node))
        compute = read.compute()
        return cls(
            compute=compute,
            name=str(data.get("name") or Path(source).stem),
            compute_slots_per_node=slots,
            nics_per_node=nics,
            peak_tflops={str(k): read.positive(f"peak_tflops.{k}", v) for k, v in peaks.items()},
            memory_gib=read.positive("memory_gib", data.get("memory_gib")),
            memory_bandwidth_GBps=read.positive("memory_bandwidth_GBps", data.get("memory_bandwidth_GBps")),
            gpus_per_node=gpus_per_node,
            intra_node=read.link("intra_node", data.get("intra_node")),
            inter_node=read.link("inter_node", data.get("inter_node")),
            collectives=collectives,
            source=str(data.get("source", "")),
        )


@dataclass(frozen=True)
class TensorParallelGroup:
    """``collective_ms(kind, nbytes)`` of a TP group of ``tp`` ranks on ``hardware`` (``nbytes`` an
    array of them, elementwise): what :class:`~megatron_dynapipe.planning.cost_model.tensor_parallel.
    TensorParallelCollectives` asks; a value, so that a cost model holding it travels to workers."""

    hardware: Hardware
    tp: int

    def __call__(self, kind: str, nbytes):
        return self.hardware.collective_us(kind, nbytes, range(self.tp)) / 1e3


class _Fields:
    """Reads a hardware file's fields, refusing a missing or non-positive one in one line."""

    def __init__(self, data: dict, source: str) -> None:
        self.data, self.source = data, source

    def positive(self, name: str, value: Any) -> float:
        if value is None:
            raise HardwareFileError(f"{self.source}: missing field {name!r}; {_FIX}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise HardwareFileError(f"{self.source}: {name} must be a positive number, got {value!r}; {_FIX}")
        return float(value)

    def positive_int(self, name: str, value: Any) -> int:
        if value is None:
            raise HardwareFileError(f"{self.source}: missing field {name!r}; {_FIX}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise HardwareFileError(f"{self.source}: {name} must be a positive integer, got {value!r}; {_FIX}")
        return value

    def mapping(self, name: str, required: bool = True) -> dict:
        value = self.data.get(name)
        if value is None and not required:
            return {}
        if not isinstance(value, dict):
            raise HardwareFileError(f"{self.source}: missing field {name!r} (an object); {_FIX}")
        return value

    def compute(self) -> dict:
        """The optional ``compute`` section, checked by building a roofline from it."""
        section = self.mapping("compute", required=False)
        if not section:
            return {}
        unknown = set(section) - {"sms", "gemm_tile", "gemm_efficiency", "memory_efficiency", "fused_attention",
                                  "sdpa_attention", "layer_overhead_us"}
        if unknown or "sms" not in section:
            raise HardwareFileError(f"{self.source}: compute needs 'sms' and may have gemm_tile, gemm_efficiency, "
                                    f"memory_efficiency, fused_attention, sdpa_attention, layer_overhead_us (got "
                                    f"{sorted(section)}); {_FIX}")
        try:
            for core in ("transformer_engine", "sdpa"):
                DeviceRoofline.from_section(section, peak_tflops=1.0, memory_bandwidth_GBps=1.0, core=core)
        except (TypeError, ValueError, KeyError):
            raise HardwareFileError(f"{self.source}: compute.sms and gemm_tile must be positive integers, the "
                                    "efficiencies in (0, 1], layer_overhead_us >= 0, and fused_attention (and "
                                    "sdpa_attention) forward_efficiency, backward_efficiency, forward_latency_us "
                                    "and backward_latency_us, got "
                                    f"{section}; {_FIX}") from None
        return dict(section)

    def link(self, name: str, value: Any) -> Link:
        if not isinstance(value, dict):
            raise HardwareFileError(f"{self.source}: missing field {name!r} "
                                    "({\"bandwidth_GBps\": ..., \"latency_us\": ...}); " + _FIX)
        latency = value.get("latency_us")
        if latency is None or isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency < 0:
            raise HardwareFileError(f"{self.source}: {name}.latency_us must be a number >= 0, got {latency!r}; {_FIX}")
        algorithm = value.get("algorithm", "auto")
        if algorithm not in ALGORITHMS:
            raise HardwareFileError(f"{self.source}: {name}.algorithm must be one of {', '.join(ALGORITHMS)}, "
                                    f"got {algorithm!r}")
        return Link(self.positive(f"{name}.bandwidth_GBps", value.get("bandwidth_GBps")), float(latency), algorithm)


# -- the shipped files ----------------------------------------------------------------------------

_ALIASES = {"a100": "a100-80gb-sxm", "h100": "h100-80gb-sxm"}


def _shipped() -> dict[str, Any]:
    folder = resources.files(__name__)  # the shipped files sit beside this module
    return {entry.name[:-len(".json")]: entry for entry in folder.iterdir() if entry.name.endswith(".json")}


def hardware_names() -> list[str]:
    """Names of the hardware files shipped with the package (and their short aliases)."""
    return sorted(_shipped()) + sorted(_ALIASES)


def load_hardware(name_or_path: "str | os.PathLike | Hardware") -> Hardware:
    """A shipped hardware model by name (``a100``, ``h100-80gb-sxm``, ...) or a file's path."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    text = str(name_or_path)
    shipped = _shipped()
    key = _ALIASES.get(text.lower(), text.lower())
    if key in shipped:
        return Hardware.from_json(json.loads(shipped[key].read_text()), source=f"{key}.json")
    path = Path(text)
    if not path.is_file():
        raise HardwareFileError(f"hardware {text!r} is neither a shipped model ({', '.join(hardware_names())}) nor a "
                                "file; give one of those names or a hardware file's path")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise HardwareFileError(f"{path}: not JSON ({error.msg} at line {error.lineno}); {_FIX}") from None
    return Hardware.from_json(data, source=str(path))
